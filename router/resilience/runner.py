"""Running uvicorn with our own SIGTERM handling: drain first, then stop, then exit 0.

uvicorn's own handler closes the listening socket at once (so `/readyz` can no longer say
"not ready") and re-raises the signal after shutdown (so the exit status is not 0). Here
the first SIGTERM or SIGINT starts a drain (see `drain.py`): the port stays open and
answers `/readyz` 503, data requests already in flight finish within the grace period,
then every server stops. When the grace runs out, or on a second signal, the requests
still in flight are cut off: each ends its response with a `shutting_down` error (an
error event and `[DONE]` on a stream, a 503 before the first byte), one log line says how
many, and the process still exits 0. A third signal stops without waiting for the cut-off
requests to send their endings (uvicorn still gives them `SHUTDOWN_SLACK_S`).
An optional second server on `admin_port` serves the operational endpoints (metrics,
health) apart from client traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from router.http import Edge
from router.resilience.config import ResilienceConfig
from router.resilience.drain import Drain

log = logging.getLogger("pdgate.runner")

#: How long uvicorn may still wait for connections once the drain is over.
SHUTDOWN_SLACK_S = 1.0
#: How long requests cut off at the end of a drain get to send their error ending.
CUT_WAIT_S = 1.0


#: How often the servers' main loop wakes: uvicorn's wakes every 0.1 s to refresh its
#: `date` header once a second and to look at `should_exit`, ten wake-ups a second of an
#: idle router; the header's resolution is a second, and `stop()` ends the wait at once.
TICK_S = 1.0


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signal handling to `DrainingRunner` and ticks once a
    second (`TICK_S`)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._stopping = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def stop(self) -> None:
        """Stop serving (uvicorn's `should_exit`), now rather than at the next tick."""
        self.should_exit = True
        self._stopping.set()

    async def main_loop(self) -> None:
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 10) % 864000  # uvicorn refreshes `date` on multiples of 10
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TICK_S):
                    await self._stopping.wait()


class DrainingRunner:
    """One main server, maybe an admin server, one drain (see the module docstring)."""

    def __init__(
        self,
        app: Any,
        admin_app: Any | None,
        *,
        host: str,
        port: int,
        admin_port: int | None,
        log_level: str,
        drain: Drain,
        config: ResilienceConfig,
        edge: Edge,
        sockets: tuple[socket.socket | None, socket.socket | None] = (None, None),
    ) -> None:
        common: dict[str, Any] = {
            "host": host, "loop": "uvloop", "log_level": log_level,
            "access_log": False, "timeout_graceful_shutdown": SHUTDOWN_SLACK_S,
        }
        self.main = _Server(uvicorn.Config(app, port=port, lifespan="on",
                                           **edge.options("api"), **common))
        edge.count_open("api", self.main.server_state.connections)
        self.servers = [self.main]
        if admin_app is not None and admin_port is not None:
            admin = _Server(uvicorn.Config(admin_app, port=admin_port, lifespan="off",
                                           **edge.options("admin"), **common))
            edge.count_open("admin", admin.server_state.connections)
            self.servers.append(admin)
        self.sockets = sockets  # (main, admin): pre-bound (`--workers`: SO_REUSEPORT) or None
        self.drain = drain
        self.config = config
        self._drain_task: asyncio.Task[None] | None = None
        self._hurry = asyncio.Event()  # a second signal: stop waiting for the grace
        self._signals = 0
        self._last_signal = 0

    def run(self) -> int:
        with asyncio.Runner(loop_factory=self.main.config.get_loop_factory()) as runner:
            return runner.run(self.serve())

    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.on_signal, signum)
        try:
            await asyncio.gather(*(
                server.serve(sockets=None if sock is None else [sock])
                for server, sock in zip(self.servers, self.sockets, strict=False)
            ))
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)
            if self._drain_task is not None:
                self._drain_task.cancel()
        return 0

    def on_signal(self, signum: int) -> None:
        self._signals += 1
        self._last_signal = signum
        if self._drain_task is None:
            log.warning("signal %d: draining (grace %g s)", signum, self.config.drain_grace_s)
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())
        elif self._signals == 2:
            self._hurry.set()  # `_drain` logs the cut-off
        else:
            # Not uvicorn's force_exit: that skips the lifespan shutdown (sessions left
            # open, a CancelledError traceback). Its own shutdown is bounded anyway.
            log.warning("signal %d a third time: stopping without waiting", signum)
            for server in self.servers:
                server.stop()

    async def _drain(self) -> None:
        began = time.monotonic()
        self.drain.begin()
        grace = self.config.drain_grace_s
        delay = min(self.config.drain_delay_s, grace)
        if delay:  # /readyz reports 503 a while before the wait starts
            await _first_of(delay, self._hurry)
        await _first_of(began + grace - time.monotonic(), self.drain.idle, self._hurry)
        took = time.monotonic() - began
        if self.drain.active == 0:
            log.warning("drained in %.2f s", took)
        else:
            why = (f"signal {self._last_signal} again after {took:.2f} s"
                   if self._hurry.is_set()
                   else f"grace period over after {took:.2f} s")
            log.warning("%s: ending %d request(s) in flight with a shutting_down error",
                        why, self.drain.cut())
            await _first_of(CUT_WAIT_S, self.drain.idle)
        for server in self.servers:
            server.stop()


async def _first_of(timeout_s: float, *events: asyncio.Event) -> None:
    """Wait until one of `events` is set, or `timeout_s` has passed."""
    if timeout_s <= 0 or any(event.is_set() for event in events):
        return
    waiters = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
