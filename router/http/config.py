"""The bounds of the HTTP edge: how long a client may take, how many connections it may hold.

Every number is named here with the reason for its default; `pdgate serve` flags set them
(README, "Reliability and security").
"""

from __future__ import annotations

from dataclasses import dataclass

from router.security.config import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_HEADERS,
)

#: Seconds a client gets to send a complete request head (request line and headers),
#: counted from the connection's accept or from the first byte of the head: slowloris
#: bound. API clients send a head in one write; 10 s leaves room for a bad network.
DEFAULT_HEADER_TIMEOUT_S = 10.0
#: Seconds a client gets to send a whole request body once the head is in (a total, not
#: per read, so a byte every few seconds cannot hold a connection): an 8 MiB body at
#: 1.5 Mbit/s.
DEFAULT_BODY_TIMEOUT_S = 60.0
#: Seconds an idle keep-alive connection stays open between requests. Here the router is
#: the *server*: it must outlive the keep-alive of what sits in front of it (AWS ALB and
#: ingress-nginx keep idle upstream connections 60 s, aiohttp 15 s, httpx 5 s), or a
#: client reuses a connection the router is closing and its POST fails. (Toward engines
#: it is the other way round: vLLM closes idle connections after 5 s, so the router's
#: client keeps them at most 4 s; see `router/upstream.py`.)
DEFAULT_IDLE_TIMEOUT_S = 75.0
#: Open client connections per listener; beyond it new ones get a 503 and are closed.
DEFAULT_MAX_CONNECTIONS = 4096
#: Room for the request line (method, URL, version) in the raw head bound.
REQUEST_LINE_BYTES = 8 * 1024
#: Per header: ": " and CRLF, which the header-bytes limit does not count.
HEADER_FRAMING_BYTES = 4


def head_bytes_bound(max_header_bytes: int, max_headers: int) -> int:
    """Bytes a request head may take on the wire, from `--max-header-bytes`/`--max-headers`.

    The header limits count names and values; the raw head also holds the request line
    and each header's separators. A head past this is refused by the connection before
    it is buffered any further (431, connection closed).
    """
    return max_header_bytes + max_headers * HEADER_FRAMING_BYTES + REQUEST_LINE_BYTES


@dataclass(frozen=True, slots=True)
class EdgeConfig:
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_head_bytes: int = head_bytes_bound(DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_HEADERS)
    #: A body declared (Content-Length) past this is refused from the head (413).
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "idle_timeout_s",
                     "max_connections", "max_head_bytes", "max_body_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
