"""The shared KV pool (Mooncake Store) as the router sees it, with or without store events.

Mooncake's point is that a prefix any prefill pod computed can be loaded from the global
pool by any other. A ModelServer whose connector writes every prefilled block to Mooncake
Store (vLLM `MooncakeStoreConnector`, LMCache with a Mooncake backend, vllm-ascend's
`AscendStoreConnector` / MooncakeStore pool) declares it with the annotation

    pdgate.io/kv-pool: mooncake-store        # or "none" (the default)
    pdgate.io/kv-pool-capacity-tokens: "50000000"   # optional, default poolView.capacityTokens

Then the router knows the pool's content from its own dispatches: the prompt of every
request it sends to a prefill (or aggregated) pod of that server is in the pool once the
prefill ran (`PendingWrites`: counted from the predicted end of that prefill). No store
events are needed. The record is an LRU per server bounded by the
pool's capacity (in blocks of the index that keys it), as the store itself evicts least
recently used objects once full; `MAX_POOL_BLOCKS` caps it whatever the annotation says.

KV events with a store medium (`BlockStored(medium="cpu")`, one block an event) refine the
same record when engines publish them. The precise index (`precise_index.PrecisePrefixIndex`) keeps
its own store pool in engine keys and, without store events, fills it from the blocks the
server's prefill pods say they stored (`BlockStored` on their GPU: the connector writes
each of them to the store; `pool_writers` names those pods), not from dispatches: the
router then never encodes a prompt past the first block nobody holds. Who publishes what
(checked against the public sources, 2025-2026):
- vLLM with `MooncakeStoreConnector`: `BlockStored(medium="cpu")` for each block written to
  the store, its parent the request's block before it, no `BlockRemoved` (the store's
  evictions are not reported; vllm-project/vllm#44103 fixed their hashes for hybrid
  models);
- LMCache: KV events for its storage backends (LMCache RFC #1846);
- vllm-ascend with the Mooncake/Memcache KV pool (`ascend_store`): the same
  `BlockStored(medium="cpu")` in recent versions; older ones none (vllm-ascend RFC #6391,
  Mooncake RFC #1408): there the dispatch-fed view (and, for the precise index, the
  prefill pods' GPU events) is the only view;
- vLLM's GPU prefix cache and CPU `OffloadingConnector`: medium `GPU` / `CPU` (upper case:
  local to the pod, not the pool).
"""

from __future__ import annotations

import sys
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from router.view import ServerPods

POOL_ANNOTATION: Final = "pdgate.io/kv-pool"
POOL_CAPACITY_ANNOTATION: Final = "pdgate.io/kv-pool-capacity-tokens"
#: Values of `pdgate.io/kv-pool` that mean "prefill writes every block to a shared store".
POOL_KINDS: Final = frozenset({"mooncake-store", "mooncake", "store"})
#: Default capacity of a server's pool, in tokens (a few hosts' DRAM of MLA KV).
DEFAULT_POOL_CAPACITY_TOKENS: Final = 50_000_000
#: Hard ceiling of one server's pool record, in blocks, whatever the annotation says.
MAX_POOL_BLOCKS: Final = 1 << 21
#: Bound of the dispatches waiting for their prefill to end before they count as pooled,
#: and of the block keys they carry together (a prompt's are up to `maxPromptBlocks`).
MAX_PENDING: Final = 8192
MAX_PENDING_BLOCKS: Final = 1 << 20
#: Rough bytes per pool entry (an OrderedDict node and an int key), for the memory gauge.
_BYTES_PER_ENTRY: Final = 100


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """One ModelServer's pool: whether its prefill writes to a shared store, and its size."""

    enabled: bool
    capacity_tokens: int

    def capacity_blocks(self, tokens_per_block: float) -> int:
        blocks = int(self.capacity_tokens / max(1.0, tokens_per_block))
        return max(1, min(MAX_POOL_BLOCKS, blocks))


def pool_settings(
    annotations: Mapping[str, str],
    enabled_default: bool = False,
    capacity_default: int = DEFAULT_POOL_CAPACITY_TOKENS,
) -> PoolSettings:
    """A server's pool from its annotations (an unreadable capacity keeps the default)."""
    raw = annotations.get(POOL_ANNOTATION)
    enabled = enabled_default if raw is None else raw.strip().lower() in POOL_KINDS
    capacity = capacity_default
    text = annotations.get(POOL_CAPACITY_ANNOTATION)
    if text is not None:
        try:
            capacity = max(1, int(text))
        except ValueError:
            pass
    return PoolSettings(enabled, capacity)


