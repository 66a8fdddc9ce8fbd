"""A vLLM-style prefix cache of KV blocks, bounded in blocks, with LRU eviction.

The simulator holds no tensors, only block identities: which chained block hashes
(`block_hash.py`) are resident, which requests use them, and which block ids they occupy.
That is enough to report prefix-cache hits and `kv_cache_usage_perc` as vLLM does, and to
emit KV events (`cache_events.py`) through the `on_event` hook.

Rules, as in vLLM's block pool:
- a block is in use while a running request holds it (ref count > 0); when the last holder
  releases it, it stays cached but becomes evictable, least recently freed first (a
  request's blocks are freed tail first, so a prompt's tail goes before its head);
- running requests also hold private blocks (partial tail, output): they take capacity
  too but are never shared; the simulator never preempts, so it over-commits instead;
- usage = blocks in use / capacity (cached but evictable blocks count as free).

When events go out: vLLM caches a prompt's new blocks when the scheduler allocates them
for a step, and publishes the step's `BlockStored` after that step ran
(`Scheduler.update_from_output` takes the KV cache manager's events and publishes them):
a router hears of a block once the step that computes it is done. The engine acquires
with `defer_stored` and publishes the lease's blocks a range at a time (`publish`): those
a KV connector loaded when the load lands, then each chunk's as the chunk's step ends (a
prompt past `max_num_batched_tokens` is prefilled over several steps; `compute.py`).
Evictions are published at once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engine_sim.cache_events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEventSink

#: Default capacity of the simulated KV cache, in blocks.
DEFAULT_CAPACITY_BLOCKS = 4096


@dataclass(slots=True)
class _Block:
    block_id: int
    ref_count: int


@dataclass(frozen=True, slots=True)
class CacheLease:
    """The leading blocks of one prompt that a request holds, and their block ids;
    `stored`: the events of the blocks it cached, when they wait for `publish`."""

    block_hashes: tuple[int, ...]
    block_ids: tuple[int, ...]
    stored: tuple[BlockStored, ...] = ()


class PublishCursor:
    """A `defer_stored` lease's blocks published in order, a range at a time: `through(n)`
    sends the events of its first `n` blocks not sent yet."""

    __slots__ = ("_cache", "_lease", "_sent")

    def __init__(self, cache: PrefixCache, lease: CacheLease) -> None:
        self._cache = cache
        self._lease = lease
        self._sent = 0

    def through(self, blocks: int) -> None:
        end = min(blocks, len(self._lease.block_hashes))
        if end > self._sent:
            self._cache.publish(self._lease, self._sent, end)
            self._sent = end


class PrefixCache:
    """Resident blocks keyed by block hash; see the module docstring for the rules."""

    def __init__(
        self,
        capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
        block_size: int = 16,
        on_event: CacheEventSink | None = None,
    ) -> None:
        if capacity_blocks <= 0 or block_size <= 0:
            raise ValueError("capacity_blocks and block_size must be positive")
        self.capacity = capacity_blocks
        self.block_size = block_size
        self._on_event = on_event
        self._blocks: dict[int, _Block] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # Block ids 1..capacity; vLLM keeps id 0 as its null block.
        self._free_ids: list[int] = list(range(capacity_blocks, 0, -1))
        self._private = 0

    @property
    def num_cached(self) -> int:
        """Blocks resident (in use or evictable)."""
        return len(self._blocks)

    @property
    def num_in_use(self) -> int:
        """Blocks held by running requests, private blocks included."""
        return len(self._blocks) - len(self._evictable) + self._private

    def usage(self) -> float:
        """Fraction of capacity in use, 0.0-1.0, as vLLM's `kv_cache_usage_perc`."""
        return min(1.0, self.num_in_use / self.capacity)

    def match(self, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt are resident (changes nothing)."""
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self._blocks:
                break
            count += 1
        return count

    def acquire(
        self,
        block_hashes: Sequence[int],
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        defer_stored: bool = False,
        lora: tuple[str, int] | None = None,
    ) -> CacheLease:
        """Hold a prompt's blocks, caching the missing ones (evicting LRU blocks for room).

        Stops at the first block that finds no room: a block without its parent is useless.
        `token_ids` (the prompt's tokens), `cache_salt` and `lora` (the adapter's name and
        number) are used only for `BlockStored` events, sent at once or (`defer_stored`)
        kept in the lease for `publish`.
        """
        lora_name, lora_id = lora if lora is not None else (None, None)
        held: list[int] = []
        ids: list[int] = []
        stored: list[BlockStored] = []
        stored_from: int | None = None
        publishing = self._on_event is not None
        for index, block_hash in enumerate(block_hashes):
            block = self._blocks.get(block_hash)
            if block is None:
                block_id = self._take_free_id()
                if block_id is None:
                    break
                block = _Block(block_id, 0)
                self._blocks[block_hash] = block
                if stored_from is None:
                    stored_from = index
            elif block.ref_count == 0:
                del self._evictable[block_hash]
            block.ref_count += 1
            held.append(block_hash)
            ids.append(block.block_id)
            if publishing and stored_from is not None and (
                index + 1 == len(block_hashes) or block_hashes[index + 1] in self._blocks
            ):
                stored.append(self._stored(block_hashes, token_ids, stored_from, index + 1,
                                           cache_salt, 0, lora_name, lora_id))
                stored_from = None
        if publishing and stored_from is not None:
            stored.append(self._stored(block_hashes, token_ids, stored_from, len(held),
                                       cache_salt, 0, lora_name, lora_id))
        lease = CacheLease(tuple(held), tuple(ids), tuple(stored))
        if defer_stored:
            return lease
        self.publish(lease)
        return CacheLease(lease.block_hashes, lease.block_ids)

    def publish(self, lease: CacheLease, start: int = 0, end: int | None = None) -> None:
        """Send the `BlockStored` events a `defer_stored` lease kept for its blocks
        `start`..`end` (all by default); publish each block once, in order.

        An event kept for a run of blocks that the range cuts is sent as the part inside
        it, its parent the block before, as vLLM's `BlockStored` for a chunk names the
        last block of the chunk before."""
        if self._on_event is None:
            return
        stop = len(lease.block_hashes) if end is None else end
        for event in lease.stored:
            first = event.first_block
            last = first + len(event.block_hashes)
            if last <= start or first >= stop:
                continue
            if start <= first and last <= stop:
                self._on_event(event)
            else:
                self._on_event(self._stored(lease.block_hashes, event.token_ids,
                                            max(first, start), min(last, stop),
                                            event.cache_salt, first, event.lora_name,
                                            event.lora_id))

    def release(self, lease: CacheLease) -> None:
        """Drop a request's hold; blocks nobody holds become evictable, tail first."""
        for block_hash in reversed(lease.block_hashes):
            block = self._blocks.get(block_hash)
            if block is None or block.ref_count == 0:
                continue
            block.ref_count -= 1
            if block.ref_count == 0:
                self._evictable[block_hash] = None

    def reserve_private(self, count: int) -> None:
        """Hold `count` unshared blocks for a running request (evicts to make room)."""
        self._private += count
        while len(self._blocks) + self._private > self.capacity and self._evict_one():
            pass

    def release_private(self, count: int) -> None:
        """Return private blocks taken by `reserve_private`."""
        self._private = max(0, self._private - count)

    def clear(self) -> None:
        """Forget every evictable block and report `AllBlocksCleared` (held blocks stay)."""
        for block_hash in list(self._evictable):
            self._free_ids.append(self._blocks.pop(block_hash).block_id)
        self._evictable.clear()
        if self._on_event is not None:
            self._on_event(AllBlocksCleared())

    def _take_free_id(self) -> int | None:
        if len(self._blocks) + self._private >= self.capacity and not self._evict_one():
            return None
        if not self._free_ids:
            return None
        return self._free_ids.pop()

    def _evict_one(self) -> bool:
        if not self._evictable:
            return False
        block_hash, _ = self._evictable.popitem(last=False)
        self._free_ids.append(self._blocks.pop(block_hash).block_id)
        if self._on_event is not None:
            self._on_event(BlockRemoved((block_hash,)))
        return True

    def _stored(
        self,
        block_hashes: Sequence[int],
        token_ids: Sequence[int],
        start: int,
        end: int,
        cache_salt: str | None,
        offset: int = 0,
        lora_name: str | None = None,
        lora_id: int | None = None,
    ) -> BlockStored:
        """Blocks `start`..`end` of a prompt; `token_ids` begin at block `offset`."""
        size = self.block_size
        return BlockStored(
            block_hashes=tuple(block_hashes[start:end]),
            parent_block_hash=block_hashes[start - 1] if start > 0 else None,
            token_ids=tuple(token_ids[(start - offset) * size : (end - offset) * size]),
            block_size=size,
            first_block=start,
            cache_salt=cache_salt,
            lora_name=lora_name,
            lora_id=lora_id,
        )
