"""Data parallelism with one API server (`--data-parallel-size N`, vLLM's internal load
balancing): which of the N engine cores (ranks 0..N-1) serves a request.

Each rank is a whole `Engine` (its own scheduler, compute line, prefix cache, KV events,
stats); this module only routes requests to them, as vLLM's API server does:

- `X-data-parallel-rank` (any case) pins a request to a rank. vLLM reads the header with
  `int()` and takes a value that is not an integer as no header at all
  (`OpenAIServing._get_data_parallel_rank`); an integer outside [0, N) is refused by the
  input processor with a ValueError, which the server answers 400 `BadRequestError`
  "data_parallel_rank R is out of range [0, N)." (`InputProcessor.process_inputs`).
- Without a pin, `Balancer` picks, restating `DPLBAsyncMPClient.get_core_engine_for_request`
  for one API server: each rank scores max(its requests in flight from this server,
  waiting + running), plus waiting x 6 x max(0, KV usage - 0.5) when it has a queue; the
  lowest score wins, ties going to the first rank scanned; the scan starts one rank further
  after every balanced pick. vLLM reads waiting / running / KV usage from the coordinator's
  snapshot (every 100 ms) and bumps the chosen rank's waiting count until the next one; the
  simulator reads the live counts instead, so it needs no such bump.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from engine_sim.protocol import RequestError

if TYPE_CHECKING:
    from engine_sim.engine import Engine

#: vLLM's header (HTTP header names are case-insensitive).
RANK_HEADER: Final = "X-data-parallel-rank"


def rank_from_header(value: str | None) -> int | None:
    """The pinned rank, as vLLM reads the header: a non-integer counts as no pin."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


def check_rank(rank: int, size: int) -> None:
    """Refuse a rank the server does not have, as vLLM does (400)."""
    if not 0 <= rank < size:
        raise RequestError(f"data_parallel_rank {rank} is out of range [0, {size}).")


def rank_engine_id(engine_id: str, rank: int, size: int) -> str:
    """A rank's KV-connector engine id: vLLM suffixes `_dp<rank>` when data parallel."""
    return engine_id if size == 1 else f"{engine_id}_dp{rank}"


@dataclass(frozen=True, slots=True)
class Load:
    """What the balancer knows of one rank (vLLM's coordinator counts)."""

    waiting: int
    running: int
    kv_usage: float


class Balancer:
    """vLLM's internal data-parallel load balancer for one API server (module docstring)."""

    def __init__(self, size: int) -> None:
        self.inflight = [0] * size  # this server's unfinished requests per rank
        self._start = 0

    def pick(self, loads: Sequence[Load]) -> int:
        best, best_score = 0, math.inf
        size = len(loads)
        for step in range(size):
            rank = (self._start + step) % size
            load = loads[rank]
            score = float(max(self.inflight[rank], load.waiting + load.running))
            if load.waiting:
                score += load.waiting * 6.0 * max(0.0, load.kv_usage - 0.5)
            if score < best_score:
                best, best_score = rank, score
        self._start = (self._start + 1) % size
        return best


class EngineGroup:
    """The N engine cores behind one HTTP server, rank order."""

    def __init__(self, engines: Sequence[Engine]) -> None:
        if not engines:
            raise ValueError("an engine group needs at least one engine")
        self.engines = tuple(engines)
        self.balancer = Balancer(len(self.engines))

    @property
    def size(self) -> int:
        return len(self.engines)

    def choose(self, header: str | None) -> int:
        """The rank for a request with this `X-data-parallel-rank` value (or None)."""
        rank = rank_from_header(header)
        if rank is None:
            return self.balancer.pick(
                [Load(e.waiting, e.running, e.cache.usage()) for e in self.engines]
            )
        check_rank(rank, self.size)
        return rank

    @contextmanager
    def route(self, header: str | None) -> Iterator[Engine]:
        """The engine that serves a request, counted in flight until the request ends.

        Raises RequestError (before yielding) for an out-of-range pin."""
        rank = self.choose(header)
        self.balancer.inflight[rank] += 1
        try:
            yield self.engines[rank]
        finally:
            self.balancer.inflight[rank] -= 1


def rank_view(
    engines: Sequence[Engine], query: str | None, view: Callable[[Engine], dict[str, Any]]
) -> dict[str, Any]:
    """A debug view's body (`/sim/stats`, `/sim/cache`): the one engine's `view`, rank R's
    with `?rank=R`, else `{"data_parallel_size": N, "ranks": [each rank's, with its
    "data_parallel_rank"]}`. Raises ValueError for a rank the server does not have."""
    rank = rank_query(query, len(engines))
    if rank is not None or len(engines) == 1:
        return view(engines[rank or 0])
    return {"data_parallel_size": len(engines),
            "ranks": [{"data_parallel_rank": e.rank, **view(e)} for e in engines]}


def rank_query(value: str | None, size: int) -> int | None:
    """`?rank=R` of the debug views: one rank's own body; raises ValueError if not a rank."""
    if value is None:
        return None
    rank = int(value)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is out of range [0, {size})")
    return rank
