"""The HTTP edge: what the router does with a client connection before the app sees it.

`EdgeConfig` holds the bounds (timeouts, connection cap, head size), `protocol.py` the
connection protocol that enforces them, `metrics.py` what is counted. `Edge.options()`
gives the uvicorn settings of one listener.
"""

from __future__ import annotations

import logging
import resource
from collections.abc import Sized
from typing import Any

from prometheus_client import CollectorRegistry

from router.http.config import EdgeConfig
from router.http.metrics import EdgeMetrics
from router.http.protocol import EarlyRefusal, protocol_class

__all__ = ["FD_RESERVE", "EarlyRefusal", "Edge", "EdgeConfig", "ensure_fd_limit"]

log = logging.getLogger("pdgate.http")

#: File descriptors kept beside client connections: listeners, logs, key files, watches.
FD_RESERVE = 256


class Edge:
    """The edge's bounds and metrics, shared by the router's listeners."""

    def __init__(self, config: EdgeConfig, registry: CollectorRegistry,
                 refuse_early: EarlyRefusal | None = None) -> None:
        self.config = config
        self.metrics = EdgeMetrics(registry)
        #: Asked from each API request's head whether to refuse it at once.
        self.refuse_early = refuse_early

    def options(self, listener: str) -> dict[str, Any]:
        """uvicorn `Config` settings for one listener (`api` or `admin`)."""
        return {
            "http": protocol_class(self.config, self.metrics.listener(listener),
                                   self.refuse_early if listener == "api" else None),
            "ws": "none",
            "timeout_keep_alive": self.config.idle_timeout_s,
            # Nothing reads the client address, so uvicorn's X-Forwarded-For middleware
            # would be one more ASGI layer per request for nothing; the `server` header
            # would only advertise the server.
            "proxy_headers": False,
            "server_header": False,
        }

    def count_open(self, listener: str, connections: Sized) -> None:
        """Export the size of a uvicorn server's connection set (`server_state.connections`)."""
        self.metrics.count_open(listener, connections)


def ensure_fd_limit(needed: int) -> int:
    """Raise the soft open-files limit toward `needed` (as far as the hard limit allows).

    A connection cap above the limit is no cap: accept() fails with EMFILE first, and
    upstream connections fail with it. Returns the soft limit now in force; warns when
    it is still below `needed`.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return soft
    target = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-files limit to %d: %s", target, exc)
    if soft < needed:
        log.warning("open-files limit %d is below the %d the connection bounds need: lower "
                    "--max-connections or raise the limit (ulimit -n)", soft, needed)
    return soft
