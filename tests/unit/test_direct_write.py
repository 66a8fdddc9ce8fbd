"""The edge's direct write path (`EdgeCycle`) as the data path's `Responder` uses it.

A real uvicorn server config with the edge's protocol class on a loopback socket; the
client speaks raw HTTP/1.1 so the bytes on the wire (framing, number of writes) are
what is checked.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from uvicorn.config import Config
from uvicorn.server import ServerState

from router.http import Edge, EdgeConfig
from router.http.protocol import EdgeCycle, direct_writer
from router.responder import Responder

WRITES: list[bytes] = []


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    out = Responder(send)
    if scope["path"] == "/whole":
        await out.start(200, [(b"content-type", b"application/json")])
        await out.body(b'{"a":1}')
    else:
        await out.start(200, [(b"content-type", b"text/event-stream")])
        await out.body(b"data: 1\n\n", more=True)
        await out.body(b"data: 2\n\n", more=True)
        await out.body(b"data: [DONE]\n\n")


class _Counting:
    """The server side's transport, recording each write."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def write(self, data: bytes) -> None:
        WRITES.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


@pytest.fixture
async def port() -> AsyncIterator[int]:
    config = Config(app, log_level="warning", **Edge(EdgeConfig(), CollectorRegistry())
                    .options("api"))
    config.load()
    protocol = config.http_protocol_class
    state = ServerState()

    class Counting(protocol):  # type: ignore[valid-type, misc]
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(_Counting(transport))  # type: ignore[arg-type]

    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Counting(config, state, {}), "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    for conn in list(state.connections):
        conn.transport.close()


async def _exchange(port: int, requests: list[bytes], answers: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for request in requests:
        writer.write(request)
    data = b""
    while data.count(b"HTTP/1.1 200") < answers or not (
        data.endswith(b"0\r\n\r\n") or data.endswith(b"}")
    ):
        block = await asyncio.wait_for(reader.read(65536), 5)
        assert block, data
        data += block
    writer.close()
    return data


def _post(path: str) -> bytes:
    return b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}" % path.encode()


async def test_a_whole_answer_goes_out_with_a_length_in_one_write(port: int) -> None:
    WRITES.clear()
    data = await _exchange(port, [_post("/whole")], 1)
    head, _, body = data.partition(b"\r\n\r\n")
    assert body == b'{"a":1}'
    assert b"content-length: 7" in head
    assert b"transfer-encoding" not in head
    assert len(WRITES) == 1


async def test_a_stream_is_chunked_with_its_head_in_the_first_write(port: int) -> None:
    WRITES.clear()
    data = await _exchange(port, [_post("/stream"), _post("/whole")], 2)
    first, _, second = data.partition(b'HTTP/1.1 200 OK\r\n', )[2].partition(b"HTTP/1.1 200")
    head, _, body = first.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head
    assert body == (b"9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n"
                    b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
    assert second.endswith(b'{"a":1}')  # the connection was kept for the next request
    # head + first chunk, second chunk, last chunk + terminator; then the whole answer
    assert len(WRITES) == 4
    assert WRITES[0].startswith(b"HTTP/1.1 200 OK") and WRITES[0].endswith(b"data: 1\n\n\r\n")


def test_only_http11_cycles_other_than_head_write_directly() -> None:
    assert direct_writer(print) is None
    cycle = EdgeCycle.__new__(EdgeCycle)
    cycle.scope = {"method": "HEAD"}  # type: ignore[typeddict-item]
    assert direct_writer(cycle.send) is None
    cycle.scope = {"method": "POST"}  # type: ignore[typeddict-item]
    assert direct_writer(cycle.send) is cycle
