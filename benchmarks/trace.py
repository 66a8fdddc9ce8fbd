"""Mooncake's request traces as a workload: load, window, scale, turn into requests.

Format (Mooncake FAST'25 `traces/*.jsonl`, one JSON object a line): `timestamp` (ms from
the trace's start), `input_length`, `output_length` (tokens) and `hash_ids`: prefix-chained
ids of 512-token blocks, so equal leading ids are a reusable prefix and
`len(hash_ids) == ceil(input_length / 512)`.

Replay (`trace_workload`):
- a window of `window` requests from `start`, timestamps relative to the window's first;
- the conversation trace's timestamps come in ~3 s buckets: requests sharing one
  timestamp are spread evenly over the gap to the next distinct timestamp
  (`spread_buckets`), so the open loop does not fire bursts the original did not have;
- `time_scale` multiplies the gaps (0.5: twice the rate);
- each hash id becomes a deterministic text block of `block_tokens` x `token_scale`
  single-token words (`benchmarks.words`, seeded by the id), so equal ids are equal
  text and a block is an exact number of tokens; the last block is cut to the request's
  (scaled) `input_length`, a prefix of its full text, as the trace's prefix rule needs;
- the output length is the trace's, capped at `max_output_tokens` (TTFT is what is
  measured; long decodes only cost the shared machine CPU).

`best_hit_rate` is the window's own best possible prefix hit: every request finds every
leading block an earlier request of the window had, in one cache that never evicts;
`best_within` the share of requests that cache brings under a number of computed tokens
(the ceiling of any router's share within a TTFT SLO).
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import orjson

from benchmarks.specs import RequestSpec
from benchmarks.words import single_token_words

#: Tokens one hash id stands for in Mooncake's traces.
TRACE_BLOCK_TOKENS: Final = 512
_REPO: Final = Path(__file__).resolve().parents[1]
#: Where the shared copies live: `../shared/fixtures/mooncake-traces/` beside the
#: checkout (or beside its parent, for a worktree one level down); never committed.
SHARED_TRACE_DIRS: Final = tuple(
    base / "shared" / "fixtures" / "mooncake-traces" for base in (_REPO.parent, _REPO.parents[1])
)
SHARED_TRACES: Final = next((d for d in SHARED_TRACE_DIRS if d.is_dir()), SHARED_TRACE_DIRS[0])
DEFAULT_TRACE: Final = SHARED_TRACES / "conversation_trace.jsonl"
#: Largest trace line read (bytes): a line is one request's ids, a few KB at most.
MAX_LINE_BYTES: Final = 1 << 20
#: Bound of the per-id text memo (ids).
MAX_BLOCK_MEMO: Final = 65_536


class TraceError(ValueError):
    """A trace line is not in Mooncake's format; the message names the line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TraceOptions:
    start: int = 0
    window: int = 400
    time_scale: float = 1.0
    token_scale: float = 1.0
    max_output_tokens: int = 16
    block_tokens: int = TRACE_BLOCK_TOKENS


def parse_line(line: str, where: str) -> TraceRequest:
    try:
        data = json.loads(line)
        ids = data["hash_ids"]
        request = TraceRequest(
            float(data["timestamp"]), int(data["input_length"]), int(data["output_length"]),
            tuple(int(i) for i in ids),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise TraceError(f"{where}: not a Mooncake trace record: {exc}") from None
    if request.input_length <= 0 or not request.hash_ids:
        raise TraceError(f"{where}: input_length and hash_ids must be non-empty")
    return request


def load_trace(path: Path, start: int = 0, window: int | None = None) -> list[TraceRequest]:
    """Requests `start` .. `start + window` of the trace at `path` (blank lines skipped)."""
    out: list[TraceRequest] = []
    index = 0
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, 1):
            if len(raw) > MAX_LINE_BYTES:
                raise TraceError(f"{path}:{number}: line longer than {MAX_LINE_BYTES} bytes")
            line = raw.decode("utf-8", errors="replace").strip()
            if not line:
                continue
            if index >= start:
                out.append(parse_line(line, f"{path}:{number}"))
                if window is not None and len(out) >= window:
                    break
            index += 1
    return out


def spread_buckets(timestamps: Sequence[float]) -> list[float]:
    """Requests sharing a timestamp spread evenly up to the next distinct one (seconds in,
    seconds out; the last bucket spreads over the mean gap between buckets)."""
    if not timestamps:
        return []
    distinct = sorted(set(timestamps))
    gaps = [b - a for a, b in itertools.pairwise(distinct)]
    mean_gap = sum(gaps) / len(gaps) if gaps else 0.0
    next_of = {a: b for a, b in itertools.pairwise(distinct)}
    counts: dict[float, int] = {}
    for t in timestamps:
        counts[t] = counts.get(t, 0) + 1
    seen: dict[float, int] = {}
    out: list[float] = []
    for t in timestamps:
        k = seen.get(t, 0)
        seen[t] = k + 1
        span = next_of.get(t, t + mean_gap) - t
        out.append(t + span * k / counts[t])
    return out


def arrivals(requests: Sequence[TraceRequest], time_scale: float = 1.0) -> list[float]:
    """Arrival offsets in seconds from the window's first request, buckets spread."""
    if not requests:
        return []
    first = requests[0].timestamp_ms
    spread = spread_buckets([(r.timestamp_ms - first) / 1e3 for r in requests])
    return [t * time_scale for t in spread]


