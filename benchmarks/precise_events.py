"""The precise index's own CPU on a Mooncake trace window (a measurement, not a test).

    .venv/bin/python -m benchmarks.precise_events [--trace PATH] [--window 800]

What the precise index adds to a trace run, without the rest of it: its two jobs, timed
in this process. The window's prompts (token scale 0.25, as the trace phase of `make
bench`) each go to the one of `--pods` simulated prefill caches
(`engine_sim.prefix_cache.PrefixCache`, the trace phase's capacity) holding the longest
prefix; the events those caches report (`BlockStored` / `BlockRemoved`, medium GPU) and
the Mooncake Store writes of blocks the store did not hold yet (one `BlockStored` a block,
medium `cpu`, as vLLM's MooncakeStoreConnector) are batched and encoded as the simulator's
publisher does (a request's cache events in one batch, consecutive evictions merged into
one event; its store writes in another).
Then, `--rounds` times, request by request: the router's lazy tokenize-and-hash of the
prompt against the index so far (`PreciseHasher.leading_hashes`, a fresh tokenizer memo
each round), then decoding and applying that request's batches to a `PrecisePrefixIndex`
keyed on tokens (the trace phase's mode). Prints the quietest round: CPU of each job, the
blocks named in events, and the prompt tokens the walk had to read (the leading blocks
some pod or the store held, plus the block where it stopped) against those it encoded.
The trace is read by path (never committed); without one, nothing runs.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from benchmarks.trace import DEFAULT_TRACE, TraceOptions, trace_window
from engine_sim.block_hash import hash_prompt_blocks
from engine_sim.cache_events import CacheEvent
from engine_sim.kv_events_pub import (
    LAYOUTS,
    Event,
    append_event,
    encode_batch,
    store_write_events,
    wire_event,
)
from engine_sim.prefix_cache import PrefixCache
from engine_sim.prompts import DEFAULT_CHAT_TEMPLATE, DEFAULT_TOKENIZER
from router.kvhash.keyspace import KeySpace
from router.scheduling.block_hash import PreciseHasher
from router.scheduling.kv_wire import apply_events, decode_batch
from router.scheduling.precise_index import PrecisePrefixIndex
from router.tokenization import ModelTokenizer

BLOCK_SIZE = 16
#: The trace phase's prefill pods hold about this many blocks (`--kv-capacity-blocks`).
CAPACITY_BLOCKS = 21_370


@dataclass(frozen=True, slots=True)
class Request:
    """One trace request: its body, and the batches its prefill pod published."""

    body: dict[str, Any]
    batches: list[tuple[int, bytes]]


@dataclass(slots=True)
class Round:
    """CPU seconds of one pass, and what it read."""

    tokenize: float = 0.0
    decode: float = 0.0
    apply: float = 0.0
    walked_tokens: int = 0
    encoded_tokens: int = 0

    @property
    def total(self) -> float:
        return self.tokenize + self.decode + self.apply


def window_requests(
    path: Path, window: int, pods: int, layout: str = "map"
) -> tuple[list[Request], int]:
    """The window's requests with their event batches, and the blocks the events name."""
    options = TraceOptions(0, window, 0.4, 0.25, 16)
    specs = trace_window(path, options, "bench-model").specs
    tokenizer = _tokenizer()
    reported: list[CacheEvent] = []
    caches = [PrefixCache(CAPACITY_BLOCKS, BLOCK_SIZE, on_event=reported.append)
              for _ in range(pods)]
    in_store: set[int] = set()
    requests: list[Request] = []
    blocks = 0
    for index, spec in enumerate(specs):
        body = orjson.loads(spec.body)
        ids = tokenizer.request_ids("chat", body)[0]
        hashes = hash_prompt_blocks(ids, BLOCK_SIZE)
        pod = max(range(pods), key=lambda p: (caches[p].match(hashes), (index - p) % pods))
        caches[pod].release(caches[pod].acquire(hashes, ids))
        cache_events: list[Event] = []
        for reported_event in reported:
            append_event(cache_events, wire_event(reported_event))
        reported.clear()
        written = [i for i, h in enumerate(hashes) if h not in in_store]
        in_store.update(hashes)
        store_events: list[Event] = list(store_write_events(hashes, written, ids, BLOCK_SIZE))
        batches = [batch for batch in (cache_events, store_events) if batch]
        blocks += sum(len(getattr(event, "block_hashes", ())) for batch in batches
                      for event in batch)
        requests.append(Request(body, [
            (pod, encode_batch(0.0, batch, None, layout))
            for batch in batches
        ]))
    return requests, blocks


def replay(requests: list[Request], pods: int) -> Round:
    """One pass over the window into a fresh index and a fresh tokenizer memo."""
    tokenizer = _tokenizer()
    encode = tokenizer._encode
    figures = Round()

    def counted(texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        ids = encode(texts, add_special_tokens)
        figures.encoded_tokens += sum(len(one) for one in ids)
        return ids

    tokenizer._encode = counted  # type: ignore[method-assign]
    space = KeySpace.of("tokens", block_size=BLOCK_SIZE)
    hasher = PreciseHasher(space)
    index = PrecisePrefixIndex()
    index.set_spaces({"bench": space})
    keys = [f"pod-{p}" for p in range(pods)]
    for request in requests:
        started = time.process_time()
        found = hasher.leading_hashes(tokenizer.id_stream("chat", request.body), None, space,
                                      index.known("bench"))
        figures.tokenize += time.process_time() - started
        figures.walked_tokens += (len(found.keys) + (not found.complete)) * BLOCK_SIZE
        for pod, payload in request.batches:
            started = time.process_time()
            events = decode_batch(payload)
            decoded = time.process_time()
            apply_events(index, keys[pod], "bench", events)
            figures.decode += decoded - started
            figures.apply += time.process_time() - decoded
    return figures


def _tokenizer() -> ModelTokenizer:
    return ModelTokenizer.load(DEFAULT_TOKENIZER, chat_template_file=DEFAULT_CHAT_TEMPLATE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--window", type=int, default=800)
    parser.add_argument("--pods", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layout", choices=LAYOUTS, default="map",
                        help="event batches as vLLM writes them now (map) or before (array)")
    args = parser.parse_args()
    if not args.trace.exists():
        raise SystemExit(f"no trace at {args.trace}: pass --trace PATH")
    requests, blocks = window_requests(args.trace, args.window, args.pods, args.layout)
    best = min((replay(requests, args.pods) for _ in range(args.rounds)),
               key=lambda r: r.total)
    events = best.decode + best.apply
    print(f"{args.trace.stem}, {len(requests)} requests, {args.layout} batches: tokenize and hash "
          f"{best.tokenize:.3f} s (walked {best.walked_tokens} prompt tokens, encoded "
          f"{best.encoded_tokens}); KV events {events:.3f} s (decode {best.decode:.3f} + "
          f"apply {best.apply:.3f}) for {blocks} blocks named, "
          f"{events / blocks * 1e6:.2f} µs a block")


if __name__ == "__main__":
    main()
