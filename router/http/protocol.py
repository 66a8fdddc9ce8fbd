"""The connection layer: uvicorn's httptools protocol with the bounds a gateway needs.

uvicorn's `HttpToolsProtocol` parses and runs the ASGI app; this subclass adds, per
connection and never per chunk:

- **One request is one request.** httptools tells llhttp that any request carrying
  `Connection: upgrade` + `Upgrade: ...` has no body, then resumes parsing after it: the
  body of a `POST` with `Upgrade: h2c` became a second request when it arrived after the
  head (request smuggling, uvicorn#2722 / httptools#124), or was dropped when it came in
  the same packet. The router upgrades to nothing (no WebSocket, no h2c), so when the
  parser stops at an upgrade the rest of the connection goes to a fresh parser primed
  with the request's own framing (`Content-Length` or chunked): the body is read as the
  body, and the answer is plain HTTP/1.1.
- **A bounded head.** Bytes received before a head ends are counted (less the body
  bytes of a request before it that the same read ends); past `max_head_bytes` the client
  gets a 431 and the connection is closed (counted per read, so at most one read,
  256 KiB, beyond the bound is ever buffered).
- **Read timeouts.** The head must arrive within `header_timeout_s` (from accept, or from
  its first byte on a kept-alive connection), the body within `body_timeout_s` of the
  head; then 408 and close. Between requests uvicorn's keep-alive timer closes a
  connection idle for `idle_timeout_s` (started again by blank lines, which a client may
  send before a head and which begin none). The timers run only while a read is
  incomplete: a request that arrives in one read arms none.
- **A declared body past the bound.** A head whose Content-Length exceeds
  `max_body_bytes` gets a 413 at once and the connection is closed (its body is never
  read; a client that sent `Expect: 100-continue` is answered instead of invited).
- **A connection cap.** Past `max_connections` open connections on a listener a new one
  gets a 503 with `Retry-After` and is closed at once.
- **HTTP/1.0.** A 1.0 client cannot read chunked encoding: an answer without a
  Content-Length is sent close-delimited (`connection: close`, the close ends it).
- **Refusal from the head.** When the app's `EarlyRefusal` turns a request down from its
  head alone (admission saturated: see `router/app.py`), the answer is written once the
  body has been read (and dropped, never buffered), with no ASGI scope, cycle or task: a
  shed then costs a parse and a write, about 30 µs of router CPU against 110 µs through
  the app (the kernel's read and write are most of what is left; `benchmarks/HISTORY.md`,
  "Refusals from the head"). Only an HTTP/1.1
  keep-alive request with nothing ahead of it on the connection and no `Expect` takes
  this path; any other goes to the app, which answers the same 503.
- **Malformed requests** get an OpenAI-shaped 400 (`invalid_http_request`; uvicorn's is
  plain text) and the connection closes, after the answers to any valid requests sent
  ahead of them on it (as do the 413 and 431 above).
- **A client gone** is told to the request that runs, not only to the newest one parsed
  (uvicorn's `cycle`, which is queued when the client pipelined it behind a stream).
- **A direct write path.** An HTTP/1.1 request's cycle is an `EdgeCycle`: besides the
  ASGI `send`, it lets the data path (`direct_writer`) write its answer without a
  message dict and two coroutines per chunk, and with the head held back until the first
  body bytes, so the head and the first chunk leave in one write (one syscall); an answer
  whose first body is also its last goes out with a Content-Length, in one write.

Refusals and timeouts are counted in `pdgate_connections_refused_total{listener,reason}`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol

import httptools
from uvicorn.protocols.http.httptools_impl import (
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from router.errors import APIError, bad_request
from router.http.config import EdgeConfig
from router.http.metrics import ListenerMetrics
from router.request import body_too_large
from router.security.limits import headers_too_large

#: The head a fresh parser is primed with when an upgrade request's body must be read:
#: a request line, then the request's own framing headers (see `_read_body_as_body`).
_PRIMER = b"POST / HTTP/1.1\r\n"
_FRAMING = (b"content-length", b"transfer-encoding")


def _answer(error: APIError, default_headers: Sequence[tuple[bytes, bytes]] = (),
            close: bool = True) -> bytes:
    """A complete HTTP/1.1 error answer: one that closes the connection, or (`close`
    False) one on a connection that stays open, with the server's default headers (e.g.
    `date`) as on any answer."""
    body = error.body()
    lines = [STATUS_LINE[error.status]]
    for name, value in default_headers:
        lines += (name, b": ", value, b"\r\n")
    lines.append(b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body))
    if close:
        lines.append(b"connection: close\r\n")
    for key, text in error.headers.items():
        lines.append(b"%s: %s\r\n" % (key.encode(), text.encode()))
    lines += (b"\r\n", body)
    return b"".join(lines)


class EarlyRefusal(Protocol):
    """Decides from a request's head alone whether to refuse it at once (None: serve it).

    `path` is the raw path (no query, not percent-decoded); `headers` as in an ASGI scope.
    `check` counts what it refuses; returning the same error object for the same refusal
    lets the listener write the answer it encoded last time (`_LastAnswer`). `done`
    follows every refusal once: `answered` when
    the answer was written, not when the client left or its body stopped coming first
    (then a 408); `seconds` from the end of the head.
    """

    def check(self, method: bytes, path: bytes, headers: list[tuple[bytes, bytes]]
              ) -> APIError | None: ...

    def done(self, error: APIError, seconds: float, answered: bool) -> None: ...


class _LastAnswer:
    """One listener's encoded answer to its last refusal from the head, written again
    while the error and the server's default headers are the same objects (uvicorn
    renews that list, with its `date`, once a second): under a burst of refusals the
    answer is encoded about once a second, not once a request. One entry: the bound."""

    __slots__ = ("data", "defaults", "error")

    def __init__(self) -> None:
        self.error: APIError | None = None
        self.defaults: object = None
        self.data = b""

    def get(self, error: APIError, defaults: Sequence[tuple[bytes, bytes]]) -> bytes:
        if error is not self.error or defaults is not self.defaults:
            self.error, self.defaults = error, defaults
            self.data = _answer(error, defaults, close=False)
        return self.data


_TOO_MANY_CONNECTIONS = _answer(APIError(
    503, "The router has too many open connections; retry shortly.",
    type="server_error", code="too_many_connections", headers={"retry-after": "1"},
))
_HEADER_TIMEOUT = _answer(APIError(
    408, "The request head did not arrive in time.", code="request_timeout"))
_BODY_TIMEOUT = _answer(APIError(
    408, "The request body did not arrive in time.", code="request_timeout"))


class EdgeProtocol(HttpToolsProtocol):
    """One client connection (see the module docstring). Made by `protocol_class`."""

    edge: ClassVar[EdgeConfig]
    metrics: ClassVar[ListenerMetrics]
    refuse_early: ClassVar[EarlyRefusal | None] = None
    last_answer: ClassVar[_LastAnswer]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # waiting for the end of a request head
        self._head_started = False  # a byte of that head has arrived
        self._head_bytes = 0  # bytes received since it began (counted per read)
        self._upgrade_skipped_body = False  # the parser took an upgrade to have no body
        self._priming = False  # a fresh parser is reading our primer head
        #: A request refused from its head: the error and when; answered at its end.
        self._refused: tuple[APIError, float] | None = None
        self._closed_at_head = False  # answered from the head and closing: parse no more
        #: The last answer of a connection closing on a bad request (400, 413, 431), owed
        #: until the answers to the requests ahead of it are out.
        self._owed: bytes | None = None
        self._read_body = 0  # body bytes the parser found in the read being parsed
        self._timer: asyncio.TimerHandle | None = None
        #: The cycle whose task runs (uvicorn's `cycle` is the newest, maybe queued).
        self._running: RequestResponseCycle | None = None

    # --- connection ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.edge.max_connections:
            self.transport = transport
            self.metrics.refused("max_connections")
            transport.write(_TOO_MANY_CONNECTIONS)
            transport.close()
            return
        super().connection_made(transport)
        self._arm("header_timeout", self.edge.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._refused is not None:
            self._end_refused(answered=False)
        running, newest = self._running, self.cycle
        super().connection_lost(exc)
        # uvicorn tells only the newest cycle, which is queued when a pipelined request
        # arrived during the running one: the running one must learn it too.
        for cycle in (running, newest) if running is not newest else (newest,):
            if cycle is None:
                continue
            if not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
            if type(cycle) is EdgeCycle and cycle.disconnected:
                cycle.client_left()

    def _should_upgrade(self) -> bool:
        return False  # no WebSocket, no h2c: every request is answered in HTTP/1.1

    def data_received(self, data: bytes) -> None:
        if self.parser is None or self.transport.is_closing():
            return  # refused or closed: nothing more is read
        if self._owed is not None:
            return  # closing once the answers ahead are out: nothing more is parsed
        self._unset_keepalive_if_required()
        size = len(data)
        self._read_body = 0
        while True:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade as upgrade:
                if not self._upgrade_skipped_body:
                    self._bad_request()
                    return
                data = data[upgrade.args[0]:]
                self._read_body_as_body()
                if data:
                    continue
            except httptools.HttpParserError:
                self._bad_request()
                return
            break
        if self.transport.is_closing() or self._owed is not None:
            return
        if self._in_head:
            if self._head_started:  # the read may end an earlier request's body too
                self._head_bytes += size - self._read_body
                if self._head_bytes > self.edge.max_head_bytes:
                    self._refuse_after("header_too_large", _answer(headers_too_large(
                        f"Request head exceeds {self.edge.max_head_bytes} bytes.")))
                    return
                if self._timer is None:
                    self._arm("header_timeout", self.edge.header_timeout_s)
            elif (self.timeout_keep_alive_task is None
                  and (self.cycle is None or self.cycle.response_complete)
                  and not self.pipeline):  # `_nothing_ahead()`, inlined (every request)
                # Only blank lines, which a client may send before a head (the parser
                # skips them and no head begins), on an idle connection whose keep-alive
                # timer they stopped: it runs again (left off, two bytes held the
                # connection open for good).
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )
        elif self._timer is None:
            self._arm("body_timeout", self.edge.body_timeout_s)

    def _bad_request(self) -> None:
        message = "Invalid HTTP request received."
        self.logger.warning(message)
        self.send_400_response(message)

    def send_400_response(self, msg: str) -> None:
        """The answer to bytes that are not an HTTP request, in OpenAI's shape (uvicorn's
        is plain text), then the connection closes. Answers still owed on the connection
        go first: a malformed request pipelined behind a valid one no longer cancels it
        (reading stops; `on_response_complete` writes this once they are out)."""
        self._close_after(_answer(bad_request(msg, code="invalid_http_request"),
                                  self.server_state.default_headers))

    def _close_after(self, answer: bytes) -> None:
        """Write `answer` and close, once the answers to the requests ahead of it on the
        connection are out (written now, it would land inside a streaming one): until
        then it is owed, and nothing more is read or parsed."""
        if self._nothing_ahead():
            self.transport.write(answer)
            self.transport.close()
            return
        self._owed = answer
        self.flow.pause_reading()

    def _nothing_ahead(self) -> bool:
        """No response runs or waits to run on the connection."""
        return (self.cycle is None or self.cycle.response_complete) and not self.pipeline

    def on_response_complete(self) -> None:
        if self.pipeline:  # the oldest queued request runs next
            self._running = self.pipeline[-1][0]
        super().on_response_complete()
        owed = self._owed
        if owed is not None and self._nothing_ahead():
            self._owed = None
            if not self.transport.is_closing():
                self.transport.write(owed)
                self.transport.close()

    def _read_body_as_body(self) -> None:
        """Hand the connection to a fresh parser that reads the upgrade request's body.

        The new parser first reads a primer head carrying only the request's framing
        headers (`on_headers_complete` ignores it), so what follows is parsed as this
        request's body, then as the next request, as on any connection.
        """
        self._upgrade_skipped_body = False
        primer = [_PRIMER]
        for name, value in self.headers:
            if name in _FRAMING:
                primer += (name, b": ", value, b"\r\n")
        primer.append(b"\r\n")
        self.parser = httptools.HttpRequestParser(self)
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self._priming = True
        try:
            self.parser.feed_data(b"".join(primer))
        finally:
            self._priming = False

    # --- parser callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._head_started = True
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        if self._priming or self._closed_at_head:
            return
        self._in_head = False
        if self._timer is not None:
            self._disarm()
        if self._declares_too_large_a_body():
            self._refuse_after("body_too_large", _answer(
                body_too_large(self.edge.max_body_bytes), self.server_state.default_headers))
            return
        if self.parser.should_upgrade():
            self._upgrade_skipped_body = True  # see `_read_body_as_body`
        elif self.refuse_early is not None and self._may_refuse_early():
            error = self.refuse_early.check(
                self.parser.get_method(), self.url.partition(b"?")[0], self.headers)
            if error is not None:
                self._refused = (error, time.perf_counter())
                return  # no scope, no cycle, no task: see `on_message_complete`
        super().on_headers_complete()
        if not self.pipeline:  # not queued behind another: it runs
            self._running = self.cycle
        if self.cycle.scope is self.scope:  # before its task first runs:
            is_10 = self.scope["http_version"] == "1.0"
            self.cycle.__class__ = Http10Cycle if is_10 else EdgeCycle

    def on_body(self, body: bytes) -> None:
        self._read_body += len(body)
        if self._refused is None and not self._closed_at_head:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._closed_at_head:
            return  # answered from the head; the connection is closing
        if self._upgrade_skipped_body:
            return  # not the end: the body is still to come (see `_read_body_as_body`)
        self._in_head = True
        self._head_started = False
        self._head_bytes = 0
        if self._timer is not None:
            self._disarm()
        if self._refused is not None:
            self._answer_refused()
            return
        super().on_message_complete()

    def _declares_too_large_a_body(self) -> bool:
        """Whether the head's Content-Length is past `max_body_bytes`: answered 413 from
        the head and the connection closed, rather than read until the body timeout (a
        client waiting on `Expect: 100-continue` is told before it sends anything)."""
        for name, value in self.headers:
            if name == b"content-length":
                return value.isdigit() and int(value) > self.edge.max_body_bytes
        return False

    def _may_refuse_early(self) -> bool:
        """Whether an answer written now would be this request's, on a connection that
        stays open: HTTP/1.1 keep-alive, nothing ahead of it, no `Expect` to honour."""
        cycle = self.cycle
        return (
            (cycle is None or cycle.response_complete)
            and not self.expect_100_continue
            and self.parser.should_keep_alive()
            and self.parser.get_http_version() == "1.1"
        )

    def _answer_refused(self) -> None:
        assert self._refused is not None
        if self.transport.is_closing():
            self._end_refused(answered=False)
            return
        error = self._refused[0]
        self.transport.write(self.last_answer.get(error, self.server_state.default_headers))
        if self.access_log:
            self.access_logger.info('%s - "POST %s HTTP/1.1" %d', self.client,
                                    self.url.decode("latin-1"), error.status)
        self._end_refused(answered=True)
        self.on_response_complete()  # keep-alive timer, next request, request count

    def _end_refused(self, answered: bool) -> None:
        assert self._refused is not None and self.refuse_early is not None
        (error, since), self._refused = self._refused, None
        self.refuse_early.done(error, time.perf_counter() - since, answered)

    # --- timers -------------------------------------------------------------------------

    def _arm(self, reason: str, seconds: float) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._timed_out, reason, seconds)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self, reason: str, seconds: float) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        busy = self.cycle is not None and not self.cycle.response_complete
        if (reason == "header_timeout" and busy) or (
            reason == "body_timeout" and self.flow.read_paused
        ):
            # A pipelined head waits behind a response, or the app has not read the body
            # yet: the client is not the one keeping the connection.
            self._arm(reason, seconds)
            return
        if reason == "header_timeout":
            answer = _HEADER_TIMEOUT if self._head_started else b""  # silent if it said nothing
        elif self._refused is not None:  # refused from its head: no cycle of its own
            self._end_refused(answered=False)
            answer = _BODY_TIMEOUT
        else:
            answer = b"" if self.cycle.response_started else _BODY_TIMEOUT
        self._refuse(reason, answer)

    def _refuse(self, reason: str, answer: bytes) -> None:
        self.metrics.refused(reason)
        self._disarm()
        if answer:
            self.transport.write(answer)
        self.transport.close()

    def _refuse_after(self, reason: str, answer: bytes) -> None:
        """`_refuse`, once the answers to the requests pipelined ahead are out; the
        refused request's callbacks do nothing more meanwhile."""
        self._closed_at_head = True
        self.metrics.refused(reason)
        self._disarm()
        self._close_after(answer)


