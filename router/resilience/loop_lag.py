"""An adaptive concurrency limit driven by the event loop's own lag.

pdgate's data path is one event loop: past its CPU capacity every request in flight slows
down together, clients time out, and the work done for them is lost (congestion collapse).
The engines' latency is no usable signal for that (an answer's length dominates it), but
the loop's lag is: a timer that should fire every `SAMPLE_S` fires late by however long the
loop was busy with other callbacks. Like the gradient algorithm of Netflix's
concurrency-limits (and Envoy's adaptive concurrency filter), the limit shrinks in
proportion when the lag passes its target (`limit = in_flight x target / lag`, at most
halving a step) and grows by about its square root per quiet sample otherwise, between
`min_limit` and the ceiling the pods allow. A lag target of 0 turns it off.

With nothing in flight and no cut in force the sampler parks: an idle router has no lag
to measure, and a timer every `SAMPLE_S` was about a fifth of its idle CPU (20 wake-ups a
second, each on a cold core). The admission that takes the first request starts it again
(`wake`), so under traffic it samples as before.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Final

#: How often the lag is sampled, seconds.
SAMPLE_S: Final = 0.05
#: The weight of a new sample in the smoothed lag (one spike from a noisy neighbour moves
#: the limit less than a sustained backlog does).
SMOOTHING: Final = 0.5
#: The largest cut one sample makes (a factor of the requests in flight).
MAX_CUT: Final = 0.5


class LoopLagLimit:
    """The adaptive limit; `limit` is read on every admission, `run()` keeps it current."""

    def __init__(self, target_s: float, min_limit: int, ceiling: int,
                 in_flight: Callable[[], int], on_change: Callable[[], None]) -> None:
        self.target_s = target_s
        self.min_limit = min_limit
        self.ceiling = ceiling
        self.limit = ceiling
        self.lag_s = 0.0
        self._in_flight = in_flight
        self._on_change = on_change
        #: Set while the sampler is parked (see the module docstring).
        self._parked: asyncio.Future[None] | None = None

    def set_ceiling(self, ceiling: int) -> None:
        """A new ceiling (the pods changed): a limit not cut by lag follows it."""
        if self.limit >= self.ceiling:
            self.limit = ceiling
        self.ceiling = ceiling
        self.limit = max(min(self.limit, ceiling), min(self.min_limit, ceiling))

    def observe(self, lag_s: float) -> None:
        """Fold one lag sample in and move the limit (see the module docstring)."""
        self.lag_s += SMOOTHING * (lag_s - self.lag_s)
        before = self.limit
        if self.lag_s > self.target_s:
            cut = max(MAX_CUT, self.target_s / self.lag_s)
            self.limit = max(self.min_limit, min(self.limit, int(self._in_flight() * cut)))
        elif self.limit < self.ceiling:
            self.limit = min(self.ceiling, self.limit + max(1, math.isqrt(self.limit)))
        if self.limit != before:
            self._on_change()

    @property
    def sampling(self) -> bool:
        """False while the sampler is parked."""
        return self._parked is None

    def wake(self) -> None:
        """A request was admitted with none before it: a parked sampler starts again."""
        parked = self._parked
        if parked is not None and not parked.done():
            parked.set_result(None)

    async def run(self) -> None:
        if self.target_s <= 0:
            return
        clock = time.perf_counter
        loop = asyncio.get_running_loop()
        while True:
            if self._in_flight() == 0 and self.limit >= self.ceiling:
                self.lag_s = 0.0  # what an idle loop's samples would have read
                self._parked = loop.create_future()
                try:
                    await self._parked
                finally:
                    self._parked = None
            due = clock() + SAMPLE_S
            await asyncio.sleep(SAMPLE_S)
            self.observe(max(0.0, clock() - due))