class BlockTexts:
    """hash id -> its text block (seeded by the id), memoised within a bound."""

    def __init__(self, tokens_per_block: int, seed: int = 0) -> None:
        self.tokens = max(1, tokens_per_block)
        self.seed = seed
        self._memo: dict[int, list[str]] = {}

    def words(self, hash_id: int) -> list[str]:
        words = self._memo.get(hash_id)
        if words is None:
            rng = random.Random(f"mooncake-block:{self.seed}:{hash_id}")
            words = rng.choices(single_token_words(), k=self.tokens)
            if len(self._memo) >= MAX_BLOCK_MEMO:
                self._memo.clear()
            self._memo[hash_id] = words
        return words

    def prompt(self, hash_ids: Sequence[int], tokens: int) -> str:
        """The text of a request of `tokens` tokens whose blocks are `hash_ids`: every word
        with its leading space, so every word is one token (the first one too)."""
        parts: list[str] = []
        left = tokens
        for hash_id in hash_ids:
            if left <= 0:
                break
            words = self.words(hash_id)
            parts.extend(words[: min(left, self.tokens)])
            left -= self.tokens
        return "".join(" " + word for word in parts)


def scaled_tokens(request: TraceRequest, options: TraceOptions) -> int:
    block = max(1, round(options.block_tokens * options.token_scale))
    return max(1, min(round(request.input_length * options.token_scale),
                      block * len(request.hash_ids)))


def _best_cached(
    requests: Iterable[TraceRequest], options: TraceOptions
) -> Iterator[tuple[int, int]]:
    """(prompt tokens, tokens one infinite shared cache would serve) per request: whole
    trace blocks an earlier request had, the last prompt token always computed."""
    block = max(1, round(options.block_tokens * options.token_scale))
    seen: set[int] = set()
    for request in requests:
        tokens = scaled_tokens(request, options)
        matched = 0
        for hash_id in request.hash_ids:
            if hash_id not in seen:
                break
            matched += 1
        yield tokens, min(matched * block, tokens - 1)
        seen.update(request.hash_ids)


def best_hit_rate(requests: Iterable[TraceRequest], options: TraceOptions) -> float:
    """Share of prompt tokens an infinite shared cache would serve."""
    hits = total = 0
    for tokens, cached in _best_cached(requests, options):
        hits += cached
        total += tokens
    return hits / total if total else 0.0


def best_within(
    requests: Sequence[TraceRequest], options: TraceOptions, uncached_tokens: int
) -> float:
    """Share of requests that compute at most `uncached_tokens` with that infinite cache:
    the most any router can bring within an SLO of that many tokens' prefill on an idle
    pod (a prompt longer than the SLO allows and not cached misses it however it is
    routed)."""
    within = sum(1 for tokens, cached in _best_cached(requests, options)
                 if tokens - cached <= uncached_tokens)
    return within / len(requests) if requests else 0.0


def request_specs(
    requests: Sequence[TraceRequest], options: TraceOptions, model: str, seed: int = 0
) -> list[RequestSpec]:
    """One streaming chat request per trace record, bodies serialised up front."""
    block = max(1, round(options.block_tokens * options.token_scale))
    texts = BlockTexts(block, seed)
    specs: list[RequestSpec] = []
    for index, request in enumerate(requests):
        body = {
            "model": model,
            "messages": [{"role": "user",
                          "content": texts.prompt(request.hash_ids,
                                                  scaled_tokens(request, options))}],
            "max_tokens": max(1, min(request.output_length, options.max_output_tokens)),
            "stream": True,
        }
        specs.append(RequestSpec(index, 0, orjson.dumps(body), tag="trace"))
    return specs


@dataclass(frozen=True, slots=True)
class TraceWindow:
    """Everything one replay needs, computed once and shared by every router."""

    name: str
    requests: tuple[TraceRequest, ...]
    offsets: tuple[float, ...]
    specs: tuple[RequestSpec, ...]
    options: TraceOptions
    best_hit_rate: float

    @property
    def duration_s(self) -> float:
        return self.offsets[-1] if self.offsets else 0.0

    @property
    def prompt_tokens(self) -> int:
        return sum(scaled_tokens(r, self.options) for r in self.requests)

    def unique_tokens(self) -> int:
        block = max(1, round(self.options.block_tokens * self.options.token_scale))
        return block * len({h for r in self.requests for h in r.hash_ids})

    def input_tokens(self) -> list[int]:
        """Each request's prompt tokens (scaled), in window order."""
        return [scaled_tokens(r, self.options) for r in self.requests]

    def input_quantile(self, q: float) -> int:
        ordered = sorted(self.input_tokens())
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def best_within(self, uncached_tokens: int) -> float:
        return best_within(self.requests, self.options, uncached_tokens)

    def best_uncached_quantile(self, q: float) -> int:
        """The q-quantile of the tokens each request computes with one infinite shared
        cache: with its prefill time, a floor under the TTFT q-quantile of any router
        that answers every request (each TTFT is at least its own prefill)."""
        ordered = sorted(t - c for t, c in _best_cached(self.requests, self.options))
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def trace_window(path: Path, options: TraceOptions, model: str, seed: int = 0) -> TraceWindow:
    requests = load_trace(path, options.start, options.window)
    if not requests:
        raise TraceError(f"{path}: no request in window {options.start}+{options.window}")
    return TraceWindow(
        path.stem, tuple(requests), tuple(arrivals(requests, options.time_scale)),
        tuple(request_specs(requests, options, model, seed)), options,
        best_hit_rate(requests, options),
    )
