"""The one place the router talks HTTP to engines.

Requests on the data path (`open`, `post_json`: decode, prefill) go through our own lean
HTTP/1.1 client (`router.http_client`: a keep-alive pool on asyncio + httptools), which
costs a fraction of aiohttp's client CPU per request and per streamed chunk. The rare
control calls (health probes, a bootstrap server's `/query`) keep an aiohttp session.
Every failure becomes an `UpstreamError` whose message is safe for a client: no
address, no upstream body.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson

from kv_connectors.base import PodAddress, UpstreamError
from router.errors import upstream_fields
from router.http_client import ConnectFailed, ConnectionBroken, Pool, Response

log = logging.getLogger("pdgate.upstream")

MAX_CONNECTIONS = 1024
MAX_CONNECTIONS_PER_POD = 256
# vLLM closes idle keep-alive connections after 5 s; close ours first.
KEEPALIVE_SECONDS = 4.0
CONNECT_TIMEOUT_SECONDS = 5.0
MAX_ERROR_BODY_BYTES = 64 * 1024
MAX_JSON_BODY_BYTES = 64 * 1024 * 1024
#: vLLM's header naming the data-parallel rank (engine) a request is for.
DP_RANK_HEADER = "x-data-parallel-rank"


class Upstream:
    """The data path's connection pool and a control-path aiohttp session, both with
    named bounds, plus the calls the proxy and connectors make."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._pool: Pool | None = None

    @property
    def pool(self) -> Pool:
        if self._pool is None:
            self._pool = Pool(MAX_CONNECTIONS, MAX_CONNECTIONS_PER_POD, KEEPALIVE_SECONDS,
                              CONNECT_TIMEOUT_SECONDS)
        return self._pool

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=MAX_CONNECTIONS,
                limit_per_host=MAX_CONNECTIONS_PER_POD,
                keepalive_timeout=KEEPALIVE_SECONDS,
                ttl_dns_cache=None,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                # total=None: our own deadline bounds each request; aiohttp's default
                # total of 300 s would cut long streams.
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_SECONDS),
                skip_auto_headers=("User-Agent",),
                # Engines set no cookies; a real jar filters cookies on every request.
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._session

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def open(
        self,
        pod: PodAddress,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        deadline: float,
        phase: str,
    ) -> Response:
        """POST and return the response once its status is 2xx (the caller releases it).

        Non-2xx answers are read (bounded), released and raised as `UpstreamError`.
        The caller's deadline (`asyncio.timeout_at` around the whole request) bounds it;
        connecting is bounded by `CONNECT_TIMEOUT_SECONDS`.
        """
        _remaining(deadline, phase, pod)  # fail fast once the deadline has passed
        scheme = "https" if pod.base_url.startswith("https:") else "http"
        try:
            response = await self.pool.request(
                scheme, pod.ip, pod.port, request_head(pod, path, headers, len(body)), body
            )
        except ConnectionBroken as exc:
            raise _connect_error(exc, pod, phase) from None
        if response.status >= 300:
            try:
                raw = await response.read(MAX_ERROR_BODY_BYTES)
            except ConnectionBroken:
                raw = b""
            finally:
                response.release()
            if response.status == 400 and pod.rank_pin is not None and _no_such_rank(raw):
                raise _rank_error(pod, phase)
            raise status_error(response.status, raw, pod, phase)
        return response

    async def post_json(
        self,
        pod: PodAddress,
        path: str,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        deadline: float,
    ) -> dict[str, Any]:
        """One JSON request answered by a JSON object (the prefill call).

        The caller's deadline (`asyncio.timeout_at` around the whole request) bounds it.
        """
        response = await self.open(pod, path, orjson.dumps(body), headers, deadline, "prefill")
        try:
            raw = await response.read(MAX_JSON_BODY_BYTES)
        except ConnectionBroken as exc:
            raise _connect_error(exc, pod, "prefill") from None
        finally:
            response.release()
        return _json_object(raw, pod, "prefill")

    async def probe(self, url: str, timeout_s: float) -> bool:
        """GET `url` (a pod's health endpoint); True on a 2xx answer within `timeout_s`."""
        try:
            async with self.session.get(
                url, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as response:
                return 200 <= response.status < 300
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def get_json(self, url: str, headers: Mapping[str, str], deadline: float) -> Any:
        """A small GET answered by JSON (e.g. a prefill engine's bootstrap `/query`)."""
        timeout = _remaining(deadline, "prefill", None)
        try:
            async with self.session.get(
                url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as response:
                raw = await response.content.read(MAX_ERROR_BODY_BYTES)
                if response.status >= 300:
                    raise status_error(response.status, raw, None, "prefill")
        except TimeoutError:
            raise UpstreamError(
                "timeout", "The engine did not answer in time.", retryable=True, phase="prefill"
            ) from None
        except aiohttp.ClientError as exc:
            raise _connect_error(exc, None, "prefill") from None
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise UpstreamError(
                "bad_response", "The engine answered with invalid JSON.", retryable=True,
                phase="prefill",
            ) from None


def request_head(pod: PodAddress, path: str, headers: Mapping[str, str], length: int) -> bytes:
    """A POST's head as bytes: request line, host, length, the given headers.

    A value carrying CR or LF would split the head (request smuggling toward the engine):
    such a header is refused with `ValueError` (the proxy only forwards values llhttp
    parsed from one header line, so none should). A target that is one data-parallel
    rank of its pod gets the router's `x-data-parallel-rank` (`rank_pin`; none where the
    rank has an API server of its own, which has no other rank), never one given.
    """
    host = f"[{pod.ip}]:{pod.port}" if ":" in pod.ip else f"{pod.ip}:{pod.port}"
    lines = [f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-length: {length}\r\n"]
    ranked = pod.dp_rank is not None
    if pod.rank_pin is not None:
        lines.append(f"{DP_RANK_HEADER}: {pod.rank_pin}\r\n")
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} carries a line break")
        if ranked and name.lower() == DP_RANK_HEADER:
            continue
        lines.append(f"{name}: {value}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")


def _no_such_rank(raw: bytes) -> bool:
    """vLLM's refusal of a rank it does not run: "data_parallel_rank R is out of range
    [0, N)." (its input processor), answered 400."""
    return b"data_parallel_rank" in raw and b"out of range" in raw


def _rank_error(pod: PodAddress, phase: str) -> UpstreamError:
    """The pod runs fewer ranks than its ModelServer says: the router's fault, not the
    client's, so another target is tried and the rank counts as failing."""
    log.warning("engine %s has no data-parallel rank %s: its ModelServer's "
                "pdgate.io/data-parallel-size (or -size-local, with hybrid load balancing) "
                "is larger than the ranks it serves", pod.base_url, pod.rank_pin)
    return UpstreamError("bad_rank", f"The engine has no data-parallel rank {pod.rank_pin}.",
                         retryable=True, pod=pod, phase=phase)


def status_error(status: int, raw: bytes, pod: PodAddress | None, phase: str) -> UpstreamError:
    """Turn an engine's non-2xx answer into an error; 4xx keeps the engine's message.

    A 4xx means the engine refused the client's input, so its message helps the client;
    a 5xx message may carry internals and is replaced by a generic one.
    """
    if 400 <= status < 500 and status not in (408, 429):
        message, param = upstream_fields(raw)
        return UpstreamError(
            f"status_{status}", message or f"The engine refused the request ({status}).",
            retryable=False, status=status, pod=pod, phase=phase, param=param,
        )
    return UpstreamError(
        "status_5xx" if status >= 500 else f"status_{status}",
        f"The engine failed during {phase} ({status}).",
        retryable=True, status=status, pod=pod, phase=phase,
    )


def _json_object(raw: bytes, pod: PodAddress, phase: str) -> dict[str, Any]:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        raise UpstreamError(
            "bad_response", f"The engine sent an invalid {phase} response.", retryable=True,
            pod=pod, phase=phase,
        )
    return data


def _connect_error(exc: Exception, pod: PodAddress | None, phase: str) -> UpstreamError:
    """No connection (`ConnectFailed`, aiohttp's errors), or one the engine closed after
    the request went out and before its answer was whole: either may be retried."""
    if isinstance(exc, ConnectionBroken) and not isinstance(exc, ConnectFailed):
        return UpstreamError(
            "disconnect", f"The engine closed the connection before answering ({phase}).",
            retryable=True, pod=pod, phase=phase,
        )
    return UpstreamError(
        "connect", f"Could not reach the engine for {phase}.", retryable=True, pod=pod,
        phase=phase,
    )


def _remaining(deadline: float, phase: str, pod: PodAddress | None) -> float:
    left = deadline - asyncio.get_running_loop().time()
    if left <= 0:
        raise UpstreamError(
            "timeout", "The request timed out upstream.", retryable=False, pod=pod, phase=phase
        )
    return left
