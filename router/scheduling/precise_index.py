"""The precise prefix index: exactly the blocks each engine says it holds (KV events).

Fed by `kv_events.KVEventsManager` from every prefill/aggregated pod's event stream, so
every router replica that reads the same streams holds the same index, with no
coordination between replicas.

Per pod: block hash -> bitmask of the media it is held in (`GPU`, or no medium, is local
HBM; any other medium that is not a store medium, e.g. `CPU` offload, also counts as
local to that pod). A block counts for the pod while any local medium holds it; a
`BlockRemoved` names the medium it left. `AllBlocksCleared` empties the pod.

Store media (`store_media`, default `cpu`, matched as spelt): a block written to a shared KV
store (Mooncake Store) is reusable by EVERY prefill pod of the same ModelServer (its "scope"),
so such blocks go to one pool per scope instead of to the pod. vLLM's
`MooncakeStoreConnector` (and vllm-ascend's Mooncake/Memcache pool) publish a block written
to the store as `BlockStored(medium="cpu")`, one block an event; vLLM's CPU
`OffloadingConnector` publishes its own tier as `"CPU"`: the case tells the two apart, so
media are compared exactly. A scorer credits a pool block at a cost factor below a local
hit (`precise_prefix_cache.PrecisePrefixCacheScorer`).
Engines that publish no store events (vllm-ascend's KV pool) still write every block
their prefill computes to the store: the pods `set_pool_writers` names (prefill pods of a
ModelServer that declares a pool, `pool_view.py`) put each block they store locally into
their scope's pool as well, an LRU bounded by the pool's capacity, until the scope's
engines publish a store medium themselves.

Keys (`router.kvhash.keyspace`): per scope (ModelServer) a `KeySpace` says whether blocks
are keyed by the engine's own hashes (`hashes`) or by router keys recomputed from the
token ids each `BlockStored` carries (`tokens`, robust to vLLM's random per-process root).
A scope without a key space (`set_spaces` never named it) is keyed by engine hashes. In
`tokens` mode a pod's table still maps the engine's hash (what `BlockRemoved` and
`parent_block_hash` speak) to its entry, and the entry packs the router key above the
medium bits, so no second table is kept per pod; a store pool keeps its engine-hash ->
router-key aliases in one more table under the same bound. Blocks that cannot be keyed
(unknown parent, no token ids, another block size) are left out and counted in
`unkeyed_blocks`.

Bounds: one pod holds at most `max_blocks_per_pod` entries and one pool at most
`max_store_blocks` (aliases included); beyond that the oldest-stored entries go first (an
engine that publishes correctly never gets there: the bound guards against a lost
`BlockRemoved`), a sixteenth of the bound at a time (`trim_oldest`).

Tables are plain dicts (insertion-ordered), not `OrderedDict`s: every block of every event
goes through them, and compiled code reaches a plain dict's C functions directly where an
`OrderedDict` costs a method call and a linked-list node per entry. Measured on the events
of a Mooncake conversation-trace window (`benchmarks/precise_events.py`: 444k blocks named,
160k held at the end): the index took 25 MB instead of 40, applying the events 10-15% less
CPU. Only the LRU pools of engines without store events (`record_pool`) keep an
`OrderedDict` for `move_to_end`.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import islice
from typing import Any, Final

from router.kvhash.keyspace import TOKENS_ROOT, KeySpace
from router.kvhash.vllm import DEFAULT_BLOCK_SIZE
from router.scheduling.block_index import PodSlots, leading_depths_with_shared
from router.scheduling.pool_view import PoolSettings, touch_lru

#: Default bound of one pod's entries (blocks): well above a large GPU's block count.
DEFAULT_MAX_BLOCKS_PER_POD: Final = 262_144
#: Default bound of one scope's store pool (blocks).
DEFAULT_MAX_STORE_BLOCKS: Final = 1 << 20
#: Default store media: blocks in these are shared by every prefill pod of the scope.
DEFAULT_STORE_MEDIA: Final = frozenset({"cpu"})
#: Distinct local media names tracked with their own bit (more share the last bit).
MAX_MEDIA_BITS: Final = 16
#: Distinct medium names remembered at all (an engine naming more gets the shared bit).
MAX_MEDIA_NAMES: Final = 64
GPU_MEDIUM: Final = "GPU"
#: `tokens` mode: a pod entry is (router key << MEDIA_SHIFT) | medium bits.
MEDIA_SHIFT: Final = MAX_MEDIA_BITS
_MEDIA_MASK: Final = (1 << MEDIA_SHIFT) - 1
_BYTES_PER_GLOBAL_KEY: Final = 40
#: A table past its bound sheds this share of the bound at once (`trim_oldest`).
TRIM_DIVISOR: Final = 16


def trim_oldest(table: dict[int, Any], limit: int) -> list[tuple[int, Any]]:
    """Drop the oldest entries (insertion order) of a plain dict holding more than
    `limit`, down to `limit - limit // TRIM_DIVISOR`; returns them. In bulk because a
    dict's deleted entries stay as holes at its front until it resizes, and finding the
    oldest entry walks over them: trimming one entry per insert at the bound would walk
    them all every time."""
    excess = len(table) - limit
    if excess <= 0:
        return []
    dropped = list(islice(table.items(), excess + limit // TRIM_DIVISOR))
    for block, _ in dropped:
        del table[block]
    return dropped


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
        self.store_media = frozenset(store_media)
        self._slots = PodSlots()
        self._masks: dict[int, int] = {}
        self._pods: dict[str, dict[int, int]] = {}
        self._translated: set[str] = set()  # pods whose entries pack router keys
        #: Scope -> its pool's keys (an `OrderedDict` where `record_pool` keeps an LRU).
        self._stores: dict[str, dict[int, None]] = {}
        self._aliases: dict[str, dict[int, int]] = {}  # tokens-mode pools
        self._store_fed: set[str] = set()  # scopes whose pods publish store-medium events
        #: Pod key -> (scope, pool) for pods whose stored blocks also go to the pool.
        self._writers: dict[str, tuple[str, PoolSettings]] = {}
        self._spaces: dict[str, KeySpace] = {}
        self._media: dict[str | None, int] = {None: 1, GPU_MEDIUM: 1}
        self.overflow_evictions = 0
        self.unkeyed_blocks = 0

    def _medium_bit(self, medium: str | None) -> int:
        bit = self._media.get(medium)
        if bit is None:
            bit = 1 << min(len(set(self._media.values())), MAX_MEDIA_BITS - 1)
            if len(self._media) < MAX_MEDIA_NAMES:
                self._media[medium] = bit
        return bit

    def is_store_medium(self, medium: str | None) -> bool:
        return medium in self.store_media

    # -- key spaces -----------------------------------------------------------------------

    def set_spaces(self, spaces: Mapping[str, KeySpace]) -> None:
        """Each scope's key space; a scope whose space changed loses its store pool (its
        pods are cleared by their event streams, which restart on such a change)."""
        for scope in list(self._stores):
            old = self._spaces.get(scope)
            new = spaces.get(scope)
            if (old.ident if old else None) != (new.ident if new else None):
                self._stores.pop(scope, None)
                self._aliases.pop(scope, None)
                self._store_fed.discard(scope)
        self._spaces = dict(spaces)

    def space(self, scope: str) -> KeySpace | None:
        return self._spaces.get(scope)

    def set_pool_writers(self, writers: Mapping[str, tuple[str, PoolSettings]]) -> None:
        """The pods whose locally stored blocks their connector also writes to their
        scope's pool (`pool_view.pool_writers`, one entry per pod of the view)."""
        self._writers = dict(writers)

    def _router_key(self, key: str, scope: str, engine_hash: int) -> int | None:
        blocks = self._pods.get(key)
        entry = None if blocks is None else blocks.get(engine_hash)
        if entry is not None and key in self._translated:
            return entry >> MEDIA_SHIFT
        aliases = self._aliases.get(scope)
        return None if aliases is None else aliases.get(engine_hash)

    def _keys(
        self,
        key: str,
        scope: str,
        hashes: Sequence[int],
        parent: int | None,
        token_ids: Sequence[int] | None,
        block_size: int | None,
        extra_keys: Sequence[Any] | None,
        lora_name: str | None,
    ) -> tuple[Sequence[int] | None, bool]:
        """(index keys of a stored run, whether they are router keys): keys None if none
        could be made, fewer than `hashes` when only its leading blocks could."""
        space = self._spaces.get(scope)
        if space is not None and block_size is not None and block_size != space.block_size:
            return None, False
        if space is None or space.mode == "hashes":
            return hashes, False
        # The leading blocks the pod keyed already keep their keys (a store write follows
        # the GPU store of the same blocks, and vLLM's store events carry neither the
        # salt nor the adapter: the same engine hash on the same pod is the same key); the
        # rest are chained from the last of them, as one event a block would be.
        known: list[int] = []
        blocks = self._pods.get(key)
        if blocks is not None and key in self._translated:
            for engine_hash in hashes:
                entry = blocks.get(engine_hash)
                if entry is None:
                    break
                known.append(entry >> MEDIA_SHIFT)
        done = len(known)
        if done == len(hashes):
            return known, True
        parent_key = (
            known[-1] if known
            else TOKENS_ROOT if parent is None
            else self._router_key(key, scope, parent)
        )
        rest = None
        if token_ids and parent_key is not None:  # vLLM's store writes may carry none (`[]`)
            size = space.block_size
            rest = space.event_keys(
                parent_key, token_ids[done * size:], len(hashes) - done,
                None if extra_keys is None else extra_keys[done:], lora_name,
            )
        if rest is None:
            return (known or None), True  # the leading blocks known, if any
        return known + rest, True

    # -- events ---------------------------------------------------------------------------

    def stored(
        self,
        key: str,
        scope: str,
        hashes: Sequence[int],
        medium: str | None,
        *,
        parent: int | None = None,
        token_ids: Sequence[int] | None = None,
        block_size: int | None = None,
        extra_keys: Sequence[Any] | None = None,
        lora_name: str | None = None,
    ) -> None:
        """A `BlockStored` from pod `key` of scope `scope` (see the module docstring)."""
        keys, translated = self._keys(
            key, scope, hashes, parent, token_ids, block_size, extra_keys, lora_name
        )
        if keys is None:
            self.unkeyed_blocks += len(hashes)
            return
        if len(keys) < len(hashes):  # only a leading part could be keyed
            self.unkeyed_blocks += len(hashes) - len(keys)
            hashes = hashes[: len(keys)]
        if self.is_store_medium(medium):
            self._store_fed.add(scope)
            self._store_pool(scope, hashes, keys, translated)
            return
        if (key in self._translated) != translated:
            self.cleared(key)  # the scope changed key space: start over
        blocks = self._pods.get(key)
        if blocks is None:
            blocks = self._pods[key] = {}
            if translated:
                self._translated.add(key)
            else:
                self._translated.discard(key)
        bit = self._medium_bit(medium)
        pod_bit = 1 << self._slots.acquire(key)
        masks = self._masks
        for engine_hash, block_key in zip(hashes, keys, strict=True):
            held = blocks.get(engine_hash)
            if held is None:
                blocks[engine_hash] = (block_key << MEDIA_SHIFT) | bit if translated else bit
                masks[block_key] = masks.get(block_key, 0) | pod_bit
            else:
                blocks[engine_hash] = held | bit
        if len(blocks) > self.max_blocks_per_pod:
            clear = ~pod_bit
            for engine_hash, held in trim_oldest(blocks, self.max_blocks_per_pod):
                self._unmask(held >> MEDIA_SHIFT if translated else engine_hash, clear)
                self.overflow_evictions += 1
        writer = self._writers.get(key)
        if writer is not None and writer[0] == scope and scope not in self._store_fed:
            size = block_size or self._block_size(scope)
            self.record_pool(scope, keys, writer[1].capacity_blocks(size))

    def _block_size(self, scope: str) -> int:
        space = self._spaces.get(scope)
        return space.block_size if space is not None else DEFAULT_BLOCK_SIZE

    def _store_pool(
        self, scope: str, hashes: Sequence[int], keys: Sequence[int], translated: bool
    ) -> None:
        pool = self._stores.get(scope)
        if pool is None:
            pool = self._stores[scope] = {}
        pool.update(dict.fromkeys(keys))  # C loops: a store write is a whole prefill's run
        if translated:
            aliases = self._aliases.get(scope)
            if aliases is None:
                aliases = self._aliases[scope] = {}
            aliases.update(zip(hashes, keys, strict=True))
            trim_oldest(aliases, self.max_store_blocks)
        self.overflow_evictions += len(trim_oldest(pool, self.max_store_blocks))

    def record_pool(self, scope: str, keys: Sequence[int], capacity_blocks: int) -> None:
        """Blocks (index keys) a pool writer stored are in `scope`'s store pool, for
        engines that publish no store events. LRU: a block seen again moves to the young
        end; the bound is the smaller of the pool's capacity and `max_store_blocks`."""
        if not keys:
            return
        pool = self._stores.get(scope)
        if not isinstance(pool, OrderedDict):
            pool = self._stores[scope] = OrderedDict(dict.fromkeys(pool or ()))
        self.overflow_evictions += touch_lru(
            pool, keys, min(capacity_blocks, self.max_store_blocks)
        )

    def removed(self, key: str, scope: str, hashes: Sequence[int], medium: str | None) -> None:
        if self.is_store_medium(medium):
            pool = self._stores.get(scope)
            if pool is not None:
                aliases = self._aliases.get(scope)
                for engine_hash in hashes:
                    block_key = engine_hash if aliases is None else aliases.pop(engine_hash, None)
                    if block_key is not None:
                        pool.pop(block_key, None)
            return
        blocks = self._pods.get(key)
        slot = self._slots.get(key)
        if blocks is None or slot is None:
            return
        translated = key in self._translated
        bit = self._medium_bit(medium)
        clear = ~(1 << slot)
        for engine_hash in hashes:
            held = blocks.get(engine_hash)
            if held is None:
                continue
            left = held & ~bit
            if left & _MEDIA_MASK:
                blocks[engine_hash] = left
            else:
                del blocks[engine_hash]
                self._unmask(held >> MEDIA_SHIFT if translated else engine_hash, clear)

    def cleared(self, key: str) -> None:
        """`AllBlocksCleared` from pod `key` (its own cache; store pools are untouched)."""
        blocks = self._pods.pop(key, None)
        translated = key in self._translated
        self._translated.discard(key)
        slot = self._slots.get(key)
        if blocks is not None and slot is not None:
            clear = ~(1 << slot)
            for engine_hash, held in blocks.items():
                self._unmask(held >> MEDIA_SHIFT if translated else engine_hash, clear)

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
            self._aliases.pop(scope, None)
        self._store_fed &= present

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

    def known(self, scope: str) -> Callable[[int], bool]:
        """Whether any pod, or `scope`'s store pool, holds a block (index key): where a
        lazily hashed prompt may stop (`PreciseHasher.leading_hashes`). Only dict
        membership tests: safe to call from a tokenizing thread."""
        masks = self._masks
        pool = self._stores.get(scope)
        if pool is None:
            return masks.__contains__
        return lambda block_key: block_key in masks or block_key in pool

    def store_fed(self, scope: str) -> bool:
        """Whether `scope`'s pods have published blocks with a store medium: then the
        store pool is known from them, not inferred from the pool writers' local blocks."""
        return scope in self._store_fed

    def holds(self, key: str, block_hash: int) -> bool:
        blocks = self._pods.get(key)
        return blocks is not None and block_hash in blocks

    def block_count(self, key: str) -> int:
        """How many blocks pod `key` holds itself (every local medium)."""
        blocks = self._pods.get(key)
        return 0 if blocks is None else len(blocks)

    def blocks_of(self, key: str) -> set[int]:
        """The engine hashes pod `key` holds."""
        return set(self._pods.get(key, ()))

    def keys_of(self, key: str) -> set[int]:
        """The index keys of the blocks pod `key` holds (router keys in `tokens` mode)."""
        blocks = self._pods.get(key)
        if blocks is None:
            return set()
        if key in self._translated:
            return {held >> MEDIA_SHIFT for held in blocks.values()}
        return set(blocks)

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
        for aliases in self._aliases.values():
            size += sys.getsizeof(aliases)
        return size
