"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can see is an `APIError`; it carries the HTTP status and renders
itself once. Messages never contain internal addresses or upstream bodies.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

#: Longest engine message passed on to a client (the rest is cut).
MAX_UPSTREAM_MESSAGE_CHARS = 512
_ADDRESS = re.compile(
    r"[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"]+"  # URLs
    r"|\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b"  # IPv4, maybe with a port
    r"|\[?[0-9a-fA-F:]*::[0-9a-fA-F:]*\]?(?::\d+)?"  # IPv6 with ::
    r"|\[?(?:[0-9a-fA-F]{1,4}:){7}[0-9a-fA-F]{1,4}\]?(?::\d+)?"  # full IPv6
)


class APIError(Exception):
    """An error answered to the client with `status` and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> bytes:
        return orjson.dumps(self.payload())

    def payload(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def sse_event(self) -> bytes:
        """The mid-stream form: one `data:` event with the error, then `[DONE]`."""
        return b"data: " + self.body() + b"\n\ndata: [DONE]\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist.",
        type="invalid_request_error",
        param="model",
        code="model_not_found",
    )


def service_unavailable(message: str, retry_after: int | None = None) -> APIError:
    headers = {"retry-after": str(retry_after)} if retry_after is not None else None
    return APIError(503, message, type="service_unavailable", code="no_capacity", headers=headers)


def bad_gateway(message: str, code: str = "upstream_error") -> APIError:
    return APIError(502, message, type="upstream_error", code=code)


def gateway_timeout(message: str = "The request timed out upstream.") -> APIError:
    return APIError(504, message, type="timeout", code="upstream_timeout")


def method_not_allowed(method: str, allow: str | None = None) -> APIError:
    """A 405; `allow` lists the methods the path takes (its `Allow` header)."""
    return APIError(405, f"Method {method} is not allowed here.", code="method_not_allowed",
                    headers={"allow": allow} if allow else None)


#: What an engine's `param` may look like to be passed on: a field name or path.
_PARAM = re.compile(r"[A-Za-z0-9_.\[\]-]{1,128}")


def upstream_fields(body: bytes) -> tuple[str | None, str | None]:
    """The `message` (scrubbed) and `param` (when it looks like a field name or path) of
    an engine's error body, in either shape engines send: current vLLM nests
    `{"error": {"message": ..., "param": ...}}`; older vLLM and SGLang send a flat
    `{"object": "error", "message": ...}`. None for what is absent or unsafe."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None, None
    if not isinstance(data, dict):
        return None, None
    inner = data.get("error")
    fields = inner if isinstance(inner, dict) else data
    message = inner if isinstance(inner, str) else fields.get("message")
    if not isinstance(message, str):
        message = data.get("message")
    param = fields.get("param")
    return (
        scrub(message) if isinstance(message, str) else None,
        param if isinstance(param, str) and _PARAM.fullmatch(param) else None,
    )


def scrub(message: str) -> str | None:
    """An engine's message made safe for a client: no addresses, no traceback, bounded.

    Returns None when nothing safe is left (the caller then says something generic).
    """
    if "Traceback" in message or 'File "' in message:
        return None
    cleaned = _ADDRESS.sub("<address>", message).strip()
    return cleaned[:MAX_UPSTREAM_MESSAGE_CHARS] or None
