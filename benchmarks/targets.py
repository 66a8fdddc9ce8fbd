"""Where requests go: a router (or one engine pod) over HTTP, or a client-side PD pair.

`HTTPTarget` posts to one base URL and measures the answer; it is what every router and
the aggregated "direct" floor use. `DirectPDTarget` is the PD floor: the client itself
does what a PD router does (prefill with `max_tokens: 1` and a NIXL-style request for a
KV handle, then decode with the handle) against one prefill and one decode pod, with no
router in between. `RoundRobin` spreads the floor over every pod (or pair) as the routers
spread their requests: a floor on one pod of two would load that pod twice as much as
any router does (64 streams on one simulated pod answer later than 32 on each of two).
"""

from __future__ import annotations

import time
from typing import Any, Final, Protocol

import aiohttp
import orjson

from benchmarks.specs import RequestResult, RequestSpec
from benchmarks.sse import ChunkKind, SSEError, SSEParser, classify

MAX_ERROR_BODY_BYTES: Final = 64 * 1024
JSON_HEADERS: Final = {"content-type": "application/json"}
PREFILL_KV_PARAMS: Final = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class Target(Protocol):
    name: str

    async def send(
        self, session: aiohttp.ClientSession, spec: RequestSpec, result: RequestResult
    ) -> None:
        """Send `spec`, filling `result` in (errors go to `result.error`, never raised)."""


class HTTPTarget:
    """POST to `base_url` + the request's path."""

    def __init__(self, name: str, base_url: str) -> None:
        self.name = name
        self.base_url = base_url.rstrip("/")

    async def send(
        self, session: aiohttp.ClientSession, spec: RequestSpec, result: RequestResult
    ) -> None:
        began = time.perf_counter()
        await _exchange(session, self.base_url + spec.path, spec.body, spec.stream, began, result,
                        _headers(spec))


class RoundRobin:
    """Each request to the next of `targets` (the direct floor over several pods)."""

    def __init__(self, name: str, targets: list[HTTPTarget] | list[DirectPDTarget]) -> None:
        if not targets:
            raise ValueError("no targets")
        self.name = name
        self.targets = targets
        self._next = 0

    def pick(self) -> HTTPTarget | DirectPDTarget:
        target = self.targets[self._next]
        self._next = (self._next + 1) % len(self.targets)
        return target

    async def send(
        self, session: aiohttp.ClientSession, spec: RequestSpec, result: RequestResult
    ) -> None:
        await self.pick().send(session, spec, result)


class DirectPDTarget:
    """Client-side prefill-then-decode against one pod pair (the PD floor)."""

    def __init__(self, name: str, prefill_url: str, decode_url: str) -> None:
        self.name = name
        self.prefill_url = prefill_url.rstrip("/")
        self.decode_url = decode_url.rstrip("/")

    async def send(
        self, session: aiohttp.ClientSession, spec: RequestSpec, result: RequestResult
    ) -> None:
        began = time.perf_counter()
        body: dict[str, Any] = orjson.loads(spec.body)
        prefill = dict(body)
        prefill.pop("stream_options", None)
        prefill.update(stream=False, max_tokens=1, kv_transfer_params=PREFILL_KV_PARAMS)
        prefill.pop("max_completion_tokens", None)
        try:
            async with session.post(
                self.prefill_url + spec.path, data=orjson.dumps(prefill), headers=_headers(spec)
            ) as response:
                if response.status != 200:
                    await response.content.read(MAX_ERROR_BODY_BYTES)
                    _fail(result, began, f"prefill_http_{response.status}", response.status)
                    return
                raw = await response.read()
        except TimeoutError:
            _fail(result, began, "prefill_timeout", 0)
            return
        except (aiohttp.ClientError, OSError) as exc:
            _fail(result, began, f"prefill_{_client_error_kind(exc)}", 0)
            return
        try:
            params = orjson.loads(raw).get("kv_transfer_params")
        except (orjson.JSONDecodeError, AttributeError):
            params = None
        if not isinstance(params, dict):
            _fail(result, began, "prefill_no_kv_params", 200)
            return
        body["kv_transfer_params"] = params
        await _exchange(
            session, self.decode_url + spec.path, orjson.dumps(body), spec.stream, began, result,
            _headers(spec),
        )


async def _exchange(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    stream: bool,
    began: float,
    result: RequestResult,
    headers: dict[str, str],
) -> None:
    """One POST whose answer is measured into `result`; `began` is when the request began."""
    try:
        async with session.post(url, data=body, headers=headers) as response:
            result.status = response.status
            result.prefill_pod = response.headers.get("x-pdgate-prefill-pod")
            result.decode_pod = response.headers.get("x-pdgate-decode-pod")
            if response.status != 200:
                await response.content.read(MAX_ERROR_BODY_BYTES)
                _fail(result, began, f"http_{response.status}", response.status)
                return
            if stream:
                await _read_stream(response, began, result)
            else:
                await _read_json(response, began, result)
    except TimeoutError:
        _fail(result, began, "timeout", result.status)
    except aiohttp.ClientPayloadError:
        _fail(result, began, "payload", result.status)
    except (aiohttp.ClientError, OSError) as exc:
        _fail(result, began, _client_error_kind(exc), result.status)


async def _read_stream(
    response: aiohttp.ClientResponse, began: float, result: RequestResult
) -> None:
    parser = SSEParser()
    last: float | None = None
    done = False
    try:
        async for data in response.content.iter_any():
            now = time.perf_counter()
            for payload in parser.feed(data):
                kind, obj = classify(payload)
                if kind is ChunkKind.CONTENT:
                    if last is None:
                        result.ttft = now - began
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.chunks += 1
                    _usage(obj, result)
                elif kind is ChunkKind.DONE:
                    done = True
                elif kind is ChunkKind.ERROR:
                    _fail(result, began, "stream_error", result.status)
                    return
                else:
                    _usage(obj, result)
        for payload in parser.close():
            if classify(payload)[0] is ChunkKind.DONE:
                done = True
    except SSEError:
        _fail(result, began, "bad_sse", result.status)
        return
    result.e2e = time.perf_counter() - began
    if not done:
        result.error = "no_done"
    elif result.chunks == 0:
        result.error = "no_content"


async def _read_json(
    response: aiohttp.ClientResponse, began: float, result: RequestResult
) -> None:
    raw = await response.read()
    result.e2e = time.perf_counter() - began
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        result.error = "bad_json"
        return
    if not isinstance(obj, dict) or "error" in obj:
        result.error = "json_error"
        return
    choices = obj.get("choices") or [{}]
    first = choices[0] if isinstance(choices[0], dict) else {}
    message = first.get("message")
    text = message.get("content") if isinstance(message, dict) else first.get("text")
    if not text:
        result.error = "no_content"
    _usage(obj, result)


def _headers(spec: RequestSpec) -> dict[str, str]:
    return {**JSON_HEADERS, **dict(spec.headers)} if spec.headers else JSON_HEADERS


def _usage(obj: Any, result: RequestResult) -> None:
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if isinstance(usage, dict):
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int):
            result.prompt_tokens = prompt
        if isinstance(completion, int):
            result.completion_tokens = completion


def _fail(result: RequestResult, began: float, kind: str, status: int) -> None:
    result.e2e = time.perf_counter() - began
    result.error = kind
    result.status = status


def _client_error_kind(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "disconnected"
    if isinstance(exc, aiohttp.ClientConnectorError | ConnectionRefusedError):
        return "connect"
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientOSError | OSError):
        return "os_error"
    return "client_error"
