"""`eventually`: wait for a condition that something else in the event loop makes true
(a KV-event stream caught up, a sync frame applied) and that offers no event to await."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def eventually(
    check: Callable[[], bool], within: float = 5.0, interval: float = 0.01
) -> None:
    """Poll `check` every `interval` seconds; fail the test if it is still false after
    `within` seconds."""
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(interval)
