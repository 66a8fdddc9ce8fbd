"""Admission like vLLM's scheduler: at most `max_num_seqs` run, the rest wait in FIFO order.

The waiting queue is bounded (`max_waiting`) so that an overload test fails fast with a
503 instead of growing memory; vLLM itself does not bound it, so keep the bound generous.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

#: Default bound of the waiting queue (requests).
DEFAULT_MAX_WAITING = 4096


class QueueFullError(Exception):
    """The waiting queue is at its bound."""


class Scheduler:
    """Counts running and waiting requests and hands slots over in arrival order."""

    def __init__(self, max_num_seqs: int, max_waiting: int = DEFAULT_MAX_WAITING) -> None:
        if max_num_seqs <= 0 or max_waiting < 0:
            raise ValueError("max_num_seqs must be positive and max_waiting non-negative")
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self._running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        """Take a slot, waiting behind earlier arrivals; raises QueueFullError at the bound."""
        if self._running < self.max_num_seqs and not self._waiters:
            self._running += 1
            return
        if len(self._waiters) >= self.max_waiting:
            raise QueueFullError(f"{len(self._waiters)} requests already waiting")
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot was handed to us as we were cancelled: pass it on
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        """Give the slot to the oldest waiter, or free it."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._running -= 1

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a slot for the body of the `async with`."""
        await self.acquire()
        try:
            yield
        finally:
            self.release()
