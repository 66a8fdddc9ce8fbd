"""Router-side requests in flight, per pod, counted at dispatch.

A pod's count rises the moment the router commits a request to it (before any byte is
sent) and falls on every exit path, so two requests arriving together never both see
an idle pod. Counters live here, not in the scheduler, so every scorer and the metrics
read the same numbers.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from router.view import Endpoint


class InFlight:
    """Per-pod in-flight counts, mirrored into `pdgate_inflight_requests{pod,role}`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._counts: dict[str, int] = {}
        self._gauge = Gauge(
            "pdgate_inflight_requests",
            "Requests the router has in flight, per pod and role.",
            ["pod", "role"],
            registry=registry,
        )
        self._children: dict[tuple[str, str], Gauge] = {}

    def get(self, endpoint: Endpoint) -> int:
        return self._counts.get(endpoint.key, 0)

    def total(self) -> int:
        return sum(self._counts.values())

    def acquire(self, endpoint: Endpoint) -> None:
        key = endpoint.key
        self._counts[key] = self._counts.get(key, 0) + 1
        self._child(endpoint).inc()

    def release(self, endpoint: Endpoint) -> None:
        key = endpoint.key
        left = self._counts.get(key, 0) - 1
        if left > 0:
            self._counts[key] = left
        else:
            self._counts.pop(key, None)
        self._child(endpoint).dec()

    def _child(self, endpoint: Endpoint) -> Gauge:
        label = (endpoint.key, endpoint.role)
        child = self._children.get(label)
        if child is None:
            child = self._gauge.labels(pod=endpoint.key, role=endpoint.role)
            self._children[label] = child
        return child

    def forget_absent(self, present: set[str]) -> None:
        """Drop gauge children of pods that left the view and have nothing in flight."""
        for label in list(self._children):
            if label[0] not in present and label[0] not in self._counts:
                del self._children[label]
                self._gauge.remove(*label)
