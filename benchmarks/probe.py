"""A probe client: one short stream at a time, from a process of its own.

Why a second client: the streaming phase's load generator is one Python process that reads
every stream (63 of 64, 255 of 256), so the TTFT it records includes the time its own event
loop takes to reach a stream's first chunk among all the others', and that time depends on
how the router's writes arrive (spread out or in bursts), not only on when they leave. At
64 streams the generator measured pdgate at 11.55 ms TTFT p50 against vLLM Router's 10.99
while a client of its own, in the same windows, saw 8.39 against 8.38 (HISTORY.md,
"Streaming TTFT at 64 streams"). The probe is that client: beside the generator's streams,
it sends a short stream, reads it to its end, and only then sends the next, on blocking
sockets with `TCP_NODELAY` (`http.client`), so nothing of its own runs between the socket
and its clock. Its TTFT is what one more user sees of a router that is relaying the others.

Run as `python -m benchmarks.probe --url URL [--url URL2 ...] --seconds S` with the request
body on stdin: it connects, writes `ready` on a line, sends streams (round robin over the
URLs, one keep-alive connection each) until S seconds have passed, and writes its results
as one JSON list. `running_probe` does that from the bench's event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from benchmarks.sequential import blocking_connection
from benchmarks.specs import RequestResult, RequestSpec
from benchmarks.sse import ChunkKind, SSEError, SSEParser, classify
from benchmarks.targets import HTTPTarget, RoundRobin, Target

#: Seconds one probe stream may take (connect, first byte, or between reads) before it is
#: given up as `timeout`.
REQUEST_TIMEOUT_S = 30.0
#: Seconds the probe process may take to start and connect before the bench gives up on it.
START_TIMEOUT_S = 30.0
_READ_BYTES = 65536
_PAUSE_AFTER_ERROR_S = 0.01
_REPO = Path(__file__).resolve().parents[1]


def probe_urls(target: Target) -> list[str]:
    """The base URLs a probe of `target` sends to (the direct floor: every pod in turn)."""
    if isinstance(target, HTTPTarget):
        return [target.base_url]
    if isinstance(target, RoundRobin) and all(isinstance(t, HTTPTarget) for t in target.targets):
        return [t.base_url for t in target.targets if isinstance(t, HTTPTarget)]
    raise TypeError(f"no probe for {type(target).__name__} (HTTP targets only)")


def _connect(base_url: str) -> http.client.HTTPConnection:
    return blocking_connection(base_url, REQUEST_TIMEOUT_S)


def _stream(conn: http.client.HTTPConnection, path: str, body: bytes,
            result: RequestResult) -> None:
    """Send one streaming request and read it to its end into `result`."""
    began = time.perf_counter()
    conn.request("POST", path, body, {"content-type": "application/json"})
    response = conn.getresponse()
    result.status = response.status
    if response.status != 200:
        response.read()
        result.error = f"http_{response.status}"
        result.e2e = time.perf_counter() - began
        return
    parser, last, done = SSEParser(), 0.0, False
    while data := response.read1(_READ_BYTES):
        now = time.perf_counter()
        for payload in parser.feed(data):
            kind, _ = classify(payload)
            if kind is ChunkKind.CONTENT:
                if result.ttft is None:
                    result.ttft = now - began
                else:
                    result.itl.append(now - last)
                result.chunks += 1
                last = now
            elif kind is ChunkKind.DONE:
                done = True
            elif kind is ChunkKind.ERROR:
                result.error = "stream_error"
    result.e2e = time.perf_counter() - began
    if result.error is None and not done:
        result.error = "truncated"


def run(urls: Sequence[str], path: str, body: bytes, seconds: float,
        on_ready: Callable[[], None] | None = None) -> list[RequestResult]:
    """Streams one after another, round robin over `urls`, until `seconds` have passed
    (`on_ready` is called once every URL is connected, before the clock starts). A failed
    stream is recorded with its error and its connection opened again for the next."""
    conns: dict[str, http.client.HTTPConnection] = {url: _connect(url) for url in urls}
    if on_ready is not None:
        on_ready()
    out: list[RequestResult] = []
    began = time.perf_counter()
    try:
        while (now := time.perf_counter()) - began < seconds:
            url = urls[len(out) % len(urls)]
            result = RequestResult(session=len(out), turn=0, start=now - began)
            try:
                conn = conns.get(url) or _connect(url)
                conns[url] = conn
                _stream(conn, path, body, result)
            except (OSError, http.client.HTTPException, SSEError) as exc:
                result.error = _error_name(exc)
                result.e2e = time.perf_counter() - now
                stale = conns.pop(url, None)
                if stale is not None:
                    stale.close()
                time.sleep(_PAUSE_AFTER_ERROR_S)  # a refused connect must not spin
            out.append(result)
    finally:
        for conn in conns.values():
            conn.close()
    return out


def _error_name(exc: Exception) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, http.client.IncompleteRead):  # the chunked body cut short
        return "truncated"
    return type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probe", description=__doc__)
    parser.add_argument("--url", action="append", required=True, help="a base URL (repeatable)")
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--path", default="/v1/chat/completions")
    args = parser.parse_args(argv)
    body = sys.stdin.buffer.read()

    def ready() -> None:
        sys.stdout.write("ready\n")
        sys.stdout.flush()

    results = run(args.url, args.path, body, args.seconds, ready)
    sys.stdout.write(orjson.dumps([r.to_json() for r in results]).decode() + "\n")
    return 0


@dataclass(slots=True)
class Probe:
    """A probe process's results, filled in when its `running_probe` block ends."""

    results: list[RequestResult] = field(default_factory=list)


@contextlib.asynccontextmanager
async def running_probe(target: Target, spec: RequestSpec, seconds: float) -> AsyncIterator[Probe]:
    """A probe process streaming `spec` to `target` for `seconds` while the block runs.

    The block is entered once the probe has connected (so the load it measures beside can
    start at its clock's zero); on leaving, the probe's results are read (it ends by itself
    `seconds` after it started, plus its last stream).
    """
    args = [arg for url in probe_urls(target) for arg in ("--url", url)]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.probe", *args, "--seconds", f"{seconds:g}",
        "--path", spec.path, cwd=_REPO,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    probe = Probe()
    try:
        proc.stdin.write(spec.body)
        proc.stdin.close()
        line = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)
        if line != b"ready\n":
            raise RuntimeError(f"the probe did not start (exit {await proc.wait()})")
        yield probe
        raw = await asyncio.wait_for(proc.stdout.read(), seconds + REQUEST_TIMEOUT_S * 2)
        if await proc.wait() != 0:
            raise RuntimeError(f"the probe failed (exit {proc.returncode})")
        probe.results = [RequestResult.from_json(r) for r in orjson.loads(raw)]
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


if __name__ == "__main__":
    raise SystemExit(main())
