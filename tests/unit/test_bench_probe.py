"""`benchmarks.probe`: the streaming phase's probe client, one stream at a time from a
process of its own, against loopback servers whose timing the test sets."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest

from benchmarks.probe import probe_urls, run, running_probe
from benchmarks.specs import RequestSpec
from benchmarks.targets import DirectPDTarget, HTTPTarget, RoundRobin
from tests.local_http import read_request

FIRST_CONTENT_DELAY_S = 0.03
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                   "max_tokens": 3, "stream": True}).encode()


def _event(obj: object) -> bytes:
    data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
    return b"%x\r\n%b\r\n" % (len(data), data)


class Server:
    """A loopback HTTP/1.1 server: a role chunk at once, three content chunks from
    `FIRST_CONTENT_DELAY_S` on, then `[DONE]` (or nothing more, if `truncate`); or a 503."""

    def __init__(self, status: int = 200, truncate: bool = False) -> None:
        self.status, self.truncate = status, truncate
        self.requests = 0
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        while await read_request(reader) is not None:
            self.requests += 1
            if self.status != 200:
                raw = b'{"error":{"message":"busy","type":"overloaded","code":503}}'
                writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: "
                             b"application/json\r\ncontent-length: %d\r\n\r\n%b" % (len(raw), raw))
                continue
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            writer.write(_event({"choices": [{"delta": {"role": "assistant"}}]}))
            await writer.drain()
            await asyncio.sleep(FIRST_CONTENT_DELAY_S)
            for word in ("a", "b", "c"):
                writer.write(_event({"choices": [{"delta": {"content": word}}]}))
                await writer.drain()
                await asyncio.sleep(0.002)
            if self.truncate:
                writer.close()
                return
            writer.write(_event(b"[DONE]") + b"0\r\n\r\n")
            await writer.drain()
        writer.close()


async def test_the_probe_process_streams_one_at_a_time_round_robin() -> None:
    good, busy = Server(), Server(status=503)
    first = await asyncio.start_server(good.handle, "127.0.0.1", 0)
    second = await asyncio.start_server(busy.handle, "127.0.0.1", 0)
    async with first, second:
        urls = [f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in (first, second)]
        target = RoundRobin("direct", [HTTPTarget("a", urls[0]), HTTPTarget("b", urls[1])])
        async with running_probe(target, RequestSpec(0, 0, BODY), seconds=0.5) as probe:
            assert probe.results == []  # filled in when the block ends
        results = probe.results
    assert len(results) >= 4
    ok, refused = results[0::2], results[1::2]
    assert all(r.ok and r.status == 200 and r.chunks == 3 for r in ok)
    assert all(r.ttft is not None and FIRST_CONTENT_DELAY_S <= r.ttft < r.e2e for r in ok)
    assert all(len(r.itl) == 2 for r in ok)
    assert all(r.error == "http_503" and r.ttft is None for r in refused)
    # one stream at a time: each starts after the one before it ended
    assert all(b.start >= a.start + a.e2e for a, b in itertools.pairwise(results))
    assert good.connections == busy.connections == 1  # kept alive
    assert good.requests + busy.requests == len(results)


async def test_a_stream_cut_before_done_is_truncated() -> None:
    server = Server(truncate=True)
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    async with listener:
        url = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
        results = await asyncio.to_thread(run, [url], "/v1/chat/completions", BODY, 0.1)
    assert results and all(r.error == "truncated" and r.chunks == 3 for r in results)
    assert server.connections == len(results)  # the cut connection is opened again


def test_only_http_targets_are_probed() -> None:
    assert probe_urls(HTTPTarget("r", "http://127.0.0.1:1/")) == ["http://127.0.0.1:1"]
    with pytest.raises(TypeError):
        probe_urls(DirectPDTarget("d", "http://127.0.0.1:1", "http://127.0.0.1:2"))
