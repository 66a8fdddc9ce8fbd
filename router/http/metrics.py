"""Connection metrics of the HTTP edge: refusals by reason, open connections by listener.

Both move per connection, never per request: a refusal is counted once, and the open
gauge is read from the server's own connection set when `/metrics` is scraped.
"""

from __future__ import annotations

from collections.abc import Sized

from prometheus_client import CollectorRegistry, Counter, Gauge

#: Why the edge closed a connection itself (the `reason` label's values).
REFUSAL_REASONS = ("max_connections", "header_too_large", "header_timeout", "body_timeout",
                   "body_too_large")


class ListenerMetrics:
    """One listener's (`api` or `admin`) refusal counters, children made up front."""

    __slots__ = ("_children",)

    def __init__(self, counter: Counter, listener: str) -> None:
        self._children = {
            reason: counter.labels(listener=listener, reason=reason)
            for reason in REFUSAL_REASONS
        }

    def refused(self, reason: str) -> None:
        self._children[reason].inc()


class EdgeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._refused = Counter(
            "pdgate_connections_refused",
            "Client connections the router refused or closed itself, by listener and reason "
            "(max_connections, header_too_large, header_timeout, body_timeout).",
            ["listener", "reason"], registry=registry,
        )
        self._open = Gauge(
            "pdgate_connections_open", "Open client connections, by listener.",
            ["listener"], registry=registry,
        )

    def listener(self, name: str) -> ListenerMetrics:
        return ListenerMetrics(self._refused, name)

    def count_open(self, name: str, connections: Sized) -> None:
        """Report `len(connections)` (the server's own set) as the listener's open gauge."""
        self._open.labels(listener=name).set_function(lambda: len(connections))
