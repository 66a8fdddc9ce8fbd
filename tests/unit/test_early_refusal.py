"""The connection layer's refusal from a request's head (`EarlyRefusal`).

A real uvicorn server config with the edge's protocol class on a loopback socket; the
client speaks raw HTTP/1.1, so what is checked is what a client reads on the wire: the
refused request's answer, then the connection still serving the next one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from uvicorn.config import Config
from uvicorn.server import ServerState

from router.errors import APIError, service_unavailable
from router.http import Edge, EdgeConfig


@dataclass
class Shed:
    """Refuses `POST /v1/completions`, counting what it was asked and what it answered."""

    asked: list[bytes] = field(default_factory=list)
    done_with: list[tuple[int, float, bool]] = field(default_factory=list)
    #: One error object for every refusal, as the app's `EarlyShed` returns (None: a new
    #: one each time).
    shared: APIError | None = None

    def check(self, method: bytes, path: bytes, headers: list[tuple[bytes, bytes]]
              ) -> APIError | None:
        self.asked.append(path)
        if method == b"POST" and path == b"/v1/completions":
            return self.shared or service_unavailable("At capacity.", retry_after=1)
        return None

    def done(self, error: APIError, seconds: float, answered: bool) -> None:
        self.done_with.append((error.status, seconds, answered))


@dataclass
class Server:
    port: int
    shed: Shed
    state: ServerState  # its `default_headers` as uvicorn's loop renews them
    seen: list[str]  # the paths the ASGI app was called for
    release: asyncio.Event  # lets `/slow` answer


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    seen: list[str] = []
    release = asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        seen.append(scope["path"])
        while (await receive()).get("more_body"):
            pass
        if scope["path"] == "/slow":
            await release.wait()
        body = json.dumps({"path": scope["path"]}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

    shed = Shed()
    edge = Edge(EdgeConfig(body_timeout_s=0.3), CollectorRegistry(), shed)
    config = Config(app, log_level="warning", **edge.options("api"))
    config.load()
    state = ServerState()
    state.default_headers = [(b"date", b"Fri, 04 Dec 2026 12:00:00 GMT")]  # as uvicorn's loop
    loop = asyncio.get_running_loop()
    listener = await loop.create_server(
        lambda: config.http_protocol_class(config, state, {}), "127.0.0.1", 0)
    yield Server(listener.sockets[0].getsockname()[1], shed, state, seen, release)
    release.set()
    listener.close()
    for conn in list(state.connections):
        conn.transport.close()


def _post(path: str, body: bytes = b"{}", extra: bytes = b"", version: bytes = b"1.1") -> bytes:
    return (b"POST %s HTTP/%s\r\nhost: x\r\ncontent-length: %d\r\n%s\r\n%s"
            % (path.encode(), version, len(body), extra, body))


async def _read_answers(reader: asyncio.StreamReader, count: int) -> list[tuple[bytes, bytes]]:
    """`count` answers as (head, body), each body read by its content-length."""
    answers = []
    for _ in range(count):
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        answers.append((head, await asyncio.wait_for(reader.readexactly(length), 5)))
    return answers


async def test_a_refused_request_is_answered_after_its_body_and_the_connection_serves_on(
    server: Server,
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    body = json.dumps({"prompt": "x" * 5000}).encode()
    request = _post("/v1/completions?x=1", body)
    writer.write(request[:-3000])  # the head and part of the body
    await asyncio.sleep(0.05)
    writer.write(request[-3000:] + _post("/v1/chat/completions"))
    (head, answer), (next_head, next_answer) = await _read_answers(reader, 2)
    assert head.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert b"retry-after: 1\r\n" in head and b"date: " in head
    assert b"content-type: application/json\r\n" in head and b"connection: close" not in head
    error = json.loads(answer)["error"]
    assert error["type"] == "service_unavailable" and error["message"] == "At capacity."
    # The refused body was read as a body, not as a request: the next one is served.
    assert next_head.startswith(b"HTTP/1.1 200") and json.loads(next_answer) == {
        "path": "/v1/chat/completions"}
    assert server.seen == ["/v1/chat/completions"]  # the app never saw the refused one
    assert server.shed.asked == [b"/v1/completions", b"/v1/chat/completions"]
    [(status, seconds, answered)] = server.shed.done_with
    assert status == 503 and answered and 0.0 < seconds < 5.0
    writer.close()


async def test_refusals_of_one_shared_error_carry_the_date_of_their_second(
    server: Server,
) -> None:
    """The listener writes the answer it encoded for the last refusal again only while
    the error and uvicorn's default headers are the same objects: a new second's `date`
    (uvicorn renews the list) or another error is encoded afresh."""
    server.shed.shared = service_unavailable("At capacity.", retry_after=1)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(_post("/v1/completions") * 2)
    first, again = await _read_answers(reader, 2)
    assert first == again and b"date: Fri, 04 Dec 2026 12:00:00 GMT\r\n" in first[0]
    server.state.default_headers = [(b"date", b"Fri, 04 Dec 2026 12:00:01 GMT")]
    writer.write(_post("/v1/completions"))
    [(head, body)] = await _read_answers(reader, 1)
    assert b"date: Fri, 04 Dec 2026 12:00:01 GMT\r\n" in head and body == first[1]
    server.shed.shared = service_unavailable("Draining.", retry_after=2)
    writer.write(_post("/v1/completions"))
    [(head, body)] = await _read_answers(reader, 1)
    assert b"retry-after: 2\r\n" in head and json.loads(body)["error"]["message"] == "Draining."
    assert [status for status, _, _ in server.shed.done_with] == [503] * 4
    writer.close()


@pytest.mark.parametrize("request_bytes", [
    _post("/v1/completions", extra=b"expect: 100-continue\r\n"),
    _post("/v1/completions", extra=b"connection: close\r\n"),
    _post("/v1/completions", version=b"1.0"),
], ids=["expect-100", "connection-close", "http-1.0"])
async def test_a_request_whose_answer_could_not_be_written_at_once_goes_to_the_app(
    server: Server, request_bytes: bytes,
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(request_bytes)
    data = await asyncio.wait_for(reader.readuntil(b'{"path": "/v1/completions"}'), 5)
    assert b"HTTP/1.1 200 OK\r\n" in data  # (after a "100 Continue" for the first)
    assert server.seen == ["/v1/completions"] and server.shed.done_with == []
    writer.close()


async def test_a_pipelined_request_behind_an_unfinished_answer_goes_to_the_app(
    server: Server,
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(_post("/slow") + _post("/v1/completions"))
    await asyncio.sleep(0.1)
    server.release.set()
    answers = await _read_answers(reader, 2)
    assert [json.loads(body)["path"] for _, body in answers] == ["/slow", "/v1/completions"]
    assert server.seen == ["/slow", "/v1/completions"] and server.shed.done_with == []
    writer.close()


async def test_a_refused_request_whose_body_stops_coming_gets_a_408_and_is_closed(
    server: Server,
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(_post("/v1/completions", b"{" * 100)[:-50])  # half the body, then silence
    data = await asyncio.wait_for(reader.read(), 5)
    assert data.startswith(b"HTTP/1.1 408 ")
    assert json.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
    assert server.seen == []
    assert [(status, answered) for status, _, answered in server.shed.done_with] == [
        (503, False)]  # refused, then ended unanswered: counted once
    writer.close()


async def test_a_refused_request_whose_client_leaves_mid_body_is_ended_unanswered(
    server: Server,
) -> None:
    _, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(_post("/v1/completions", b"{" * 100)[:-50])
    for _ in range(100):  # until the head has been read and refused
        await asyncio.sleep(0.01)
        if server.shed.asked:
            break
    writer.close()
    for _ in range(100):
        await asyncio.sleep(0.01)
        if server.shed.done_with:
            break
    assert [(status, answered) for status, _, answered in server.shed.done_with] == [
        (503, False)]
    assert server.seen == []
