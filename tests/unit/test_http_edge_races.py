"""The connection layer's races, in process over loopback: the real `EdgeProtocol` (as
`pdgate serve` configures uvicorn) serving small ASGI apps to raw sockets, where a test
can time what a separate router process cannot (a client that stops reading, a request
pipelined behind a stream, blank lines between requests). The rest of the edge is tested
on real processes in `tests/integration/test_http_edge.py`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httptools
import pytest
from prometheus_client import CollectorRegistry
from uvicorn.config import Config
from uvicorn.server import ServerState

from router.errors import gateway_timeout
from router.http import Edge, EdgeConfig
from router.responder import Responder

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


class Edges:
    """Starts edge listeners for the test and closes them after it."""

    def __init__(self) -> None:
        self.servers: list[asyncio.Server] = []

    async def serve(self, app: App, **edge: Any) -> int:
        config = Config(app, log_level="error",
                        **Edge(EdgeConfig(**edge), CollectorRegistry()).options("api"))
        config.load()
        state = ServerState()
        server = await asyncio.get_running_loop().create_server(
            lambda: config.http_protocol_class(config, state, {}),  # type: ignore[call-arg]
            "127.0.0.1", 0,
        )
        self.servers.append(server)
        port: int = server.sockets[0].getsockname()[1]
        return port


@pytest.fixture
async def edges() -> AsyncIterator[Edges]:
    running = Edges()
    yield running
    for server in running.servers:
        server.close()


def post(path: str, declared: int | None = None) -> bytes:
    """A POST with a 2-byte JSON body, or only a head declaring `declared` bytes."""
    length = 2 if declared is None else declared
    head = b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % (path.encode(), length)
    return head + (b"{}" if declared is None else b"")


class Streams:
    """An app streaming `count` events 0.1 s apart per request (then [DONE]), noting how
    each one ends; it stops early when told its client left."""

    def __init__(self, count: int = 6) -> None:
        self.count = count
        self.events: list[tuple[str, str]] = []
        self.ended: dict[str, asyncio.Event] = {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        path = scope["path"]
        ended = self.ended.setdefault(path, asyncio.Event())
        out = Responder(send)
        cycle = out.direct
        assert cycle is not None
        cycle.on_disconnect = lambda: self.events.append(("client left", path))
        await out.start(200, [(b"content-type", b"text/event-stream")])
        try:
            for i in range(self.count):
                if cycle.disconnected:
                    return
                await out.body(b"data: %d\n\n" % i, more=True)
                await asyncio.sleep(0.1)
            await out.body(b"data: [DONE]\n\n")
        finally:
            self.events.append(("ended", path))
            ended.set()


async def answer_json(send: Any) -> None:
    out = Responder(send)
    await out.start(200, [(b"content-type", b"application/json")])
    await out.body(b"{}")


async def read_until_closed(reader: asyncio.StreamReader, limit_s: float = 5.0) -> bytes:
    data = b""
    async with asyncio.timeout(limit_s):
        while block := await reader.read(65536):
            data += block
    return data


class _Answers:
    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.bodies: list[bytes] = []
        self.parser = httptools.HttpResponseParser(self)

    def on_message_begin(self) -> None:
        self.bodies.append(b"")

    def on_headers_complete(self) -> None:
        self.statuses.append(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        self.bodies[-1] += body


def answers(raw: bytes) -> _Answers:
    parsed = _Answers()
    parsed.parser.feed_data(raw)
    return parsed


# --- a client that stops reading -----------------------------------------------------------


async def test_a_stream_ends_at_its_deadline_though_its_client_stopped_reading(
    edges: Edges,
) -> None:
    """As the proxy does: the relay runs under the request's deadline, then the error
    ending is written. The client keeps its socket but reads nothing, so its buffer is
    past the mark: the request still ends at the deadline (it waited for the client to
    drain, holding its admission slot and task until the client closed)."""
    ended: list[float] = []
    over = asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        out = Responder(send)
        await out.start(200, [(b"content-type", b"text/event-stream")])
        began = time.monotonic()
        try:
            async with asyncio.timeout(0.3):
                while True:
                    await out.body(b"data: " + b"x" * 4000 + b"\n\n", more=True)
        except TimeoutError:
            await out.end(gateway_timeout())
        ended.append(time.monotonic() - began)
        over.set()

    port = await edges.serve(app)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.transport.pause_reading()  # type: ignore[attr-defined]
    writer.write(post("/stream"))
    await asyncio.wait_for(over.wait(), 3)
    assert ended[0] < 1.0
    writer.transport.resume_reading()  # type: ignore[attr-defined]
    tail = b""  # the client reads again: its stream's ending is there
    while b"0\r\n\r\n" not in tail:
        block = await asyncio.wait_for(reader.read(1 << 20), 3)
        assert block, "the connection closed before the stream's ending"
        tail += block
    assert b"event: error" in tail or b'"error"' in tail
    writer.close()


# --- blank lines between requests ----------------------------------------------------------


async def test_blank_lines_after_an_answer_do_not_stop_the_idle_clock(edges: Edges) -> None:
    """A kept-alive connection that sends only CRLF after its answer is closed like an
    idle one, after the idle timeout (the bytes stopped the keep-alive timer and began no
    head, which left no timer at all: two bytes held a connection open for good)."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await answer_json(send)

    port = await edges.serve(app, idle_timeout_s=0.6, header_timeout_s=0.1)
    for extra in (b"", b"\r\n"):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/x"))
        raw = await reader.readuntil(b"{}")
        assert answers(raw).statuses == [200]
        writer.write(extra)
        began = time.monotonic()
        assert await asyncio.wait_for(reader.read(1), 5) == b""  # closed by the router
        assert time.monotonic() - began > 0.3  # as idle, not as a head that is late
        writer.close()


