"""The HTTP edge: what the router does with a client connection before the app sees it.

`EdgeConfig` holds the bounds (timeouts, connection cap, head size), `protocol.py` the
connection protocol that enforces them, `metrics.py` what is counted. `Edge.options()`
gives the uvicorn settings of one listener.
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

from prometheus_client import CollectorRegistry

from router.http.config import EdgeConfig
from router.http.metrics import EdgeMetrics
from router.http.protocol import protocol_class

__all__ = ["Edge", "EdgeConfig"]


class Edge:
    """The edge's bounds and metrics, shared by the router's listeners."""

    def __init__(self, config: EdgeConfig, registry: CollectorRegistry) -> None:
        self.config = config
        self.metrics = EdgeMetrics(registry)

    def options(self, listener: str) -> dict[str, Any]:
        """uvicorn `Config` settings for one listener (`api` or `admin`)."""
        return {
            "http": protocol_class(self.config, self.metrics.listener(listener)),
            "ws": "none",
            "timeout_keep_alive": self.config.idle_timeout_s,
        }

    def count_open(self, listener: str, connections: Sized) -> None:
        """Export the size of a uvicorn server's connection set (`server_state.connections`)."""
        self.metrics.count_open(listener, connections)
