"""The shared core of both prefix indexes: block hash -> bitmask of the pods holding it.

Every pod an index knows gets a small integer slot (reused after the pod is dropped, so
slots stay below the number of live pods). A block's holders are one Python int used as
a bitmask, so "which of these candidates hold block i" is one `&`: for 512 pods that is
eight machine words, a constant cost. `leading_depths` answers "how many leading blocks of
this prompt does each candidate hold" by walking the prompt's blocks once, narrowing the
mask of candidates still matching, and stopping when none is left:

    cost = O(prompt blocks walked) dict lookups + O(candidates with a hit) bit extractions

independent of how many pods the cluster has.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

#: Bound of `PodSlots.mask_of`'s memo (candidate lists: a few per server and role).
MAX_MASK_MEMO: Final = 64


class PodSlots:
    """Pod key <-> small integer slot; freed slots are reused first."""

    __slots__ = ("_free", "_keys", "_masks", "_next", "_slots")

    def __init__(self) -> None:
        self._slots: dict[str, int] = {}
        self._keys: dict[int, str] = {}
        self._free: list[int] = []
        self._next = 0
        #: mask_of's memo: id(keys) -> (a copy of keys, mask, slots); emptied on any change.
        self._masks: dict[int, tuple[list[str], int, list[int]]] = {}

    def get(self, key: str) -> int | None:
        return self._slots.get(key)

    def acquire(self, key: str) -> int:
        slot = self._slots.get(key)
        if slot is None:
            if self._free:
                slot = self._free.pop()
            else:
                slot = self._next
                self._next += 1
            self._slots[key] = slot
            self._keys[slot] = key
            self._masks.clear()
        return slot

    def release(self, key: str) -> None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            del self._keys[slot]
            self._free.append(slot)
            self._masks.clear()

    def key_of(self, slot: int) -> str | None:
        return self._keys.get(slot)

    def keys(self) -> list[str]:
        return list(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    def mask_of(self, keys: Sequence[str]) -> tuple[int, list[int]]:
        """(bitmask of the known keys, slot per key in order, -1 where unknown).

        Memoized per candidate list until a slot changes: the scheduler asks for the same
        pods (a server's, per role) at every decision. A hit is checked against a copy
        of the keys (a C-speed compare), so a list changed in place is never misread.
        The returned slot list is shared: read it, never change it."""
        memo = self._masks.get(id(keys))
        if memo is not None and memo[0] == keys:
            return memo[1], memo[2]
        get = self._slots.get
        mask = 0
        slots: list[int] = []
        for key in keys:
            slot = get(key, -1)
            slots.append(slot)
            if slot >= 0:
                mask |= 1 << slot
        if len(self._masks) >= MAX_MASK_MEMO:
            self._masks.clear()
        self._masks[id(keys)] = (list(keys), mask, slots)
        return mask, slots


def _record(depths: dict[int, int], bits: int, depth: int) -> None:
    while bits:
        low = bits & -bits
        depths[low.bit_length() - 1] = depth
        bits ^= low


def leading_depths(
    masks: dict[int, int], hashes: Sequence[int], alive: int
) -> dict[int, int]:
    """Slot -> number of leading `hashes` held, for the slots in `alive` holding >= 1."""
    depths: dict[int, int] = {}
    if not alive:
        return depths
    get = masks.get
    depth = 0
    for block_hash in hashes:
        held = alive & get(block_hash, 0)
        if held != alive:
            if depth:
                _record(depths, alive ^ held, depth)
            alive = held
            if not alive:
                return depths
        depth += 1
    _record(depths, alive, depth)
    return depths


def leading_depths_with_shared(
    masks: dict[int, int], shared: dict[int, None] | None, hashes: Sequence[int], alive: int
) -> tuple[dict[int, int], dict[int, int]]:
    """Like `leading_depths`, also counting blocks in a `shared` pool (held by every pod).

    Returns (local, reachable): `local[s]` leading blocks slot s holds itself;
    `reachable[s]` leading blocks it holds itself or finds in `shared`.
    """
    if not shared:
        only = leading_depths(masks, hashes, alive)
        return only, only
    local: dict[int, int] = {}
    reach: dict[int, int] = {}
    get = masks.get
    alive_local = alive
    alive_reach = alive
    depth = 0
    for block_hash in hashes:
        held = get(block_hash, 0)
        if alive_local:
            now_local = alive_local & held
            if now_local != alive_local:
                if depth:
                    _record(local, alive_local ^ now_local, depth)
                alive_local = now_local
        if block_hash not in shared:
            now_reach = alive_reach & held
            if now_reach != alive_reach:
                if depth:
                    _record(reach, alive_reach ^ now_reach, depth)
                alive_reach = now_reach
                if not alive_reach:
                    break
        depth += 1
    else:
        _record(reach, alive_reach, depth)
    if alive_local:
        _record(local, alive_local, depth)
    return local, reach
