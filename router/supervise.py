"""Background tasks kept running: one that fails is logged and started again.

A background task that ended for good would leave what it keeps current frozen (the
scheduler's engine scrapes and KV events; the state sync's peers, counted live with
their requests still on the pods) with nothing in the logs to say so.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Final

log = logging.getLogger("pdgate.supervise")

#: Wait before a failed task runs again, doubled after each failure up to the cap given.
RESTART_DELAY_S: Final = 1.0
RESTART_DELAY_MAX_S: Final = 30.0


async def kept_running(
    name: str,
    run: Callable[[], Awaitable[None]],
    delay_s: float = RESTART_DELAY_S,
    max_delay_s: float = RESTART_DELAY_MAX_S,
) -> None:
    """`run()` until it returns or is cancelled, started again after each failure."""
    delay = delay_s
    while True:
        try:
            await run()
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s failed; starting it again in %.0f s", name, delay)
        await asyncio.sleep(delay)
        delay = min(max_delay_s, delay * 2)
