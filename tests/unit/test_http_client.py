"""The data path's HTTP/1.1 client (`router.http_client`) against a real loopback server.

The server below speaks just enough HTTP/1.1 to answer per path: a JSON answer with a
Content-Length, a chunked stream, a stream cut off mid-body, `Connection: close`, a
large body, a head that never comes. It counts the connections it accepted, which is
what tells reuse from reconnection.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from kv_connectors.base import UpstreamError
from router.http_client import HIGH_WATER, ConnectFailed, ConnectionBroken, Pool
from router.upstream import Upstream, request_head

BIG = 1024 * 1024


@dataclass
class Server:
    port: int = 0
    accepted: int = 0
    requests: list[tuple[str, bytes]] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                path = lines[0].split(" ")[1]
                length = next(int(line.split(":")[1]) for line in lines
                              if line.lower().startswith("content-length:"))
                body = await reader.readexactly(length)
                self.requests.append((path, body))
                if path == "/hang-up":  # read the request, answer nothing, close
                    return
                if path == "/hang":  # answer nothing; return once the client hangs up
                    await reader.read(1)
                    return
                if not await self.answer(path, body, writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed.set()
            writer.close()

    async def answer(self, path: str, body: bytes, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False closes the connection."""
        if path == "/json":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
        elif path == "/stream":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            for i in range(3):
                event = b"data: %d\n\n" % i
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
                await asyncio.sleep(0.01)
            writer.write(b"0\r\n\r\n")
        elif path == "/burst":  # three events in one write, after the head
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(b"".join(b"%x\r\n%s\r\n" % (len(e), e)
                                  for e in (b"data: %d\n\n" % i for i in range(3))))
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(b"0\r\n\r\n")
        elif path == "/cut":
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"6\r\ndata: \r\n")
            await writer.drain()
            return False
        elif path == "/close":
            writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
            return False
        elif path == "/big":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % BIG)
            writer.write(b"x" * BIG)
        elif path == "/idle-close":  # kept alive, then closed while idle (an engine's timeout)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
            await asyncio.sleep(0.02)
            return False
        elif path == "/error":
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\n\r\nbusy")
        elif path == "/no-rank":  # vLLM refusing a data-parallel rank it does not run
            refusal = (b'{"error":{"message":"data_parallel_rank 3 is out of range [0, 2).",'
                       b'"type":"BadRequestError","param":null,"code":400}}')
            writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(refusal), refusal))
        await writer.drain()
        return True


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    state = Server()
    listener = await asyncio.start_server(state.handle, "127.0.0.1", 0)
    state.port = listener.sockets[0].getsockname()[1]
    async with listener:
        yield state


@dataclass(frozen=True)
class _Pod:
    ip: str
    port: int
    dp_rank: int | None = None
    rank_pin: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.ip}:{self.port}"


def _pool(**bounds: float) -> Pool:
    return Pool(int(bounds.get("limit", 16)), int(bounds.get("per_host", 16)),
                bounds.get("keepalive", 4.0), bounds.get("connect", 2.0))


async def _post(pool: Pool, server: Server, path: str, body: bytes = b"{}"):  # type: ignore[no-untyped-def]
    head = request_head(_Pod("127.0.0.1", server.port), path,
                        {"content-type": "application/json"}, len(body))
    return await pool.request("http", "127.0.0.1", server.port, head, body)


async def _read_json(pool: Pool, server: Server) -> None:
    """One `/json` request read to its end, its connection given back to the pool."""
    response = await _post(pool, server, "/json")
    await response.read(1024)
    response.release()


async def test_answers_are_read_and_connections_reused(server: Server) -> None:
    pool = _pool()
    for n in range(3):
        response = await _post(pool, server, "/json", b'{"n": %d}' % n)
        assert response.status == 200
        assert response.headers["content-type"] == "application/json"
        assert await response.read(1024) == b'{"n": %d}' % n
        response.release()
    assert server.accepted == 1  # one keep-alive connection served all three
    assert [body for _, body in server.requests] == [b'{"n": 0}', b'{"n": 1}', b'{"n": 2}']
    await pool.close()


async def test_a_stream_arrives_as_it_is_sent(server: Server) -> None:
    pool = _pool()
    response = await _post(pool, server, "/stream")
    parts = []
    while chunk := await response.readany():
        parts.append(chunk)
    response.release()
    assert b"".join(parts) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert len(parts) >= 2  # delivered piece by piece, not at the end
    response = await _post(pool, server, "/json")  # the stream's connection is reused
    assert await response.read(1024) == b"{}"
    response.release()
    assert server.accepted == 1
    await pool.close()