# --- a request pipelined behind a stream ---------------------------------------------------


@pytest.mark.parametrize(("second", "status"), [
    (post("/big", declared=10**6), 413),
    (b"POST /big HTTP/1.1\r\nx-big: " + b"y" * 3000, 431),
], ids=["body past the bound", "head past the bound"])
@pytest.mark.parametrize("together", [False, True], ids=["later", "in the same write"])
async def test_a_refusal_pipelined_behind_a_stream_follows_it(
    edges: Edges, second: bytes, status: int, together: bool
) -> None:
    """A request refused from its head (body declared past the bound, or a head past
    its bound) arrives while the stream ahead of it runs, or with it: the stream ends
    whole, then the refusal is answered and the connection closed (it was written into
    the stream; then, deferred, a read timer armed after it cut the stream silently once
    the stream outlived the body timeout, and the refusal never went out)."""
    streams = Streams()
    port = await edges.serve(streams, max_body_bytes=1000, max_head_bytes=2000,
                             body_timeout_s=0.3, header_timeout_s=0.3)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if together:
        writer.write(post("/a") + second)
    else:
        writer.write(post("/a"))
        await asyncio.sleep(0.15)
        writer.write(second)
    parsed = answers(await read_until_closed(reader))
    assert parsed.statuses == [200, status]
    assert parsed.bodies[0].endswith(b"data: [DONE]\n\n") and parsed.bodies[0].count(b"data:") == 7
    writer.close()


async def test_a_body_ending_in_the_read_a_head_begins_in_is_not_counted_as_head(
    edges: Edges,
) -> None:
    """A request's large body and the first bytes of the next head come in one read: the
    next request is served (the whole read was counted as head bytes: a false 431)."""
    bodies: list[int] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        size = 0
        while True:
            message = await receive()
            size += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        bodies.append(size)
        await answer_json(send)

    port = await edges.serve(app, max_head_bytes=2000, max_body_bytes=1 << 20)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    big = b"x" * 100_000
    first = b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(big) + big
    second = post("/b")
    writer.write(first + second[:10])
    await writer.drain()
    await asyncio.sleep(0.2)
    writer.write(second[10:])
    raw = b""
    async with asyncio.timeout(3):
        while raw.count(b"{}") < 2:
            raw += await reader.read(65536)
    assert answers(raw).statuses == [200, 200]
    assert bodies == [100_000, 2]
    writer.close()


async def test_a_client_gone_with_a_request_queued_stops_the_stream_ahead(
    edges: Edges,
) -> None:
    """The client pipelines a second request behind a stream, then goes: the running
    stream learns it (only the queued one did; the stream ran to its end for nobody)."""
    streams = Streams(count=50)  # 5 s, unless it learns its client left
    port = await edges.serve(streams)
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(post("/a"))
    await asyncio.sleep(0.15)
    writer.write(post("/b"))
    await asyncio.sleep(0.1)
    writer.transport.abort()
    await asyncio.wait_for(streams.ended["/a"].wait(), 10)
    assert ("client left", "/a") in streams.events
    assert ("ended", "/b") not in streams.events  # never started
