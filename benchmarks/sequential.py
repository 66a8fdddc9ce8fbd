"""Concurrency 1 with a client that adds nothing between requests.

The overhead phase's latency runs use the asyncio load generator (aiohttp) at concurrency
4: its own event loop and parser sit on the path of every answer, routed or direct. The
latency a router adds at concurrency 1 is clearest from a sequential client instead: one
keep-alive connection per host, blocking sockets (`http.client`, `TCP_NODELAY`), one
request after another, run in a thread so that the bench's event loop is not held. The
PD floor does what `targets.DirectPDTarget` does: prefill with a KV-handle request, then
decode with the handle. Only the end-to-end time is measured (the answer read whole).
"""

from __future__ import annotations

import asyncio
import http.client
import socket
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import orjson

from benchmarks.loadgen import frozen_heap
from benchmarks.specs import RequestResult, RequestSpec
from benchmarks.targets import (
    PREFILL_KV_PARAMS,
    DirectPDTarget,
    HTTPTarget,
    RoundRobin,
    Target,
)

#: Seconds one request may take before the run gives up on it.
REQUEST_TIMEOUT_S = 30.0


def blocking_connection(base_url: str, timeout: float) -> http.client.HTTPConnection:
    """A connected `http.client` connection to `base_url` with `TCP_NODELAY` set."""
    parts = urlsplit(base_url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port,
                                      timeout=timeout)
    conn.connect()
    assert conn.sock is not None
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


class _Hosts:
    """One open keep-alive connection per base URL."""

    def __init__(self) -> None:
        self._open: dict[str, http.client.HTTPConnection] = {}

    def post(self, base_url: str, path: str, body: bytes,
             headers: dict[str, str]) -> tuple[int, bytes]:
        conn = self._open.get(base_url)
        if conn is None:
            conn = self._open[base_url] = blocking_connection(base_url, REQUEST_TIMEOUT_S)
        conn.request("POST", path, body, headers)
        response = conn.getresponse()
        return response.status, response.read()

    def close(self) -> None:
        for conn in self._open.values():
            conn.close()


def _headers(spec: RequestSpec) -> dict[str, str]:
    return {"content-type": "application/json", **dict(spec.headers or ())}


def _one(target: Target, hosts: _Hosts, spec: RequestSpec, offset: float) -> RequestResult:
    result = RequestResult(spec.session, spec.turn, offset)
    if isinstance(target, RoundRobin):
        target = target.pick()
    began = time.perf_counter()
    try:
        if isinstance(target, DirectPDTarget):
            body: dict[str, Any] = orjson.loads(spec.body)
            prefill = {k: v for k, v in body.items()
                       if k not in ("stream_options", "max_completion_tokens")}
            prefill.update(stream=False, max_tokens=1, kv_transfer_params=PREFILL_KV_PARAMS)
            status, raw = hosts.post(target.prefill_url, spec.path, orjson.dumps(prefill),
                                     _headers(spec))
            if status == 200:
                body["kv_transfer_params"] = orjson.loads(raw).get("kv_transfer_params")
                status, raw = hosts.post(target.decode_url, spec.path, orjson.dumps(body),
                                         _headers(spec))
        elif isinstance(target, HTTPTarget):
            status, raw = hosts.post(target.base_url, spec.path, spec.body, _headers(spec))
        else:
            raise TypeError(f"no sequential client for {type(target).__name__}")
    except (OSError, http.client.HTTPException) as exc:
        result.error = type(exc).__name__
        result.e2e = time.perf_counter() - began
        return result
    result.e2e = time.perf_counter() - began
    result.status = status
    if status != 200:
        result.error = f"http_{status}"
    elif spec.stream and b"[DONE]" not in raw:
        result.error = "truncated"
    return result


def _run(target: Target, specs: Sequence[RequestSpec], time_limit: float) -> list[RequestResult]:
    hosts = _Hosts()
    began = time.perf_counter()
    out: list[RequestResult] = []
    try:
        for spec in specs:
            now = time.perf_counter()
            if now - began >= time_limit:
                break
            out.append(_one(target, hosts, spec, now - began))
    finally:
        hosts.close()
    return out


async def run_sequential(
    target: Target, specs: Sequence[RequestSpec], time_limit: float
) -> tuple[list[RequestResult], float]:
    """`specs` one after another (the module docstring); (results, wall seconds)."""
    began = time.perf_counter()
    with frozen_heap():
        results = await asyncio.to_thread(_run, target, specs, time_limit)
    return results, time.perf_counter() - began
