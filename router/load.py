"""Router-side requests in flight, per pod, counted at dispatch.

A pod's count rises the moment the router commits a request to it (before any byte is
sent) and falls on every exit path, so two requests arriving together never both see
an idle pod. Counters live here, not in the scheduler, so every scorer and the metrics
read the same numbers.

Other router processes (`router.sync`: workers of this host, peer replicas) report their
own counts; `get` adds them, so every scorer sees the load of the whole fleet. Their sum
is kept per pod (`_remote`), replaced whole per origin, never incremented blindly: a lost
message is repaired by the origin's next report, and a silent origin is dropped whole.
"""

from __future__ import annotations

from collections.abc import Callable

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
        #: Requests other router processes have in flight, summed per pod.
        self._remote: dict[str, int] = {}
        #: origin -> pod -> that origin's last reported count.
        self._by_origin: dict[str, dict[str, int]] = {}
        #: Called with (pod key, this process's new count, whether it rose) on every
        #: change (`router.sync`).
        self.listener: Callable[[str, int, bool], None] | None = None

    def get(self, endpoint: Endpoint) -> int:
        key = endpoint.key
        return self._counts.get(key, 0) + self._remote.get(key, 0)

    def get_many(self, keys: list[str]) -> list[int]:
        """`get` for many pods by key at once (one call per decision, not one per pod)."""
        counts, remote = self._counts, self._remote
        if not remote:
            get = counts.get
            return [get(key, 0) for key in keys]
        return [counts.get(key, 0) + remote.get(key, 0) for key in keys]

    def local(self, key: str) -> int:
        """This process's own count for pod `key` (what it reports to its peers)."""
        return self._counts.get(key, 0)

    def local_counts(self) -> dict[str, int]:
        return dict(self._counts)

    def seen(self) -> dict[str, int]:
        """Every pod's count as the scorers see it: this process's plus its peers'."""
        out = dict(self._remote)
        for key, count in self._counts.items():
            out[key] = out.get(key, 0) + count
        return out

    def set_remote(self, origin: str, key: str, count: int) -> None:
        """`origin` (another router process) now has `count` requests in flight on `key`."""
        counts = self._by_origin.setdefault(origin, {})
        delta = count - counts.get(key, 0)
        if not delta:
            return
        if count > 0:
            counts[key] = count
        else:
            counts.pop(key, None)
        left = self._remote.get(key, 0) + delta
        if left > 0:
            self._remote[key] = left
        else:
            self._remote.pop(key, None)

    def add_remote(self, origin: str, key: str) -> None:
        """Count one more request of `origin` on `key` before it reports it (a placement
        this process made for it); its next report of `key` sets the true count."""
        self.set_remote(origin, key, self._by_origin.get(origin, {}).get(key, 0) + 1)

    def replace_remote(self, origin: str, counts: dict[str, int]) -> None:
        """`origin`'s whole report (its heartbeat): pods it no longer names count zero."""
        for key in [k for k in self._by_origin.get(origin, {}) if k not in counts]:
            self.set_remote(origin, key, 0)
        for key, count in counts.items():
            self.set_remote(origin, key, count)

    def drop_origin(self, origin: str) -> None:
        """`origin` went silent: its counts no longer weigh on any pod."""
        self.replace_remote(origin, {})
        self._by_origin.pop(origin, None)

    def total(self) -> int:
        return sum(self._counts.values())

    def acquire(self, endpoint: Endpoint) -> None:
        key = endpoint.key
        count = self._counts[key] = self._counts.get(key, 0) + 1
        self._child(endpoint).inc()
        if self.listener is not None:
            self.listener(key, count, True)

    def release(self, endpoint: Endpoint) -> None:
        key = endpoint.key
        left = self._counts.get(key, 0) - 1
        if left > 0:
            self._counts[key] = left
        else:
            self._counts.pop(key, None)
        self._child(endpoint).dec()
        if self.listener is not None:
            self.listener(key, max(0, left), False)

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
