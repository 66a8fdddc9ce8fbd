"""Relaying one decode stream to the client: the per-chunk work, in a task or a callback.

`StreamRelay.take` folds a chunk into the stream's state (the tail that tells `[DONE]`,
the Responses API's last event, the usage watcher) and says what to send; `sent` times
what went out (TTFT at the first content, ITL after). The proxy's task runs them for the
first chunk, which starts the response. From then on, when the edge's direct write path
serves the client (`Responder.direct`), `run` hands the rest of the body to `on_data`,
called by the upstream connection once per socket read: what the read brought (one
SSE event, or several when the router is busy) is checked, written in one write and
timed there, with no task wake-up, future or coroutine per chunk. The task
sleeps until the body ends or breaks, or the client's socket pushes back (its write
buffer past the high-water mark): then the upstream socket stops reading until the
client drains, so at most one upstream read sits in the client's buffer beyond the mark.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from router.http_client import Response
from router.metrics import RouterMetrics
from router.security.usage import StreamUsage
from router.tally import BucketCounts
from router.timing import Timeline, content_events

DONE = b"data: [DONE]"
#: How many bytes of a stream's end are kept to check that it ended with `[DONE]`.
TAIL = 32
#: The Responses API's last event (vLLM sends no `[DONE]` after it): any of these.
RESPONSE_ENDS = (b"event: response.completed", b"event: response.incomplete",
                 b"event: response.failed")


def ends_done(tail: bytes) -> bool:
    """Whether a stream's last bytes are its `data: [DONE]` event."""
    return tail.rstrip().endswith(DONE)


class _Writer(Protocol):
    """What `run` needs of `router.responder.Responder` (structural: no import cycle)."""

    finished: bool

    def write_now(self, data: bytes, more: bool) -> None: ...


class StreamRelay:
    """One stream's relay state (see the module docstring)."""

    __slots__ = ("_clock", "_finished", "_first_lap", "_metrics", "_model", "_on_end", "end",
                 "ended", "failure", "first_at", "itl", "last_at", "responses", "usage")

    def __init__(self, metrics: RouterMetrics, model: str, clock: Timeline, first_lap: str,
                 usage: StreamUsage | None, responses: bool,
                 on_end: Callable[[], None] | None = None) -> None:
        self._metrics = metrics
        self._model = model
        self._clock = clock
        self._first_lap = first_lap
        self._on_end = on_end  # the caller's part of `finish` (charging output tokens)
        self._finished = False
        self.usage = usage
        self.responses = responses  # a Responses API stream: it ends with RESPONSE_ENDS
        self.end = b""  # the stream's last bytes
        self.ended = False  # a Responses stream's last event went by
        #: The ITL histogram child, once the first content went out.
        self.itl: BucketCounts | None = None
        self.first_at = self.last_at = 0.0
        self.failure: Exception | None = None  # raised by `on_data`, re-raised by `run`

    @property
    def complete(self) -> bool:
        """Whether the stream ended as its protocol ends a stream."""
        return self.ended if self.responses else ends_done(self.end)

    def take(self, chunk: bytes) -> tuple[bytes, bool] | None:
        """Fold `chunk` in; the bytes to send and whether more follow (None: none yet).

        The chunk that carries `[DONE]` ends the response itself (one write, the chunked
        terminator in it) unless part of an event is still held back.
        """
        end = self.end
        if self.responses and not self.ended:
            seen = end + chunk
            self.ended = any(marker in seen for marker in RESPONSE_ENDS)
        self.end = chunk if len(chunk) >= TAIL else (end + chunk)[-TAIL:]
        usage = self.usage
        if usage is not None:
            chunk = usage.feed(chunk)
            if not chunk:
                return None
        return chunk, not ends_done(self.end) or (usage is not None and usage.pending)

    def sent(self, chunk: bytes) -> None:
        """Time a chunk that went out: TTFT and its phases at the first content, ITL after.
        Content events that went out in the same write are 0 s apart."""
        events = content_events(chunk)
        if not events:
            return
        itl = self.itl
        if itl is None:  # the first token reached the client
            clock = self._clock
            self.first_at = self.last_at = clock.lap(self._first_lap)
            self._metrics.first_token(self._model, self.first_at - clock.arrived, clock.laps)
            itl = self.itl = self._metrics.inter_token(self._model)
        else:
            now = time.perf_counter()
            itl.observe(now - self.last_at)
            self.last_at = now
        for _ in range(events - 1):
            itl.observe(0.0)

    def last_step(self, chunk: bytes) -> None:
        """The step that ends the response (`take` said no more follow) is about to be
        written: time it and `finish` first. Whatever the stream's end settles is done
        before the client can read that end and ask again, or scrape `/metrics`."""
        self.sent(chunk)
        self.finish(complete=True)

    def finish(self, complete: bool) -> None:
        """The stream ends (once; before its last bytes go out): the output rate of a
        stream that ended as its protocol ends one, then the caller's `on_end`."""
        if self._finished:
            return
        self._finished = True
        tokens = self.usage.tokens if self.usage is not None else None
        if complete and tokens is not None and tokens > 1 and self.last_at > self.first_at:
            self._metrics.output_rate(self._model,
                                      (tokens - 1) / (self.last_at - self.first_at))
        if self._on_end is not None:
            self._on_end()

    async def run(self, response: Response, out: _Writer, paused: _Paused) -> None:
        """Relay the rest of the body through `on_data` (the direct write path only).

        Returns once the body is complete; raises `ConnectionBroken` if it broke.
        """

        def on_data(chunk: bytes) -> None:
            try:
                step = self.take(chunk)
                if step is None or out.finished:
                    return  # nothing whole yet, or after [DONE] (read to EOF, send nothing)
                if step[1]:
                    out.write_now(*step)
                    self.sent(step[0])
                else:
                    self.last_step(step[0])
                    out.write_now(*step)
            except Exception as exc:  # surfaced by the task, not by the upstream socket
                self.failure = exc
                response.hold()
                return
            if paused.write_paused:
                response.hold()

        response.stream_to(on_data)
        try:
            while await response.wait():
                if self.failure is not None:
                    raise self.failure
                await paused.drain()
                response.unhold()
        finally:
            response.stream_to(None)


class _Paused(Protocol):
    """The client connection's flow control (uvicorn's `FlowControl`)."""

    write_paused: bool

    async def drain(self) -> None: ...