class Http10Cycle(RequestResponseCycle):
    """An HTTP/1.0 request's cycle: no chunked encoding, the close ends the body.

    uvicorn adds `transfer-encoding: chunked` to any answer without a Content-Length,
    whatever the request's version. Here such an answer is sent as is and the connection
    closed after it (uvicorn already marks 1.0 connections not to be kept alive).
    """

    close_delimited = False

    async def send(self, message: Any) -> None:
        if message["type"] == "http.response.start" and not self.response_started:
            headers = list(message.get("headers", ()))
            if not any(name.lower() == b"content-length" for name, _ in headers):
                self.close_delimited = True
                self.chunked_encoding = False  # uvicorn then adds no transfer-encoding
                message = {**message, "headers": [
                    (name, value) for name, value in headers
                    if name.lower() != b"transfer-encoding"
                ]}
        elif (self.close_delimited and message["type"] == "http.response.body"
              and not self.response_complete):
            await self._send_close_delimited(message)
            return
        await super().send(message)

    async def _send_close_delimited(self, message: Any) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        body = message.get("body", b"")
        if body and self.scope["method"] != "HEAD":
            self.transport.write(body)
        if not message.get("more_body", False):
            self.response_complete = True
            self.message_event.set()
            self.transport.close()
            self.on_response()