async def test_a_stream_cut_off_raises_and_is_not_reused(server: Server) -> None:
    pool = _pool()
    response = await _post(pool, server, "/cut")
    assert await response.readany() == b"data: "
    with pytest.raises(ConnectionBroken):
        await response.readany()
    response.release()
    response = await _post(pool, server, "/json")
    assert await response.read(1024) == b"{}"
    response.release()
    assert server.accepted == 2
    await pool.close()


async def test_a_response_left_unread_closes_its_connection(server: Server) -> None:
    pool = _pool()
    response = await _post(pool, server, "/stream")
    await response.readany()
    response.release()  # mid-body: the rest of the stream would poison the next request
    await asyncio.wait_for(server.closed.wait(), 5)
    response = await _post(pool, server, "/json")
    assert await response.read(1024) == b"{}"
    response.release()
    assert server.accepted == 2
    await pool.close()


async def test_connection_close_is_honoured(server: Server) -> None:
    pool = _pool()
    response = await _post(pool, server, "/close")
    assert await response.read(1024) == b"ok"
    response.release()
    response = await _post(pool, server, "/json")
    assert await response.read(1024) == b"{}"
    response.release()
    assert server.accepted == 2
    await pool.close()


async def test_error_statuses_come_back_with_their_body(server: Server) -> None:
    pool = _pool()
    response = await _post(pool, server, "/error")
    assert response.status == 503
    assert await response.read(1024) == b"busy"
    response.release()
    await pool.close()


async def test_idle_connections_expire_before_the_engine_closes_them(server: Server) -> None:
    pool = _pool(keepalive=0.05)
    await _read_json(pool, server)
    await asyncio.sleep(0.1)
    await _read_json(pool, server)
    assert server.accepted == 2
    await pool.close()


async def test_a_pod_never_asked_again_has_its_idle_connections_closed(server: Server) -> None:
    """A pod that left the view keeps no socket open: the next request done anywhere
    after the keep-alive closes its expired idle connection."""
    other = Server()
    listener = await asyncio.start_server(other.handle, "127.0.0.1", 0)
    other.port = listener.sockets[0].getsockname()[1]
    async with listener:
        pool = _pool(keepalive=0.05)
        await _read_json(pool, server)  # then the pod is never asked again
        await asyncio.sleep(0.1)
        await _read_json(pool, other)
        async with asyncio.timeout(5):
            await server.closed.wait()  # the first pod saw its connection closed
        assert list(pool._idle) == [("127.0.0.1", other.port)]
        await pool.close()


async def test_refused_connection_raises_connect_failed() -> None:
    listener = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    listener.close()
    await listener.wait_closed()
    pool = _pool()
    with pytest.raises(ConnectFailed):
        await pool.request("http", "127.0.0.1", port, b"POST / HTTP/1.1\r\n\r\n", b"")
    await pool.close()


async def test_a_large_body_is_read_under_back_pressure(server: Server) -> None:
    pool = _pool()
    response = await _post(pool, server, "/big")
    await asyncio.sleep(0.2)  # the body arrives while nobody reads it
    buffered = response._size  # what the client holds unread
    assert buffered <= HIGH_WATER + 256 * 1024  # reading stopped near the bound
    assert buffered < BIG
    assert await response.read(2 * BIG) == b"x" * BIG
    response.release()
    with pytest.raises(ConnectionBroken):  # and `read` keeps its own bound
        response = await _post(pool, server, "/big")
        try:
            await response.read(1000)
        finally:
            response.release()
    await pool.close()


async def test_per_pod_bound_queues_requests_and_survives_cancelled_waiters(
    server: Server,
) -> None:
    pool = _pool(per_host=1)
    first = await _post(pool, server, "/json")
    second = asyncio.ensure_future(_post(pool, server, "/json", b"[2]"))
    third = asyncio.ensure_future(_post(pool, server, "/json", b"[3]"))
    await asyncio.sleep(0.05)
    assert not second.done() and not third.done()  # both wait for the one connection
    second.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await second
    await first.read(1024)
    first.release()  # the cancelled waiter must not swallow this turn
    response = await asyncio.wait_for(third, 5)
    assert await response.read(1024) == b"[3]"
    response.release()
    assert server.accepted == 1
    await pool.close()


