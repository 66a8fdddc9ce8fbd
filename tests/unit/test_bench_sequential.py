"""`benchmarks.sequential`: requests one after another on kept-alive connections, the PD
floor's prefill handle passed to decode as `DirectPDTarget` passes it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from benchmarks.loadgen import LoadLimits, run_closed
from benchmarks.sequential import run_sequential
from benchmarks.specs import RequestSpec
from benchmarks.targets import DirectPDTarget, HTTPTarget, RoundRobin
from tests.local_http import read_request

STREAM = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n'
HANDLE = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [[1]]}


class Server:
    """A loopback HTTP/1.1 server: JSON with a KV handle to `max_tokens: 1` requests,
    an SSE stream to the others; it records every body and counts connections."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        while (raw := await read_request(reader)) is not None:
            body = json.loads(raw)
            self.bodies.append(body)
            if body.get("max_tokens") == 1:
                raw = json.dumps({"choices": [], "kv_transfer_params": HANDLE}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%b" % (len(raw), raw))
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n\r\n"
                             % (len(STREAM), STREAM))
            await writer.drain()
        writer.close()


def _specs(count: int) -> list[RequestSpec]:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
            "stream": True, "stream_options": {"include_usage": True}}
    return [RequestSpec(i, 0, json.dumps(body).encode()) for i in range(count)]


async def test_requests_go_one_after_another_on_one_connection() -> None:
    server = Server()
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    async with listener:
        port = listener.sockets[0].getsockname()[1]
        results, wall = await run_sequential(HTTPTarget("t", f"http://127.0.0.1:{port}"),
                                             _specs(20), time_limit=30.0)
    assert [r.status for r in results] == [200] * 20
    assert all(r.ok and r.e2e > 0 for r in results)
    assert sum(r.e2e for r in results) <= wall
    assert server.connections == 1 and len(server.bodies) == 20


async def test_the_pd_floor_prefills_then_decodes_with_the_handle() -> None:
    prefill, decode = Server(), Server()
    p_listener = await asyncio.start_server(prefill.handle, "127.0.0.1", 0)
    d_listener = await asyncio.start_server(decode.handle, "127.0.0.1", 0)
    async with p_listener, d_listener:
        target = DirectPDTarget(
            "direct", f"http://127.0.0.1:{p_listener.sockets[0].getsockname()[1]}",
            f"http://127.0.0.1:{d_listener.sockets[0].getsockname()[1]}")
        results, _ = await run_sequential(target, _specs(3), time_limit=30.0)
    assert all(r.ok for r in results)
    assert [b["max_tokens"] for b in prefill.bodies] == [1, 1, 1]
    assert all(b["stream"] is False and "stream_options" not in b for b in prefill.bodies)
    assert all(b["kv_transfer_params"]["do_remote_decode"] for b in prefill.bodies)
    assert [b["kv_transfer_params"] for b in decode.bodies] == [HANDLE] * 3
    assert all(b["max_tokens"] == 4 and b["stream"] for b in decode.bodies)


async def test_an_answer_that_is_not_ok_is_an_error() -> None:
    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    listener = await asyncio.start_server(refuse, "127.0.0.1", 0)
    async with listener:
        port = listener.sockets[0].getsockname()[1]
        results, _ = await run_sequential(HTTPTarget("t", f"http://127.0.0.1:{port}"),
                                          _specs(1), time_limit=30.0)
    assert [(r.status, r.error) for r in results] == [(503, "http_503")]


async def test_the_direct_floor_spreads_over_every_pod_as_a_router_would() -> None:
    """Round robin over two pods, from the sequential client and the load generator."""
    pods = [Server(), Server()]
    listeners = [await asyncio.start_server(pod.handle, "127.0.0.1", 0) for pod in pods]
    async with listeners[0], listeners[1]:
        target = RoundRobin("direct", [
            HTTPTarget("direct", f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}")
            for listener in listeners])
        results, _ = await run_sequential(target, _specs(6), time_limit=30.0)
        assert [r.ok for r in results] == [True] * 6
        assert [len(pod.bodies) for pod in pods] == [3, 3]
        assert [pod.connections for pod in pods] == [1, 1]  # one kept-alive each
        closed = await run_closed(target, [[spec] for spec in _specs(8)], 4,
                                  LoadLimits(time_limit=30.0))
        assert [r.ok for r in closed.results] == [True] * 8
    assert [len(pod.bodies) for pod in pods] == [7, 7]
