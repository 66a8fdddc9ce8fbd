"""Graceful drain: what SIGTERM turns on, the data requests it waits for, and their cut-off.

Once `begin()` runs, `/readyz` answers 503 (so load balancers stop sending), new data
requests are refused with a 503 that closes the connection, and `wait_idle()` returns when
the requests already in flight have finished or the grace period is over. When the grace
runs out (or a second signal says not to wait), `cut()` cancels every request still in
flight; each one then ends its own response with a `shutting_down` error (see
`router.app`): an error event and `[DONE]` on a stream, a 503 before the first byte.
Without the cut, uvicorn would close the sockets mid-chunk instead.

Counting costs a set insert and removal per request; the idle event is only touched while
draining.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from router.errors import APIError

#: What a request cancelled by `cut()` carries as its cancel message (for debugging).
CUT_MESSAGE = "pdgate: drain cut-off"


def shutting_down() -> APIError:
    return APIError(
        503, "The server is shutting down; retry on another replica.",
        type="service_unavailable", code="shutting_down",
        # The openai SDK honours x-should-retry: another replica will take the request.
        headers={"retry-after": "1", "connection": "close", "x-should-retry": "true"},
    )


class Drain:
    """Requests in flight, the draining flag and the cut-off (see the module docstring)."""

    def __init__(self) -> None:
        self.draining = False
        self.began_at: float | None = None
        #: Set once draining with nothing in flight (never set before `begin()`).
        self.idle = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()  # bounded by the requests in flight

    @property
    def active(self) -> int:
        return len(self._tasks)

    def begin(self) -> None:
        if self.draining:
            return
        self.draining = True
        self.began_at = time.monotonic()
        if not self._tasks:
            self.idle.set()

    def enter(self, task: asyncio.Task[Any]) -> None:
        """Count `task` (one data request's task) in flight."""
        self._tasks.add(task)

    def leave(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if self.draining and not self._tasks:
            self.idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True when every request finished within `timeout_s`, False when time ran out."""
        self.begin()
        try:
            async with asyncio.timeout(max(timeout_s, 0.0)):
                await self.idle.wait()
        except TimeoutError:
            return False
        return True

    def cut(self) -> int:
        """Cancel every request still in flight so it ends its response; how many."""
        self.begin()
        for task in self._tasks:
            task.cancel(CUT_MESSAGE)
        return len(self._tasks)
