"""The precise prefix index: exactly the blocks each engine says it holds (KV events).

Fed by `kv_events.KVEventsManager` from every prefill/aggregated pod's event stream, so
every router replica that reads the same streams holds the same index, with no
coordination between replicas.

Per pod: block hash -> bitmask of the media it is held in (`GPU`, or no medium, is local
HBM; any other medium that is not a store medium, e.g. `CPU` offload, also counts as
local to that pod). A block counts for the pod while any local medium holds it; a
`BlockRemoved` names the medium it left. `AllBlocksCleared` empties the pod.

Store media (`store_media`, default `MOONCAKE`): a block written to a shared KV store
(Mooncake Store) is reusable by EVERY prefill pod of the same ModelServer (its "scope"),
so such blocks go to one pool per scope instead of to the pod. A scorer credits a pool
block at a cost factor below a local hit (`precise_prefix_cache.PrecisePrefixCacheScorer`).

Bounds: one pod holds at most `max_blocks_per_pod` entries and one pool at most
`max_store_blocks`; beyond that the oldest-stored entries go first (an engine that
publishes correctly never gets there: the bound guards against a lost `BlockRemoved`).
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Final

from router.scheduling.block_index import PodSlots, leading_depths_with_shared

#: Default bound of one pod's entries (blocks): well above a large GPU's block count.
DEFAULT_MAX_BLOCKS_PER_POD: Final = 262_144
#: Default bound of one scope's store pool (blocks).
DEFAULT_MAX_STORE_BLOCKS: Final = 1 << 20
#: Default store media: blocks in these are shared by every prefill pod of the scope.
DEFAULT_STORE_MEDIA: Final = frozenset({"MOONCAKE"})
#: Distinct local media names tracked with their own bit (more share the last bit).
MAX_MEDIA_BITS: Final = 16
#: Distinct medium names remembered at all (an engine naming more gets the shared bit).
MAX_MEDIA_NAMES: Final = 64
GPU_MEDIUM: Final = "GPU"
_BYTES_PER_GLOBAL_KEY: Final = 40


class PrecisePrefixIndex:
    """Exact per-pod block sets from KV events, plus shared store pools per scope."""

    def __init__(
        self,
        max_blocks_per_pod: int = DEFAULT_MAX_BLOCKS_PER_POD,
        max_store_blocks: int = DEFAULT_MAX_STORE_BLOCKS,
        store_media: Iterable[str] = DEFAULT_STORE_MEDIA,
    ) -> None:
        self.max_blocks_per_pod = max_blocks_per_pod
        self.max_store_blocks = max_store_blocks
        self.store_media = frozenset(m.upper() for m in store_media)
        self._slots = PodSlots()
        self._masks: dict[int, int] = {}
        self._pods: dict[str, OrderedDict[int, int]] = {}
        self._stores: dict[str, OrderedDict[int, None]] = {}
        self._media: dict[str | None, int] = {None: 1, GPU_MEDIUM: 1}
        self.overflow_evictions = 0

    def _medium_bit(self, medium: str | None) -> int:
        bit = self._media.get(medium)
        if bit is None:
            bit = 1 << min(len(set(self._media.values())), MAX_MEDIA_BITS - 1)
            if len(self._media) < MAX_MEDIA_NAMES:
                self._media[medium] = bit
        return bit

    def is_store_medium(self, medium: str | None) -> bool:
        return medium is not None and medium.upper() in self.store_media

    # -- events ---------------------------------------------------------------------------

    def stored(self, key: str, scope: str, hashes: Sequence[int], medium: str | None) -> None:
        if self.is_store_medium(medium):
            pool = self._stores.get(scope)
            if pool is None:
                pool = self._stores[scope] = OrderedDict()
            for block_hash in hashes:
                pool[block_hash] = None
            while len(pool) > self.max_store_blocks:
                pool.popitem(last=False)
                self.overflow_evictions += 1
            return
        blocks = self._pods.get(key)
        if blocks is None:
            blocks = self._pods[key] = OrderedDict()
        bit = self._medium_bit(medium)
        pod_bit = 1 << self._slots.acquire(key)
        masks = self._masks
        for block_hash in hashes:
            held = blocks.get(block_hash)
            if held is None:
                blocks[block_hash] = bit
                masks[block_hash] = masks.get(block_hash, 0) | pod_bit
            else:
                blocks[block_hash] = held | bit
        if len(blocks) > self.max_blocks_per_pod:
            clear = ~pod_bit
            while len(blocks) > self.max_blocks_per_pod:
                block_hash, _ = blocks.popitem(last=False)
                self._unmask(block_hash, clear)
                self.overflow_evictions += 1

    def removed(self, key: str, scope: str, hashes: Sequence[int], medium: str | None) -> None:
        if self.is_store_medium(medium):
            pool = self._stores.get(scope)
            if pool is not None:
                for block_hash in hashes:
                    pool.pop(block_hash, None)
            return
        blocks = self._pods.get(key)
        slot = self._slots.get(key)
        if blocks is None or slot is None:
            return
        bit = self._medium_bit(medium)
        clear = ~(1 << slot)
        for block_hash in hashes:
            held = blocks.get(block_hash)
            if held is None:
                continue
            held &= ~bit
            if held:
                blocks[block_hash] = held
            else:
                del blocks[block_hash]
                self._unmask(block_hash, clear)

    def cleared(self, key: str) -> None:
        """`AllBlocksCleared` from pod `key` (its own cache; store pools are untouched)."""
        blocks = self._pods.pop(key, None)
        slot = self._slots.get(key)
        if blocks is not None and slot is not None:
            clear = ~(1 << slot)
            for block_hash in blocks:
                self._unmask(block_hash, clear)

    def _unmask(self, block_hash: int, clear: int) -> None:
        left = self._masks.get(block_hash, 0) & clear
        if left:
            self._masks[block_hash] = left
        else:
            self._masks.pop(block_hash, None)

    def remove_pod(self, key: str) -> None:
        self.cleared(key)
        self._slots.release(key)

    def retain_scopes(self, scopes: Iterable[str]) -> None:
        present = set(scopes)
        for scope in [s for s in self._stores if s not in present]:
            del self._stores[scope]

    # -- lookups --------------------------------------------------------------------------

    def match(
        self, keys: Sequence[str], scope: str, hashes: Sequence[int]
    ) -> tuple[list[int], list[int]]:
        """Per pod in `keys`: (leading blocks held locally, leading blocks local or pooled)."""
        n = len(keys)
        pool = self._stores.get(scope)
        if not hashes:
            return [0] * n, [0] * n
        mask, slots = self._slots.mask_of(keys)
        if not mask and not pool:
            return [0] * n, [0] * n
        if not mask:
            depth = 0
            for block_hash in hashes:
                if pool is None or block_hash not in pool:
                    break
                depth += 1
            return [0] * n, [depth] * n
        local, reach = leading_depths_with_shared(self._masks, pool, hashes, mask)
        pooled = 0
        if pool:
            for block_hash in hashes:
                if block_hash not in pool:
                    break
                pooled += 1
        lget = local.get
        rget = reach.get
        return (
            [lget(s, 0) for s in slots],
            [max(rget(s, 0), pooled) for s in slots],
        )

    def holds(self, key: str, block_hash: int) -> bool:
        blocks = self._pods.get(key)
        return blocks is not None and block_hash in blocks

    def blocks_of(self, key: str) -> set[int]:
        return set(self._pods.get(key, ()))

    def store_blocks(self, scope: str) -> set[int]:
        return set(self._stores.get(scope, ()))

    @property
    def total_blocks(self) -> int:
        return sum(len(b) for b in self._pods.values()) + sum(
            len(p) for p in self._stores.values()
        )

    def memory_bytes(self) -> int:
        size = sys.getsizeof(self._masks) + _BYTES_PER_GLOBAL_KEY * len(self._masks)
        for table in self._pods.values():
            size += sys.getsizeof(table)
        for pool in self._stores.values():
            size += sys.getsizeof(pool)
        return size