class EdgeCycle(RequestResponseCycle):
    """An HTTP/1.1 request's cycle, with the direct write path of the module docstring.

    `start_direct` takes the status and headers and writes nothing; `write_direct` writes
    the head (if still held) and a body chunk in one `transport.write`. Both keep the
    cycle's state (`response_started`, `response_complete`, flow control, keep-alive) as
    uvicorn's `send` would, so the rest of the protocol cannot tell the paths apart.
    """

    _held: tuple[int, list[tuple[bytes, bytes]]] | None = None
    #: Called once if the client goes away before the response is complete: what a
    #: task watching `receive()` for `http.disconnect` would learn, without the task.
    on_disconnect: Callable[[], None] | None = None

    def client_left(self) -> None:
        callback, self.on_disconnect = self.on_disconnect, None
        if callback is not None:
            callback()

    def start_direct(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        if self.response_started:
            raise RuntimeError("the response has already started")
        self.response_started = True
        self.waiting_for_100_continue = False
        self._held = (status, headers)

    async def write_direct(self, body: bytes, more: bool) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        self.write_now(body, more)

    def write_now(self, body: bytes, more: bool) -> None:
        """`write_direct` without waiting for the client to drain: the caller watches
        `flow.write_paused` itself (the stream relay pauses its upstream instead)."""
        if self.disconnected:
            return
        if self.response_complete:
            raise RuntimeError("the response is already complete")
        if self._held is not None:
            out = self._head(body, more)
        elif body:
            out = b"%x\r\n%b\r\n" % (len(body), body)
        else:
            out = b""
        if not more:
            if self.chunked_encoding:
                out += b"0\r\n\r\n"
            self.transport.write(out)
            self.response_complete = True
            self.message_event.set()
            if not self.keep_alive:
                self.transport.close()
            self.on_response()
        elif out:
            self.transport.write(out)

    def _head(self, body: bytes, more: bool) -> bytes:
        """The held head and `body`: Content-Length when this body is the whole answer,
        else chunked with `body` as the first chunk."""
        assert self._held is not None
        status, headers = self._held
        self._held = None
        if self.access_log:
            self.access_logger.info('%s - "%s %s HTTP/1.1" %d', self.scope.get("client"),
                                    self.scope["method"], self.scope["path"], status)
        lines = [STATUS_LINE[status]]
        for name, value in (*self.default_headers, *headers):
            if HEADER_VALUE_RE.search(value):
                raise RuntimeError("Invalid HTTP header value.")
            lines += (name, b": ", value, b"\r\n")
        if not self.keep_alive:
            lines.append(b"connection: close\r\n")
        if not more:
            self.chunked_encoding = False
            lines += (b"content-length: %d\r\n\r\n" % len(body), body)
        else:
            self.chunked_encoding = True
            lines.append(b"transfer-encoding: chunked\r\n\r\n")
            if body:
                lines += (b"%x\r\n" % len(body), body, b"\r\n")
        return b"".join(lines)


def direct_writer(send: Any) -> EdgeCycle | None:
    """The `EdgeCycle` behind an ASGI `send`, when its direct write path may be used
    (an HTTP/1.1 request other than HEAD); None otherwise (use `send`)."""
    cycle = getattr(send, "__self__", None)
    if type(cycle) is EdgeCycle and cycle.scope["method"] != "HEAD":
        return cycle
    return None


def protocol_class(
    edge: EdgeConfig, metrics: ListenerMetrics, refuse_early: EarlyRefusal | None = None
) -> type[EdgeProtocol]:
    """An `EdgeProtocol` bound to one listener's bounds, metrics and early refusal, for
    uvicorn's `http`."""
    return type("BoundEdgeProtocol", (EdgeProtocol,),
                {"edge": edge, "metrics": metrics, "refuse_early": refuse_early,
                 "last_answer": _LastAnswer()})
