"""Blocks whose KV a running request is still writing: a hit on them waits for it.

vLLM v1 puts a block's hash in the prefix cache when the block is *scheduled*, not when
its KV is computed (`KVCacheManager.allocate_slots` caches up to the tokens scheduled in
the step), so a request that arrives while another one prefills the same prefix finds
those blocks as a hit: it is counted as one, and it computes only the rest. But their KV
exists only once the step computing it has run; the second request is scheduled in the
step after (or joins the same one), and its first token cannot come before the first
request's prefill is done. A KV transfer into a decode pod is the same: vLLM delays
caching received blocks until they have arrived (`delay_cache_blocks`).

The simulator's prefix cache (`prefix_cache.py`) holds identities only, so it answers a
hit at once. This registry is the timing half: a request that writes blocks (computing,
loading from the store, importing) claims them until its modelled prefill has elapsed;
a request whose hit or lease includes blocks claimed by another waits for that claim to
end, then spends its own modelled time. Without it, the second of two identical prompts
sent together got its first token about 200 ms before the first one's prefill ended.

Bound: only blocks held by a running request are claimed, so the registry holds at most
the cache's capacity in blocks (each entry is dropped when its claim ends).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Claim:
    """The blocks one request writes, and the event set when their KV exists."""

    block_hashes: tuple[int, ...]
    done: asyncio.Event = field(default_factory=asyncio.Event)
    #: The claims of other requests this one's blocks wait for.
    waits_for: tuple[asyncio.Event, ...] = ()


class PendingBlocks:
    """Block hash -> the event of the request still writing it."""

    def __init__(self) -> None:
        self._writing: dict[int, asyncio.Event] = {}

    def __len__(self) -> int:
        return len(self._writing)

    def claim(self, block_hashes: Sequence[int], writes_from: int) -> Claim:
        """A request holds `block_hashes` (its lease) and writes those from `writes_from`
        on (the ones it did not find cached). Returns its claim, with the events of the
        blocks other requests are still writing (hit or not) to wait for."""
        waits: dict[int, asyncio.Event] = {}
        mine: list[int] = []
        for index, block_hash in enumerate(block_hashes):
            event = self._writing.get(block_hash)
            if event is not None:
                waits[id(event)] = event
            elif index >= writes_from:
                mine.append(block_hash)
        claim = Claim(tuple(mine), waits_for=tuple(waits.values()))
        for block_hash in mine:
            self._writing[block_hash] = claim.done
        return claim

    @staticmethod
    async def wait(claim: Claim) -> None:
        """Until every block this request found being written by another exists."""
        for event in claim.waits_for:
            await event.wait()

    def release(self, claim: Claim) -> None:
        """The request's blocks exist. Also called when it fails or is cancelled: the
        waiters go on (in vLLM an abort lands between steps, after the step that computes
        what was scheduled in it)."""
        for block_hash in claim.block_hashes:
            if self._writing.get(block_hash) is claim.done:
                del self._writing[block_hash]
        claim.done.set()
