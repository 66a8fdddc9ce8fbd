"""`StreamRelay.run`: a stream relayed by callback, with the client's socket pushing back.

A loopback server streams SSE events as fast as it can; the relay writes them to a
recording writer whose flow control says "paused" after the first write. While paused
nothing more may be written (the upstream socket stops reading); once drained, the rest
arrives, ending with the chunk that carries [DONE].
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry

from router.http_client import Pool
from router.metrics import RouterMetrics
from router.relay import StreamRelay
from router.security.usage import StreamUsage
from router.timing import Timeline

EVENTS = 2000
EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"token"}}]}\n\n'


async def _start_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read the request, write the head of a chunked SSE response."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    await reader.readexactly(length)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                 b"transfer-encoding: chunked\r\n\r\n")


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _start_stream(reader, writer)
    for _ in range(EVENTS):
        writer.write(b"%x\r\n%b\r\n" % (len(EVENT), EVENT))
    done = b"data: [DONE]\n\n"
    writer.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(done), done))
    await writer.drain()
    await reader.read(1)
    writer.close()


@pytest.fixture
async def port() -> AsyncIterator[int]:
    server = await asyncio.start_server(_serve, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[1]


class Flow:
    """The client's flow control: paused until `drained` is set."""

    def __init__(self) -> None:
        self.write_paused = False
        self.drained = asyncio.Event()
        self.waits = 0

    async def drain(self) -> None:
        self.waits += 1
        await self.drained.wait()
        self.write_paused = False


class Writer:
    def __init__(self, flow: Flow) -> None:
        self.flow = flow
        self.finished = False
        self.writes: list[tuple[bytes, bool]] = []

    def write_now(self, data: bytes, more: bool) -> None:
        self.writes.append((data, more))
        self.finished = not more
        self.flow.write_paused = True  # the client's buffer is full after every write


async def test_relay_pauses_upstream_while_the_client_is_full(port: int) -> None:
    pool = Pool(4, 4, 4.0, 2.0)
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n")
    response = await pool.request("http", "127.0.0.1", port, head, b"{}")
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    relay = StreamRelay(metrics, "m", Timeline(), "first_token", None, False)
    flow = Flow()
    out = Writer(flow)
    task = asyncio.ensure_future(relay.run(response, out, flow))
    await asyncio.sleep(0.3)
    assert not task.done()
    assert flow.waits == 1  # the relay waits for the client to drain ...
    assert len(out.writes) == 1  # ... and wrote nothing more meanwhile
    flow.write_paused = False  # from now on the client keeps up
    out.flow = Flow()
    flow.drained.set()
    await asyncio.wait_for(task, 10)
    body = b"".join(data for data, _ in out.writes)
    assert body == EVENT * EVENTS + b"data: [DONE]\n\n"
    assert out.writes[-1][1] is False  # the [DONE] chunk ended the response
    assert all(more for _, more in out.writes[:-1])
    assert relay.complete
    # The events of each upstream read went out in one write; the ITL histogram still has
    # one gap per pair of tokens the client received.
    assert len(out.writes) < EVENTS
    itl = registry.get_sample_value("pdgate_inter_token_latency_seconds_count", {"model": "m"})
    assert itl == EVENTS - 1
    response.release()
    await pool.close()


USAGE_EVENT = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":%d}}\n\n'


async def _serve_with_usage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Four content events, one read each, then the usage event and [DONE] in one chunk."""
    await _start_stream(reader, writer)
    for _ in range(4):
        writer.write(b"%x\r\n%b\r\n" % (len(EVENT), EVENT))
        await writer.drain()
        await asyncio.sleep(0.01)
    tail = USAGE_EVENT % 4 + b"data: [DONE]\n\n"
    writer.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(tail), tail))
    await writer.drain()
    await reader.read(1)
    writer.close()


async def test_the_stream_end_is_settled_before_its_last_bytes_go_out() -> None:
    """The output-token charge (`on_end`) and the output-rate histogram are done before
    the write that ends the response: a client that reads the end and at once sends its
    next request, or scrapes /metrics, must find them (a fresh clone's suite once saw the
    next request admitted past its route's output-token limit)."""
    server = await asyncio.start_server(_serve_with_usage, "127.0.0.1", 0)
    pool = Pool(4, 4, 4.0, 2.0)
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    rates = "pdgate_output_tokens_per_second_count"
    async with server:
        port = server.sockets[0].getsockname()[1]
        head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n"
        response = await pool.request("http", "127.0.0.1", port, head, b"{}")
        flow = Flow()
        out = Writer(flow)
        seen_at_end: list[tuple[int, float | None]] = []
        relay = StreamRelay(
            metrics, "m", Timeline(), "first_token", StreamUsage(hide=True), False,
            on_end=lambda: seen_at_end.append(
                (len(out.writes), registry.get_sample_value(rates, {"model": "m"}))),
        )
        task = asyncio.ensure_future(relay.run(response, out, flow))
        while not task.done():  # the client keeps up
            await asyncio.sleep(0.005)
            flow.write_paused = False
            flow.drained.set()
        await task
        response.release()
    await pool.close()
    body = b"".join(data for data, _ in out.writes)
    assert body == EVENT * 4 + b"data: [DONE]\n\n"  # the usage event hidden
    assert relay.usage is not None and relay.usage.charged == 4
    assert out.writes[-1][1] is False
    # Called once, when every write but the last one had gone out, the rate already there.
    assert seen_at_end == [(len(out.writes) - 1, 1.0)]