async def test_a_pod_at_its_bound_holds_up_only_its_own_requests(server: Server) -> None:
    other = Server()
    listener = await asyncio.start_server(other.handle, "127.0.0.1", 0)
    other.port = listener.sockets[0].getsockname()[1]
    async with listener:
        pool = _pool(per_host=1)
        held_a = await _post(pool, server, "/json")
        held_b = await _post(pool, other, "/json")
        waits_a = asyncio.ensure_future(_post(pool, server, "/json", b"[a]"))
        await asyncio.sleep(0.05)
        waits_b = asyncio.ensure_future(_post(pool, other, "/json", b"[b]"))  # behind a
        await asyncio.sleep(0.05)
        await held_b.read(1024)
        held_b.release()  # B has room again; A is still at its bound
        response = await asyncio.wait_for(waits_b, 5)
        assert await response.read(1024) == b"[b]"
        response.release()
        assert not waits_a.done()
        await held_a.read(1024)
        held_a.release()
        response = await asyncio.wait_for(waits_a, 5)
        assert await response.read(1024) == b"[a]"
        response.release()
        await pool.close()


async def test_cancelled_waiters_and_closed_pods_leave_nothing_behind(server: Server) -> None:
    pool = _pool(per_host=1)
    held = await _post(pool, server, "/json")
    waiting = [asyncio.ensure_future(_post(pool, server, "/json")) for _ in range(50)]
    await asyncio.sleep(0.05)
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert not pool._waiting  # no line kept for requests that left it
    await held.read(1024)
    held.release()
    closing = await _post(pool, server, "/idle-close")
    await closing.read(1024)
    closing.release()
    assert pool._idle  # kept alive for the next request...
    await asyncio.sleep(0.1)
    assert not pool._idle  # ...until the pod closed it: nothing kept for that pod
    await pool.close()


async def test_a_waiter_cancelled_as_another_pod_frees_a_slot_ends_cancelled(
    server: Server,
) -> None:
    """A waiter cancelled, then in the same loop turn another pod's release looks down the
    lines and drops the cancelled entry from its head while its pod stays at the bound:
    the cancelled request ends with CancelledError (it raised ValueError, its entry gone)."""
    other = Server()
    listener = await asyncio.start_server(other.handle, "127.0.0.1", 0)
    other.port = listener.sockets[0].getsockname()[1]
    async with listener:
        pool = _pool(per_host=1)
        held = await _post(pool, server, "/json")
        held_other = await _post(pool, other, "/json")
        await held_other.read(1024)
        first = asyncio.ensure_future(_post(pool, server, "/json"))
        second = asyncio.ensure_future(_post(pool, server, "/json"))
        await asyncio.sleep(0.05)
        first.cancel()
        held_other.release()  # wakes nobody: `server` is still at its bound
        with pytest.raises(asyncio.CancelledError):
            await first
        assert not second.done()
        await held.read(1024)
        held.release()
        response = await asyncio.wait_for(second, 5)  # the line still works
        await response.read(1024)
        response.release()
        await pool.close()


async def test_cancelling_a_request_closes_its_connection(server: Server) -> None:
    pool = _pool()
    task = asyncio.ensure_future(_post(pool, server, "/hang"))
    await asyncio.sleep(0.05)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await asyncio.wait_for(server.closed.wait(), 5)  # the engine sees the request go away
    await pool.close()


def test_header_values_with_line_breaks_are_refused() -> None:
    pod = _Pod("127.0.0.1", 8000)
    head = request_head(pod, "/v1/completions", {"x-request-id": "abc"}, 2)
    assert head == (b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:8000\r\n"
                    b"content-length: 2\r\nx-request-id: abc\r\n\r\n")
    with pytest.raises(ValueError):
        request_head(pod, "/v1/completions", {"x-request-id": "a\r\nx-evil: 1"}, 2)
    assert b"host: [::1]:8000" in request_head(_Pod("::1", 8000), "/", {}, 0)


def test_a_data_parallel_rank_is_pinned_over_the_clients() -> None:
    """A target that is one rank of a pod sends vLLM's rank header with its own rank,
    whatever rank the client asked for; other targets pass the client's on."""
    client = {"x-request-id": "abc", "X-Data-Parallel-Rank": "3"}

    def ranks(head: bytes) -> list[bytes]:
        lines = head.split(b"\r\n")
        return [line for line in lines if line.lower().startswith(b"x-data-parallel-rank:")]

    pinned = request_head(_Pod("127.0.0.1", 8000, 1, "1"), "/v1/completions", client, 2)
    assert ranks(pinned) == [b"x-data-parallel-rank: 1"]
    assert b"x-request-id: abc\r\n" in pinned
    # A rank with an API server of its own (external load balancing) runs no other rank.
    own_server = request_head(_Pod("127.0.0.1", 8001, 1), "/v1/completions", client, 2)
    assert ranks(own_server) == []
    plain = request_head(_Pod("127.0.0.1", 8000), "/v1/completions", client, 2)
    assert ranks(plain) == [b"X-Data-Parallel-Rank: 3"]


