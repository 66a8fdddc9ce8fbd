"""Graceful drain: what SIGTERM turns on, and the count of data requests it waits for.

Once `begin()` runs, `/readyz` answers 503 (so load balancers stop sending), new data
requests are refused with a 503 that closes the connection, and `wait_idle()` returns when
the requests already in flight have finished or the grace period is over. Counting costs
two integer updates per request; the idle event is only touched while draining.
"""

from __future__ import annotations

import asyncio
import time

from router.errors import APIError


def shutting_down() -> APIError:
    return APIError(
        503, "The server is shutting down; retry on another replica.",
        type="service_unavailable", code="shutting_down",
        # The openai SDK honours x-should-retry: another replica will take the request.
        headers={"retry-after": "1", "connection": "close", "x-should-retry": "true"},
    )


class Drain:
    """Requests in flight and the draining flag (see the module docstring)."""

    def __init__(self) -> None:
        self.draining = False
        self.active = 0
        self.began_at: float | None = None
        self._idle: asyncio.Event | None = None

    def begin(self) -> None:
        if self.draining:
            return
        self.draining = True
        self.began_at = time.monotonic()
        self._idle = asyncio.Event()
        if self.active == 0:
            self._idle.set()

    def enter(self) -> None:
        self.active += 1

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0 and self._idle is not None:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True when every request finished within `timeout_s`, False when time ran out."""
        if self._idle is None:
            self.begin()
        assert self._idle is not None
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True
