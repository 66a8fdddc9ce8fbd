"""The approximate prefix index: what the router sent where, as an LRU per pod.

When the scheduler dispatches a request it records the prompt's approximate block hashes
(`block_hash.approximate_block_hashes`) for the chosen pod, on the assumption that the
engine caches the prompt. Each pod's record is an LRU bounded in blocks: the bound is
derived from the pod's KV capacity when its engine reports one (`set_capacity_tokens`,
fed by the metrics scraper from `vllm:cache_config_info` or `sglang:max_total_num_tokens`),
else `default_capacity_tokens`, converted to approximate blocks with `chars_per_token`;
and clamped to `[MIN_BLOCKS_PER_POD, max_blocks_per_pod]`. Sizing matters: too small and
the index forgets blocks the engine still has (silently no hits); too large and it
promises blocks the engine evicted.

Lookup is `block_index.leading_depths`: O(prompt blocks), independent of the pod count.
Dropping a pod (it left the view) removes all its entries.

With several router processes (`router.sync`), `listener` hears every local `record` and
the other processes apply it with `apply_remote`, so all of them hold the same picture.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Final

from router.scheduling.block_hash import DEFAULT_APPROX_BLOCK_BYTES
from router.scheduling.block_index import PodSlots, leading_depths

#: Assumed KV capacity of a pod whose engine reports none, in tokens.
DEFAULT_CAPACITY_TOKENS: Final = 512 * 1024
#: Hard ceiling of one pod's LRU, in blocks, whatever the engine reports.
MAX_BLOCKS_PER_POD: Final = 1 << 20
#: Floor of one pod's LRU, in blocks (a tiny reported capacity must not disable the index).
MIN_BLOCKS_PER_POD: Final = 64
#: Rendered prompt bytes per token, to turn a capacity in tokens into approximate blocks.
DEFAULT_CHARS_PER_TOKEN: Final = 4.0
#: Rough bytes per entry of the global block map, for the memory gauge.
_BYTES_PER_GLOBAL_KEY: Final = 40


class ApproximatePrefixIndex:
    """Per-pod LRUs of approximate block hashes, plus the global hash -> pods bitmask map."""

    def __init__(
        self,
        block_bytes: int = DEFAULT_APPROX_BLOCK_BYTES,
        chars_per_token: float = DEFAULT_CHARS_PER_TOKEN,
        default_capacity_tokens: int = DEFAULT_CAPACITY_TOKENS,
        max_blocks_per_pod: int = MAX_BLOCKS_PER_POD,
    ) -> None:
        self.block_bytes = block_bytes
        self.chars_per_token = chars_per_token
        self.default_capacity_tokens = default_capacity_tokens
        self.max_blocks_per_pod = max_blocks_per_pod
        self._slots = PodSlots()
        self._masks: dict[int, int] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._reported_tokens: dict[str, int] = {}
        self._caps: dict[str, int] = {}
        self.evictions = 0
        #: Called with (pod key, hashes) on every local `record` (`router.sync`).
        self.listener: Callable[[str, Sequence[int]], None] | None = None

    # -- sizing ---------------------------------------------------------------------------

    def _blocks_for(self, tokens: int) -> int:
        blocks = int(tokens * self.chars_per_token) // max(1, self.block_bytes)
        return max(MIN_BLOCKS_PER_POD, min(self.max_blocks_per_pod, blocks))

    def capacity_of(self, key: str) -> int:
        """The LRU bound of one pod, in blocks."""
        cap = self._caps.get(key)
        if cap is None:
            tokens = self._reported_tokens.get(key, self.default_capacity_tokens)
            cap = self._caps[key] = self._blocks_for(tokens)
        return cap

    def set_capacity_tokens(self, key: str, tokens: int | None) -> None:
        """The engine's KV capacity in tokens (None: unknown, use the default)."""
        if tokens is None or tokens <= 0:
            if self._reported_tokens.pop(key, None) is None:
                return
        elif self._reported_tokens.get(key) == tokens:
            return
        else:
            self._reported_tokens[key] = tokens
        self._caps.pop(key, None)
        lru = self._lru.get(key)
        if lru is not None:
            self._trim(key, lru)

    def reported_tokens(self, key: str) -> int | None:
        """The KV capacity pod `key`'s engine reports, in tokens (None: unknown)."""
        return self._reported_tokens.get(key)

    def reconfigure(
        self,
        block_bytes: int,
        chars_per_token: float,
        default_capacity_tokens: int,
        max_blocks_per_pod: int,
    ) -> None:
        """Apply new settings; a new block size changes every hash, so it empties the index."""
        if block_bytes != self.block_bytes:
            self.clear()
        self.block_bytes = block_bytes
        self.chars_per_token = chars_per_token
        self.default_capacity_tokens = default_capacity_tokens
        self.max_blocks_per_pod = max_blocks_per_pod
        self._caps.clear()
        for key, lru in self._lru.items():
            self._trim(key, lru)

    # -- updates --------------------------------------------------------------------------

    def record(self, key: str, hashes: Sequence[int], share: bool = True) -> None:
        """The prompt with these blocks was sent to pod `key`: it now (likely) caches them.
        `share`: tell `listener` (the other router processes); not for the pick made for
        another process, which records it itself when it sends the request."""
        if not hashes:
            return
        self.apply_remote(key, hashes)
        if share and self.listener is not None:
            self.listener(key, hashes)

    def apply_remote(self, key: str, hashes: Sequence[int]) -> None:
        """Another router process sent this prompt to pod `key` (`record` without echo)."""
        if not hashes:
            return
        lru = self._lru.get(key)
        if lru is None:
            lru = self._lru[key] = OrderedDict()
        bit = 1 << self._slots.acquire(key)
        masks = self._masks
        touch = lru.move_to_end
        # Tail first, so the head of the prompt is the most recent: like an engine, the
        # LRU then forgets a prompt's tail before its head, and the leading blocks it
        # keeps still match. A prompt's tail is mostly new to the pod and its head held
        # (a pod keeps a prefix), so each block is looked up until the first held one,
        # and from there on moved to the end at once (one lookup), a KeyError meaning new
        # after all: compiled, a raised KeyError costs a traceback, about 0.5 µs a block,
        # which was a third of a new 8 KB prompt's PD pick.
        blocks = reversed(hashes)
        for block_hash in blocks:
            if block_hash in lru:
                touch(block_hash)
                break
            lru[block_hash] = None
            masks[block_hash] = masks.get(block_hash, 0) | bit
        for block_hash in blocks:  # the rest of the prompt, towards its head
            try:
                touch(block_hash)
            except KeyError:
                lru[block_hash] = None
                masks[block_hash] = masks.get(block_hash, 0) | bit
        if len(lru) > self.capacity_of(key):
            self._trim(key, lru)

    def _trim(self, key: str, lru: OrderedDict[int, None]) -> None:
        cap = self.capacity_of(key)
        slot = self._slots.get(key)
        if slot is None:
            return
        clear = ~(1 << slot)
        masks = self._masks
        while len(lru) > cap:
            block_hash, _ = lru.popitem(last=False)
            left = masks.get(block_hash, 0) & clear
            if left:
                masks[block_hash] = left
            else:
                masks.pop(block_hash, None)
            self.evictions += 1

    def remove_pod(self, key: str) -> None:
        """Forget everything recorded for pod `key`."""
        lru = self._lru.pop(key, None)
        slot = self._slots.get(key)
        if lru is not None and slot is not None:
            clear = ~(1 << slot)
            masks = self._masks
            for block_hash in lru:
                left = masks.get(block_hash, 0) & clear
                if left:
                    masks[block_hash] = left
                else:
                    masks.pop(block_hash, None)
        self._slots.release(key)
        self._caps.pop(key, None)
        self._reported_tokens.pop(key, None)

    def retain(self, keys: Iterable[str]) -> None:
        """Drop every pod not in `keys` (called with the pods of each new view snapshot)."""
        present = set(keys)
        for key in [k for k in self._lru if k not in present]:
            self.remove_pod(key)
        for key in [k for k in self._reported_tokens if k not in present]:
            self._reported_tokens.pop(key, None)
            self._caps.pop(key, None)

    def clear(self) -> None:
        for key in list(self._lru):
            self.remove_pod(key)
        self._masks.clear()

    # -- lookups --------------------------------------------------------------------------

    def match(self, keys: Sequence[str], hashes: Sequence[int]) -> list[int]:
        """Leading blocks of `hashes` each pod in `keys` holds, in the order of `keys`."""
        mask, slots = self._slots.mask_of(keys)
        if not mask or not hashes:
            return [0] * len(keys)
        depths = leading_depths(self._masks, hashes, mask)
        get = depths.get
        return [get(slot, 0) for slot in slots]

    def occupancy(self, keys: Sequence[str]) -> tuple[list[int], list[int]]:
        """(blocks held, bound) of each pod in `keys`, in the order of `keys`."""
        lrus, caps = self._lru, self._caps
        used: list[int] = []
        bounds: list[int] = []
        for key in keys:
            lru = lrus.get(key)
            cap = caps.get(key)
            used.append(0 if lru is None else len(lru))
            bounds.append(cap if cap is not None else self.capacity_of(key))
        return used, bounds

    def blocks_of(self, key: str) -> int:
        lru = self._lru.get(key)
        return 0 if lru is None else len(lru)

    @property
    def total_blocks(self) -> int:
        return sum(len(lru) for lru in self._lru.values())

    @property
    def pods(self) -> list[str]:
        return list(self._lru)

    def memory_bytes(self) -> int:
        """An estimate of the index's memory: its tables plus one int key per global entry."""
        size = sys.getsizeof(self._masks) + _BYTES_PER_GLOBAL_KEY * len(self._masks)
        for lru in self._lru.values():
            size += sys.getsizeof(lru)
        return size
