"""The client's side of one answer: what has been sent, and how an error ends it.

`Responder` wraps the ASGI `send` (or the edge's direct write path, where it serves the
request: no message dict per chunk) and remembers whether the client has seen a byte, so
that an error becomes a whole error response before the first byte and the stream
protocol's own ending after it (`stream_error_form`), never a second, spliced answer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from router.errors import APIError
from router.http.protocol import EdgeCycle, direct_writer
from router.request import ParsedRequest
from router.timing import Timeline

Send = Callable[[dict[str, Any]], Awaitable[None]]


class Responder:
    """Wraps the ASGI `send`, remembering whether the client has seen any byte.

    `clock` times the request from `arrived` (the ASGI call) for TTFT and its phases.
    """

    __slots__ = ("_direct", "_send", "clock", "finished", "sse_error", "started", "status")

    def __init__(self, send: Send, arrived: float | None = None) -> None:
        self._send = send
        #: The edge's direct write path (no ASGI message per chunk), where it applies.
        self._direct = direct_writer(send)
        self.clock = Timeline(arrived)
        self.started = False
        self.finished = False  # the last body chunk went out
        self.status = 0
        #: The mid-stream form of an error in this stream's protocol (`stream_error_form`).
        self.sse_error: Callable[[APIError], bytes] = APIError.sse_event

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.status = status
        if self._direct is not None:
            self._direct.start_direct(status, headers)  # written with the first body
            return
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, data: bytes, more: bool = False) -> None:
        self.finished = not more
        if self._direct is not None:
            await self._direct.write_direct(data, more)
            return
        await self._send({"type": "http.response.body", "body": data, "more_body": more})

    @property
    def direct(self) -> EdgeCycle | None:
        """The edge's direct write path, if it serves this response (see `write_now`)."""
        return self._direct

    def write_now(self, data: bytes, more: bool) -> None:
        """`body` on the direct path, from a callback: written at once, no drain wait."""
        assert self._direct is not None
        self.finished = not more
        self._direct.write_now(data, more)

    async def end(self, error: APIError, request_id: str | None = None) -> None:
        """End the response with `error`, whatever the client has seen of it so far.

        Before the first byte: the whole error response, with its status. After it (only
        streams send headers before their answer is complete): the mid-stream form in the
        stream's protocol (`sse_error`), so the client reads an ending rather than a cut.
        """
        if self.finished:
            return
        if self.started:
            await self._last(self.sse_error(error))
        else:
            await self.error(error, request_id)

    async def error(self, error: APIError, request_id: str | None = None) -> None:
        headers = [(b"content-type", b"application/json")]
        if request_id:
            headers.append((b"x-request-id", request_id.encode()))
        headers.extend((k.encode(), v.encode()) for k, v in error.headers.items())
        await self.start(error.status, headers)
        await self._last(error.body())

    async def _last(self, data: bytes) -> None:
        """An error's bytes, the answer's last: on the direct path written without waiting
        for the client to drain (they are few), so that a client that stopped reading
        cannot hold the request, its admission slot and its task, past its deadline."""
        if self._direct is not None:
            self.write_now(data, False)
        else:
            await self.body(data)


def stream_error_form(parsed: ParsedRequest) -> Callable[[APIError], bytes]:
    """The mid-stream form of an error in the request's stream protocol.

    Chat and completions: a `data:` event with the OpenAI error, then `[DONE]`. Responses
    API: its `error` event (`type`, `code`, `message`, `param`), which also carries the
    OpenAI `error` object so the openai SDK raises it; no `[DONE]` (the API has none).
    """
    if parsed.endpoint is None or parsed.endpoint.stream_end != "responses":
        return APIError.sse_event
    return _responses_error_event


def _responses_error_event(error: APIError) -> bytes:
    payload = {"type": "error", "code": error.code, "message": error.message,
               "param": error.param, **error.payload()}
    return b"event: error\ndata: " + orjson.dumps(payload) + b"\n\n"
