"""Busy polling: an event loop that does not sleep while it serves (off by default).

Why. At low load every step of a request (the client's bytes, the engine's answer) finds
the router asleep in `epoll_wait`. A virtual machine's idle vCPU halts (on this project's
VMs at once: the guest's halt-polling window, `guest_halt_poll_ns`, is 0), the hypervisor
may give the core to another guest, and the router wakes on cold caches. Measured on this
project's 2-vCPU VM at concurrency 1 (`python -m benchmarks.busy_poll`,
`benchmarks/HISTORY.md` "Concurrency 1: the sleeping loop"), pdgate spent about 400 µs of
CPU a request against about 135 µs under load, and added 0.34-0.37 ms (p50) to a request
with the loop sleeping, 0.10-0.23 ms with it polling (vLLM Router 0.25-0.35 ms in the
same rounds). HAProxy's `busy-polling` option exists for the same reason.

What. While data requests are in flight (`in_flight`), and for `linger_s` after the last
one ended, a task hands the loop back at every turn, so the loop always has a callback
ready and polls its sockets with a zero timeout instead of sleeping. Each turn first
yields the CPU to any other thread waiting for it (`sched_yield`), so that a process
sharing the core (an engine, a client) is not held back until the scheduler's next tick;
even so the polling router's p99 at concurrency 1 was 0.1-0.5 ms longer than the sleeping
one's in the runs above (with the yield or without: within their spread). The linger
covers a client's pause between one answer and its next request. Otherwise the task
looks again every `IDLE_CHECK_S`: an idle router costs next to nothing, and only a
request that arrives during such a pause runs with the loop sleeping (until the next
look).

Cost. Up to one core per router process while it serves: CPU spent for latency. Every CPU
figure of the router grows by it at low load; at saturation the loop never sleeps anyway
and the task adds one step per turn. So it is off by default (`pdgate serve --busy-poll
MS` turns it on), for deployments that pay a core to take about 0.1-0.2 ms off each step.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Final

#: How often a busy poller that is not polling looks for requests in flight, seconds.
IDLE_CHECK_S: Final = 0.005


class BusyPoll:
    """Keeps the running loop polling while `in_flight()` is non-zero and for `linger_s`
    after (see the module docstring); `linger_s` 0 turns it off."""

    def __init__(self, linger_s: float, in_flight: Callable[[], int]) -> None:
        if linger_s < 0:
            raise ValueError("the busy-poll linger must not be negative")
        self.linger_s = linger_s
        self._in_flight = in_flight
        #: Loop turns spent polling (each a zero-timeout poll instead of a sleep).
        self.turns = 0

    @property
    def enabled(self) -> bool:
        return self.linger_s > 0

    async def run(self) -> None:
        """Poll while there is work (returns at once when off; otherwise runs until
        cancelled)."""
        if not self.enabled:
            return
        clock = time.perf_counter
        in_flight = self._in_flight
        until = 0.0
        while True:
            now = clock()
            if in_flight():
                until = now + self.linger_s
            if now < until:
                self.turns += 1
                os.sched_yield()
                await asyncio.sleep(0)  # a ready callback: the loop's next poll waits 0 s
            else:
                await asyncio.sleep(IDLE_CHECK_S)
