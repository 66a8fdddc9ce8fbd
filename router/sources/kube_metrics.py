"""Prometheus metrics of the Kubernetes source, registered in the registry it is given.

They answer the operator's questions about discovery: is the watch healthy (restarts by
reason, seconds since the API server last said anything), did everything list once
(synced), and which objects were refused (invalid objects by kind, Events posted).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

#: Why a watch was restarted (the `reason` label; a closed set keeps series bounded).
RESTART_REASONS = (
    "closed",  # the server ended the stream (timeoutSeconds): expected every 5-10 min
    "expired",  # 410 Gone: the resourceVersion is too old, so relist
    "dropped",  # the stream broke mid-way (connection reset, read timeout)
    "unreachable",  # could not connect, or the LIST failed to connect
    "http_error",  # the API server answered with an error status
    "error_event",  # an ERROR event other than 410
    "malformed",  # a line that is not a watch event
    "selector_changed",  # the pod label selector changed with the ModelServers
    "internal",  # a bug of ours while applying events: logged with a traceback
)


class KubeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.watch_restarts = Counter(
            "pdgate_kubernetes_watch_restarts",
            "Watch (re)starts after the first, by resource and reason.",
            ["resource", "reason"],
            registry=registry,
        )
        self.seconds_since_event = Gauge(
            "pdgate_kubernetes_seconds_since_last_event",
            "Seconds since the API server last sent anything for the resource "
            "(a LIST, a watch event or a BOOKMARK).",
            ["resource"],
            registry=registry,
        )
        self.invalid_objects = Counter(
            "pdgate_kubernetes_invalid_objects",
            "Objects refused (schema) or flagged (missing ModelServer, duplicate modelName), "
            "counted once per object version.",
            ["kind"],
            registry=registry,
        )
        self.synced = Gauge(
            "pdgate_kubernetes_synced",
            "1 once every watched resource has been listed; stays 1 while the API server "
            "is unreachable (the last good state is served).",
            registry=registry,
        )
        self.events = Counter(
            "pdgate_kubernetes_events",
            "Kubernetes Events about invalid objects, by result (posted, failed, "
            "rate_limited, dropped).",
            ["result"],
            registry=registry,
        )

    def track_resource(self, resource: str, last_event: Callable[[], float]) -> None:
        """Compute seconds-since-last-event at scrape time from a monotonic timestamp."""
        self.seconds_since_event.labels(resource=resource).set_function(
            lambda: max(0.0, time.monotonic() - last_event())
        )
        for reason in RESTART_REASONS:
            self.watch_restarts.labels(resource=resource, reason=reason)

    def track_synced(self, synced: Callable[[], bool]) -> None:
        self.synced.set_function(lambda: 1.0 if synced() else 0.0)
