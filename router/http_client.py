"""The data path's HTTP/1.1 client: keep-alive connections to pods, parsed by httptools.

aiohttp's client was about a third of the router's CPU per request (building a
`ClientRequest`, a `CIMultiDict` of headers, a `ClientResponse`, its `StreamReader`, and
a wake-up per chunk through its data queue). This client does what the proxy needs and
no more: a POST whose head is written as one `bytes`, a response whose status and headers
are read by httptools' llhttp into a plain dict, and a body handed over as the parser
delivers it. One `Connection` per socket, one `Response` per request, nothing else.

- **Keep-alive pool.** Idle connections wait per pod (last in, first out) for at most
  `keepalive_s`, below the engines' own idle timeout (vLLM: 5 s), so the router never
  reuses a socket the engine is about to close; one the engine closed leaves the pool.
  Once a `keepalive_s` a finished request also closes every expired idle connection:
  a pod that left without closing its sockets is never asked again, and its connections
  would otherwise stay open for as long as the router runs.
- **Bounds.** At most `limit` connections in use router-wide and `limit_per_host` per
  pod; a request past a bound waits for a connection to come back, first come first
  served among the requests its turn can serve: a pod at its own bound holds up only
  the requests for that pod, never those for another pod with room.
- **Back-pressure.** A response buffers at most `HIGH_WATER` bytes the caller has not
  read; past that the socket stops reading until the caller catches up.
- **One hand-over per read.** In push mode (`stream_to`) the body bytes of one socket
  read go to the sink in one call, however many HTTP chunks they were: when a loaded
  router reads several SSE events of a stream at once, they leave in one write.
- **Failures.** Connecting raises `ConnectFailed` (bounded by `connect_timeout_s`); a
  connection that breaks before the response is complete raises `ConnectionBroken`. A
  response not read to its end is never reused: `release()` closes its socket.
"""

from __future__ import annotations

import asyncio
import itertools
import ssl
import time
from collections import deque
from collections.abc import Callable
from typing import Final

import httptools

#: Unread response bytes buffered before the socket stops reading (uvicorn's own bound).
HIGH_WATER: Final = 64 * 1024
#: A request body below this size is joined to its head and written in one call.
SMALL_BODY: Final = 16 * 1024


class ConnectionBroken(Exception):
    """The connection failed or closed before the response was complete."""


class ConnectFailed(ConnectionBroken):
    """No connection could be made (refused, unreachable, or too slow)."""