def pool_writers(
    servers: Iterable[ServerPods], enabled: bool, capacity_tokens: int
) -> dict[str, tuple[str, PoolSettings]]:
    """Pod key -> (its server's scope, that server's pool) for every pod whose computed
    blocks go to a declared pool: the prefill pods of a PD server, every pod of an
    aggregated one (none when the pool view is off, `poolView.enabled: false`)."""
    out: dict[str, tuple[str, PoolSettings]] = {}
    if not enabled:
        return out
    for server in servers:
        meta = server.server.meta
        pool = pool_settings(meta.annotations, False, capacity_tokens)
        if not pool.enabled:
            continue
        scope = f"{meta.namespace}/{meta.name}"
        pods = [p for g in server.groups for p in g.prefill] or list(server.aggregated)
        for pod in pods:
            out.setdefault(pod.key, (scope, pool))
    return out


class PendingWrites:
    """Pool records that take effect when the prefill that writes them is predicted to end.

    A prefill writes its blocks to the store as it computes them, so a request dispatched
    right after another with the same prefix would find nothing to pull yet: counting the
    blocks at dispatch would send it to a cold pod. Each record waits until `ready_at`
    (dispatch time + the predicted prefill phase); `flush` applies the due ones (called at
    every pick). Bounded by `MAX_PENDING` records and `MAX_PENDING_BLOCKS` block keys:
    beyond either the oldest is applied at once.
    """

    def __init__(self) -> None:
        self._queue: deque[tuple[float, Callable[[], None], int]] = deque()
        self._blocks = 0

    def defer(self, ready_at: float, apply: Callable[[], None], blocks: int) -> None:
        """Call `apply` (which records `blocks` block keys) once `ready_at` has passed."""
        queue = self._queue
        while queue and (len(queue) >= MAX_PENDING
                         or self._blocks + blocks > MAX_PENDING_BLOCKS):
            self._apply(queue.popleft())
        queue.append((ready_at, apply, blocks))
        self._blocks += blocks

    def flush(self, now: float) -> None:
        queue = self._queue
        while queue and queue[0][0] <= now:
            self._apply(queue.popleft())
        # Out-of-order ready times: a later dispatch may be due first; scan a few more.
        if queue and len(queue) < 64:
            due = [item for item in queue if item[0] <= now]
            if due:
                for item in due:
                    queue.remove(item)
                    self._apply(item)

    def _apply(self, item: tuple[float, Callable[[], None], int]) -> None:
        self._blocks -= item[2]
        item[1]()

    @property
    def blocks(self) -> int:
        """Block keys the waiting records carry."""
        return self._blocks

    def __len__(self) -> int:
        return len(self._queue)


def touch_lru(pool: OrderedDict[int, None], keys: Sequence[int], limit: int) -> int:
    """Mark `keys` as the youngest entries of the LRU `pool` (a key seen again moves to the
    young end), then evict the oldest down to `limit`; returns how many were evicted."""
    move = pool.move_to_end
    for key in keys:
        if key in pool:
            move(key)
        else:
            pool[key] = None
    evicted = 0
    while len(pool) > limit:
        pool.popitem(last=False)
        evicted += 1
    return evicted


class PoolView:
    """Per-server LRU of the block keys the pool holds, learned from dispatches."""

    def __init__(self) -> None:
        self._pools: dict[str, OrderedDict[int, None]] = {}
        self.evictions = 0

    def record(self, scope: str, keys: Sequence[int], capacity_blocks: int) -> None:
        """The blocks of a dispatched prompt are (or will be) in `scope`'s pool."""
        if not keys:
            return
        pool = self._pools.get(scope)
        if pool is None:
            pool = self._pools[scope] = OrderedDict()
        self.evictions += touch_lru(pool, keys, min(capacity_blocks, MAX_POOL_BLOCKS))

    def depth(self, scope: str, keys: Sequence[int]) -> int:
        """Leading blocks of `keys` the pool holds (a block without its parent is useless)."""
        pool = self._pools.get(scope)
        if not pool:
            return 0
        depth = 0
        for key in keys:
            if key not in pool:
                break
            depth += 1
        return depth

    def retain_scopes(self, scopes: Iterable[str]) -> None:
        """Forget servers that left the view."""
        present = set(scopes)
        for scope in [s for s in self._pools if s not in present]:
            del self._pools[scope]

    @property
    def total_blocks(self) -> int:
        return sum(len(p) for p in self._pools.values())

    def memory_bytes(self) -> int:
        return sum(sys.getsizeof(p) + _BYTES_PER_ENTRY * len(p) for p in self._pools.values())
