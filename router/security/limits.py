"""Limits on what a client may send before any of it is parsed: header count and size.

uvicorn's httptools parser bounds neither, so the data path checks them while it builds the
header dict it needs anyway. Body size is bounded while the body is read (`app.py`), and
the body's content by `request.py`.
"""

from __future__ import annotations

from collections.abc import Iterable

from router.errors import APIError


def headers_too_large(message: str) -> APIError:
    return APIError(431, message, code="request_header_fields_too_large")


def read_headers(
    raw: Iterable[tuple[bytes, bytes]], max_headers: int, max_bytes: int
) -> dict[str, str]:
    """ASGI headers as a dict with lower-cased names; raise 431 past either bound."""
    headers: dict[str, str] = {}
    size = 0
    count = 0
    for name, value in raw:
        count += 1
        size += len(name) + len(value)
        headers[name.decode("latin-1").lower()] = value.decode("latin-1")
    if count > max_headers:
        raise headers_too_large(f"Too many request headers (at most {max_headers}).")
    if size > max_bytes:
        raise headers_too_large(f"Request headers exceed {max_bytes} bytes.")
    return headers