class Response:
    """One response: `status` and lower-cased `headers` once `request()` returns, then
    the body through `readany()` / `read()`. Release it (`release()`) when done."""

    __slots__ = ("_chunks", "_complete", "_conn", "_error", "_head", "_held", "_sink", "_size",
                 "_waiter", "headers", "status")

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.status = 0
        self.headers: dict[str, str] = {}
        self._head: asyncio.Future[None] | None = conn.loop.create_future()
        self._chunks: list[bytes] = []
        self._size = 0
        self._complete = False
        self._error: ConnectionBroken | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._sink: Callable[[bytes], None] | None = None
        self._held = False

    async def readany(self) -> bytes:
        """Whatever body bytes have arrived (waiting for some); b"" at the end."""
        while not self._chunks:
            if self._complete:
                return b""
            if self._error is not None:
                raise self._error
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        if self._size > HIGH_WATER:
            self._conn.resume()
        self._size = 0
        return data

    async def read(self, limit: int) -> bytes:
        """The whole body; raises `ConnectionBroken` past `limit` bytes."""
        parts: list[bytes] = []
        size = 0
        while block := await self.readany():
            size += len(block)
            if size > limit:
                raise ConnectionBroken(f"response body over {limit} bytes")
            parts.append(block)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    # --- push mode: body bytes handed to a callback as they arrive ----------------------

    def stream_to(self, sink: Callable[[bytes], None] | None) -> None:
        """Hand body bytes to `sink` from the connection's `data_received`, those of one
        socket read in one call (bytes already buffered first), instead of buffering them
        for `readany`; None goes back to buffering. See `wait` for the end of the body."""
        self._sink = sink
        if sink is not None and self._chunks:
            if self._size > HIGH_WATER:
                self._conn.resume()
            self._size = 0
            self._flush()

    async def wait(self) -> bool:
        """In push mode: wait until the body is complete (False) or `hold()` was called
        (True); raises `ConnectionBroken` if the connection broke first."""
        while not (self._complete or self._held or self._error is not None):
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._held:
            return True
        if not self._complete and self._error is not None:
            raise self._error
        return False

    def hold(self) -> None:
        """Stop reading from the socket and wake `wait()` (the sink's consumer pushes back)."""
        self._held = True
        self._conn.pause()
        self._wake()

    def unhold(self) -> None:
        self._held = False
        if self._size <= HIGH_WATER:
            self._conn.resume()

    def release(self) -> None:
        """Give the connection back (response read to its end) or close it."""
        conn = self._conn
        if conn.response is self:
            conn.response = None
            reuse = self._complete and conn.keep_alive
            if reuse and conn._paused:
                conn.resume()  # a hold on the body's last read, or its bytes left unread
            conn.pool.done(conn, reuse=reuse)

    close = release

    # --- fed by the connection --------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        if self._sink is not None:
            self._chunks.append(data)  # handed over once the read is parsed (`_flush`)
            return
        self._chunks.append(data)
        self._size += len(data)
        if self._size > HIGH_WATER:
            self._conn.pause()
        self._wake()

    def _flush(self) -> None:
        """In push mode: hand what the parser delivered to the sink, in one call."""
        chunks = self._chunks
        if chunks and self._sink is not None:
            data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            chunks.clear()
            self._sink(data)

    def _finish(self, error: ConnectionBroken | None) -> None:
        self._flush()  # the body's last bytes before its end
        if error is None:
            self._complete = True
        elif not self._complete:
            self._error = error
        head = self._head
        if head is not None and not head.done():
            head.set_exception(error or ConnectionBroken("response without a head"))
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class Connection(asyncio.Protocol):
    """One socket to one pod, serving one request at a time."""

    def __init__(self, pool: Pool, key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.keep_alive = True
        self.closed = False
        self.idle_since = 0.0
        self._paused = False

    def send(self, head: bytes, body: bytes) -> Response:
        response = self.response = Response(self)
        assert self.transport is not None
        if len(body) < SMALL_BODY:
            self.transport.write(head + body)  # one copy of a small body beats two writes
        else:
            self.transport.writelines((head, body))
        return response

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def pause(self) -> None:
        if not self._paused and self.transport is not None and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:
            self.close()  # bytes nobody asked for: this connection cannot be trusted
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.keep_alive = False
            self.close()
            response._finish(ConnectionBroken("invalid HTTP response"))
            return
        response._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.keep_alive = False
        self.pool.lost(self)
        response = self.response
        if response is not None:
            headers = response.headers
            if (exc is None and response.status and "content-length" not in headers
                    and "transfer-encoding" not in headers):
                response._finish(None)  # a close-delimited body ends with the connection
            else:
                response._finish(ConnectionBroken("the engine closed the connection"))

    # --- httptools callbacks ------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        response.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        head, response._head = response._head, None
        if head is not None and not head.done():
            head.set_result(None)

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response._feed(body)

    def on_message_complete(self) -> None:
        assert self.response is not None
        self.response._finish(None)


class Pool:
    """Keep-alive connections per pod, within the bounds of the module docstring."""

    def __init__(self, limit: int, limit_per_host: int, keepalive_s: float,
                 connect_timeout_s: float) -> None:
        self.limit = limit
        self.limit_per_host = limit_per_host
        self.keepalive_s = keepalive_s
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[tuple[str, int], list[Connection]] = {}
        self._busy: dict[tuple[str, int], int] = {}
        self._busy_total = 0
        #: Requests waiting for a connection under a bound, per pod, each with its ticket
        #: (arrival order across pods). Bounded by admission control: a request waits in
        #: one line at a time and leaves it when cancelled; a pod's line goes when empty.
        self._waiting: dict[tuple[str, int], deque[tuple[int, asyncio.Future[None]]]] = {}
        self._tickets = itertools.count()
        self._ssl: ssl.SSLContext | None = None
        self._closed = False
        self._swept = time.monotonic()

    async def request(self, scheme: str, host: str, port: int, head: bytes,
                      body: bytes) -> Response:
        """Send `head` + `body` to `host:port` and return the response once its head is in.

        `head` is the whole request head (request line, headers, blank line).
        """
        key = (host, port)
        conn = await self._acquire(scheme, key)
        try:
            response = conn.send(head, body)
            assert response._head is not None
            await response._head
        except BaseException:
            self.done(conn, reuse=False)
            conn.response = None
            raise
        return response

    async def _acquire(self, scheme: str, key: tuple[str, int]) -> Connection:
        while (self._busy_total >= self.limit
               or self._busy.get(key, 0) >= self.limit_per_host):
            waiter = asyncio.get_running_loop().create_future()
            entry = (next(self._tickets), waiter)
            line = self._waiting.get(key)
            if line is None:
                line = self._waiting[key] = deque()
            line.append(entry)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake_next()  # woken as we were cancelled: pass the turn on
                elif line is self._waiting.get(key) and entry in line:
                    line.remove(entry)  # never woken: leave the line (unless a wake-up
                    # in the same loop turn already dropped it, done, from the head)
                    if not line:
                        del self._waiting[key]
                raise
        self._busy_total += 1
        self._busy[key] = self._busy.get(key, 0) + 1
        idle = self._idle.get(key)
        if idle:
            stale_before = time.monotonic() - self.keepalive_s
            while idle:
                conn = idle.pop()
                if not idle:
                    del self._idle[key]  # no key per pod ever reached: pods come and go
                if not conn.closed and conn.idle_since > stale_before:
                    return conn
                conn.close()
        try:
            return await self._connect(scheme, key)
        except BaseException:
            self._unbusy(key)
            raise

    async def _connect(self, scheme: str, key: tuple[str, int]) -> Connection:
        if self._closed:
            raise ConnectFailed("the client is closed")
        loop = asyncio.get_running_loop()
        context = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: Connection(self, key), key[0], key[1], ssl=context
                )
        except (OSError, TimeoutError, ssl.SSLError) as exc:
            raise ConnectFailed(str(exc) or type(exc).__name__) from None
        return conn

    def done(self, conn: Connection, reuse: bool) -> None:
        """A request on `conn` is over: keep the connection for the next one, or close it."""
        key = conn.key
        self._unbusy(key)
        if reuse and not conn.closed and not self._closed:
            idle = self._idle.setdefault(key, [])
            if len(idle) < self.limit_per_host:
                now = conn.idle_since = time.monotonic()
                idle.append(conn)
                if now - self._swept > self.keepalive_s:
                    self._sweep(now)
                return
        conn.close()

    def _sweep(self, now: float) -> None:
        """Close every idle connection past `keepalive_s` (see the module docstring)."""
        self._swept = now
        stale_before = now - self.keepalive_s
        for key, idle in list(self._idle.items()):
            expired = [conn for conn in idle if conn.idle_since <= stale_before]
            if expired:
                idle[:] = [conn for conn in idle if conn.idle_since > stale_before]
                if not idle:
                    del self._idle[key]
                for conn in expired:
                    conn.close()

    def lost(self, conn: Connection) -> None:
        """`conn` closed: an idle one leaves the pool (a busy one is done by its owner)."""
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)
            if not idle:
                del self._idle[conn.key]

    def _unbusy(self, key: tuple[str, int]) -> None:
        self._busy_total -= 1
        left = self._busy[key] - 1
        if left:
            self._busy[key] = left
        else:
            del self._busy[key]
        if self._waiting:
            self._wake_next()

    def _wake_next(self) -> None:
        """Wake the longest-waiting request whose pod has room under `limit_per_host`
        (the lowest ticket among the lines' heads: one look per pod with a line, however
        many wait); requests for pods at their bound keep their places."""
        best: deque[tuple[int, asyncio.Future[None]]] | None = None
        best_key: tuple[str, int] | None = None
        for key, line in list(self._waiting.items()):
            while line and line[0][1].done():
                line.popleft()
            if not line:
                del self._waiting[key]
            elif self._busy.get(key, 0) < self.limit_per_host and (
                best is None or line[0][0] < best[0][0]
            ):
                best, best_key = line, key
        if best is not None and best_key is not None:
            _, waiter = best.popleft()
            if not best:
                del self._waiting[best_key]
            waiter.set_result(None)

    async def close(self) -> None:
        """Close every idle connection; connections in use close when released."""
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
