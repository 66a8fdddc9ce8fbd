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

One node of a multi-node deployment (`--data-parallel-size-local L`,
`--data-parallel-start-rank S` with `--data-parallel-hybrid-lb`, or `--data-parallel-rank R`):
the process runs global ranks S..S+L-1 and its API server serves those only (vLLM's
`local_engines_only`, true with hybrid or external load balancing). vLLM's client then
manages `engine_ranks_managed = range(S, S + L)` and takes the header's value as an INDEX
into that list (`MPClient.__init__`, `DPLBAsyncMPClient.get_core_engine_for_request`), and
the input processor checks it against [0, L) instead of [0, N): so `X-data-parallel-rank: i`
pins the engine of global rank S + i, and the balancer spreads unpinned requests over the
local engines only. `EngineGroup` holds the local engines in rank order, so its index is
that header value in every mode (with one API server for all ranks, S = 0 and L = N: the
index is the rank). Everything else names an engine by its global rank (`Engine.rank`):
KV events ports and batches, the `engine` metric label, debug views.
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
    """Refuse a rank the server does not have, as vLLM does (400). `size` is the number of
    engines the server serves: N with one API server for all ranks, L with hybrid or
    external load balancing (vLLM's `num_ranks`)."""
    if not 0 <= rank < size:
        raise RequestError(f"data_parallel_rank {rank} is out of range [0, {size}).")


def rank_engine_id(engine_id: str, local_rank: int, size: int) -> str:
    """An engine's KV-connector engine id: vLLM suffixes `_dp<local_dp_rank>` when data
    parallel (`EngineCoreProc.run_engine_core`). The local rank is the engine's index on its
    node (`CoreEngineProcManager` counts it from 0 on every node of `vllm serve`), so it is
    the global rank with one API server for all ranks, and 0..L-1 on each node otherwise:
    node ids differ by their base id (vLLM's default is a random uuid per process)."""
    return engine_id if size == 1 else f"{engine_id}_dp{local_rank}"


#: Bound on --data-parallel-size: vLLM's engine identities are 2-byte little-endian ints.
MAX_DATA_PARALLEL_SIZE: Final = 1 << 16


def check_layout(size: int, size_local: int, start_rank: int) -> None:
    """Refuse a node that runs ranks outside the deployment's 0..N-1 (ValueError)."""
    if not 0 < size <= MAX_DATA_PARALLEL_SIZE:
        raise ValueError(f"--data-parallel-size must be in 1..{MAX_DATA_PARALLEL_SIZE}")
    if size_local < 1:
        raise ValueError("--data-parallel-size-local must be positive")
    if start_rank < 0:
        raise ValueError("--data-parallel-start-rank must be >= 0")
    if start_rank + size_local > size:
        raise ValueError(
            f"ranks {start_rank}..{start_rank + size_local - 1} (--data-parallel-start-rank "
            f"{start_rank}, --data-parallel-size-local {size_local}) are past "
            f"--data-parallel-size {size}"
        )


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
    """The engine cores behind one HTTP server, in global rank order: all N ranks, or the
    L ranks of one node (module docstring). Indexes into `engines` are what
    `X-data-parallel-rank` names."""

    def __init__(self, engines: Sequence[Engine]) -> None:
        if not engines:
            raise ValueError("an engine group needs at least one engine")
        self.engines = tuple(engines)
        self.balancer = Balancer(len(self.engines))

    @property
    def size(self) -> int:
        return len(self.engines)

    def choose(self, header: str | None) -> int:
        """The index into `engines` for a request with this `X-data-parallel-rank` value (or
        None): vLLM's index into the client's `core_engines`."""
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
    """A debug view's body (`/sim/stats`, `/sim/cache`): the one engine's `view`, global
    rank R's with `?rank=R`, else `{"data_parallel_size": N, "ranks": [each rank's, with its
    "data_parallel_rank"]}`. A node of a larger deployment (L < N) always lists its ranks,
    even one, and says which: `data_parallel_size_local` L and `data_parallel_start_rank` S
    after N. Raises ValueError for a rank the server does not run."""
    config = engines[0].config
    ranks = range(engines[0].rank, engines[0].rank + len(engines))
    index = rank_query(query, ranks)
    partial = len(engines) < config.data_parallel_size
    if index is not None or (len(engines) == 1 and not partial):
        return view(engines[index or 0])
    node = {"data_parallel_size_local": len(engines), "data_parallel_start_rank": ranks.start}
    return {"data_parallel_size": config.data_parallel_size, **(node if partial else {}),
            "ranks": [{"data_parallel_rank": e.rank, **view(e)} for e in engines]}


def rank_query(value: str | None, ranks: range) -> int | None:
    """`?rank=R` of the debug views, a global rank: the index of its engine among `ranks`
    (the server's); raises ValueError if the server does not run it."""
    if value is None:
        return None
    rank = int(value)
    if rank not in ranks:
        raise ValueError(f"rank {rank} is out of range [{ranks.start}, {ranks.stop})")
    return rank - ranks.start