async def test_a_rank_the_engine_does_not_run_is_not_the_clients_fault(server: Server) -> None:
    """The router pinned a rank the pod lacks (its annotation says more ranks than it runs):
    vLLM's 400 is the pod's failure, retried elsewhere; unpinned, a 400 stays the client's."""
    upstream = Upstream()
    deadline = asyncio.get_running_loop().time() + 5.0
    try:
        with pytest.raises(UpstreamError) as pinned:
            await upstream.open(_Pod("127.0.0.1", server.port, 3, "3"), "/no-rank", b"{}", {},
                                deadline, "decode")
        assert (pinned.value.reason, pinned.value.retryable) == ("bad_rank", True)
        with pytest.raises(UpstreamError) as plain:
            await upstream.open(_Pod("127.0.0.1", server.port), "/no-rank", b"{}", {},
                                deadline, "decode")
        assert (plain.value.status, plain.value.retryable) == (400, False)
    finally:
        await upstream.close()


async def test_push_mode_hands_chunks_to_the_sink_as_they_arrive(server: Server) -> None:
    pool = _pool()
    response = await _post(pool, server, "/stream")
    received: list[bytes] = []
    response.stream_to(received.append)
    assert await response.wait() is False  # the body ended
    response.stream_to(None)
    assert b"".join(received) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert len(received) >= 2
    response.release()
    await pool.close()


async def test_push_mode_hands_over_the_chunks_of_one_read_at_once(server: Server) -> None:
    """Three HTTP chunks that arrive in one read reach the sink in one call (the relay
    writes them to the client in one write), and nothing is lost or reordered."""
    pool = _pool()
    response = await _post(pool, server, "/burst")
    received: list[bytes] = []
    response.stream_to(received.append)
    assert await response.wait() is False
    response.stream_to(None)
    assert received == [b"data: 0\n\ndata: 1\n\ndata: 2\n\n"]
    response.release()
    await pool.close()


async def test_push_mode_holds_reading_while_the_consumer_pushes_back(server: Server) -> None:
    pool = _pool()
    response = await _post(pool, server, "/big")
    received: list[bytes] = []

    def sink(data: bytes) -> None:
        received.append(data)
        response.hold()  # as the relay does when the client's socket is full

    response.stream_to(sink)
    assert await response.wait() is True  # woken by the hold
    await asyncio.sleep(0.2)
    held = sum(map(len, received))
    assert held < BIG  # reading stopped: nothing more came while held
    response.stream_to(received.append)
    response.unhold()
    assert await response.wait() is False
    assert sum(map(len, received)) == BIG
    response.release()
    await pool.close()


async def test_a_connection_held_on_its_last_read_reads_again_when_kept(
    server: Server,
) -> None:
    """The consumer pushes back on the read that also ends the body (the client's socket
    is full as the stream ends): the connection is complete and kept alive, and the next
    request on it is answered (it went back to the pool with reading paused, and its
    next request waited for an answer it never read)."""
    pool = _pool(per_host=1)
    response = await _post(pool, server, "/json", b"[0]")
    response.stream_to(lambda _: response.hold())
    await response.wait()
    response.release()
    assert server.accepted == 1 and pool._idle  # kept for the next request
    again = await asyncio.wait_for(_post(pool, server, "/json", b"[1]"), 2)
    assert await asyncio.wait_for(again.read(1024), 2) == b"[1]"
    again.release()
    assert server.accepted == 1  # the same connection
    await pool.close()


async def test_push_mode_raises_when_the_stream_breaks(server: Server) -> None:
    pool = _pool()
    response = await _post(pool, server, "/cut")
    received: list[bytes] = []
    response.stream_to(received.append)
    with pytest.raises(ConnectionBroken):
        await response.wait()
    assert b"".join(received) == b"data: "
    response.release()
    await pool.close()


async def test_an_engine_that_hangs_up_is_told_apart_from_one_never_reached(
    server: Server,
) -> None:
    upstream = Upstream()
    deadline = asyncio.get_running_loop().time() + 5.0
    try:
        with pytest.raises(UpstreamError) as dropped:  # the request went out, no answer came
            await upstream.open(_Pod("127.0.0.1", server.port), "/hang-up", b"{}", {},
                                deadline, "decode")
        assert dropped.value.reason == "disconnect" and dropped.value.retryable
        assert "closed the connection" in dropped.value.message
        with socket.socket() as unused:  # a port nobody listens on
            unused.bind(("127.0.0.1", 0))
            port = unused.getsockname()[1]
        with pytest.raises(UpstreamError) as refused:
            await upstream.open(_Pod("127.0.0.1", port), "/json", b"{}", {}, deadline, "decode")
        assert refused.value.reason == "connect" and "Could not reach" in refused.value.message
    finally:
        await upstream.close()
