"""Tokenization cost per request with the real DeepSeek tokenizer (the router's path).

    .venv/bin/python -m benchmarks.tokenization [--iterations 30]

Cases (p50 and p90 in µs, one request each, in this process, on the calling thread):
- chat 1k / 8k prompt tokens, memo cold (every request's text is new) and warm (the same
  request again: every piece between added tokens is memoized);
- chat with a repeated ~1k-token system prompt and a new 30-token question each time (the
  common case: only the question is encoded);
- completions 1k / 8k text cold;
- the event-loop cost of handing one job to the tokenize pool and back
  (`router.tokenization.offload`), which sets `OFFLOAD_MIN_CHARS`.
The coordinator can wire `run()` into `make bench`; it returns the figures as a dict.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from engine_sim.prompts import DEFAULT_CHAT_TEMPLATE, DEFAULT_TOKENIZER
from router.tokenization import ModelTokenizer, TokenizePool

_WORDS = (
    "cache", "prefix", "router", "engine", "token", "block", "decode", "prefill",
    "latency", "scheduler", "Mooncake", "store", "the", "of", "and", "42", "GPU,",
)  # fmt: skip


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _quantiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[int(0.9 * (len(ordered) - 1))]


def _time(fn: Callable[[int], Any], iterations: int) -> tuple[float, float]:
    samples = []
    for i in range(iterations):
        start = time.perf_counter()
        fn(i)
        samples.append((time.perf_counter() - start) * 1e6)
    return _quantiles(samples)


def _words_for(tokenizer: ModelTokenizer, tokens: int) -> int:
    probe = _text(random.Random(0), 1000)
    per_word = len(tokenizer.encode(probe, False)) / 1000
    return max(1, int(tokens / per_word))


async def _handoff_us(iterations: int) -> tuple[float, float]:
    pool = TokenizePool()
    loop = asyncio.get_running_loop()
    samples = []
    try:
        for _ in range(iterations):
            start = time.perf_counter()
            await loop.run_in_executor(pool._executor, int)
            samples.append((time.perf_counter() - start) * 1e6)
    finally:
        pool.close()
    return _quantiles(samples)


def run(iterations: int = 30) -> dict[str, tuple[float, float]]:
    """Every case's (p50 µs, p90 µs)."""
    tokenizer = ModelTokenizer.load(DEFAULT_TOKENIZER, chat_template_file=DEFAULT_CHAT_TEMPLATE)
    rng = random.Random(1)
    out: dict[str, tuple[float, float]] = {}
    for tokens in (1000, 8000):
        words = _words_for(tokenizer, tokens)
        bodies = [{"messages": [{"role": "user", "content": f"{i} " + _text(rng, words)}]}
                  for i in range(iterations)]  # fmt: skip
        prompts = [f"{i} " + _text(rng, words) for i in range(iterations)]

        def cold(i: int, b: list[dict[str, Any]] = bodies) -> Any:
            return tokenizer.chat_ids(b[i])

        def warm(i: int, b: list[dict[str, Any]] = bodies) -> Any:
            return tokenizer.chat_ids(b[0])

        def completion(i: int, p: list[str] = prompts) -> Any:
            return tokenizer.completion_ids(p[i])

        out[f"chat {tokens // 1000}k cold"] = _time(cold, iterations)
        out[f"chat {tokens // 1000}k warm"] = _time(warm, iterations)
        out[f"completion {tokens // 1000}k cold"] = _time(completion, iterations)
    system = "You are a support agent. " + _text(rng, _words_for(tokenizer, 1000))
    questions = [_text(rng, 20) + f" #{i}?" for i in range(iterations + 1)]
    tokenizer.chat_ids({"messages": [{"role": "system", "content": system},
                                     {"role": "user", "content": questions[-1]}]})  # fmt: skip
    def with_system(i: int) -> Any:
        user = {"role": "user", "content": questions[i]}
        return tokenizer.chat_ids({"messages": [{"role": "system", "content": system}, user]})

    out["chat 1k system + new question"] = _time(with_system, iterations)
    out["pool handoff (loop side)"] = asyncio.run(_handoff_us(iterations * 10))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=30)
    args = parser.parse_args()
    print(f"{'case':34} {'p50 µs':>10} {'p90 µs':>10}")
    for name, (p50, p90) in run(args.iterations).items():
        print(f"{name:34} {p50:10.0f} {p90:10.0f}")


if __name__ == "__main__":
    main()
