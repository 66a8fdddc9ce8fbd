"""Outlier ejection: pods that keep failing stop getting traffic until a probe says otherwise.

Passive: every upstream failure the proxy attributes to a pod counts; `consecutive_failures`
in a row eject it. Active health checks eject too (`eject(source="active")`). An ejected pod
stays out until its backoff ends AND a probe of its health endpoint succeeds (the
`HealthChecker` probes pods `due()`); a failed probe ejects it again for twice as long, up to
`max_ejection_s`. The backoff exponent is forgotten once a readmitted pod has served
successfully for as long as its last ejection lasted.

The success path costs one truthiness test while no pod is in trouble. `is_ejected` is the
hook the scheduler's `not-ejected` filter calls. That filter is soft (a degraded answer
beats a 503 on a first attempt); a retry is stricter: `without_ejected` leaves it only
the pods that are not ejected, and when none is left the retry is not made.

With several router processes (`router.sync`), `listener` hears each local ejection and
readmission; the others apply them with `apply_remote_eject` / `apply_remote_readmit`, so
a pod one process finds broken is out everywhere, and back everywhere after one probe.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from prometheus_client import CollectorRegistry, Counter, Gauge

from router.resilience.config import ResilienceConfig
from router.view import Endpoint, PDGroupPods, ServerPods

log = logging.getLogger("pdgate.ejection")


@dataclass(slots=True)
class _Trouble:
    """One pod that failed recently: its failure streak and ejection history."""

    endpoint: Endpoint
    failures: int = 0
    times: int = 0  # ejections in a row (the backoff exponent)
    until: float = 0.0  # ejected until then (monotonic); 0 while admitted
    backoff: float = 0.0  # length of the last ejection
    readmitted_at: float = 0.0
    probing: bool = False


class EjectionMetrics:
    """`pdgate_pod_ejected{pod}` (1 while ejected), ejection and readmission counters."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.ejected = Gauge(
            "pdgate_pod_ejected", "1 while a pod is ejected from load balancing.", ["pod"],
            registry=registry,
        )
        self.ejected_count = Gauge(
            "pdgate_pods_ejected", "Pods currently ejected.", registry=registry
        )
        self.ejections = Counter(
            "pdgate_pod_ejections", "Pods ejected, by what noticed (passive, active, probe).",
            ["source"], registry=registry,
        )
        self.readmissions = Counter(
            "pdgate_pod_readmissions", "Ejected pods readmitted after a successful probe.",
            registry=registry,
        )


class OutlierDetector:
    """Which pods are ejected, and why (see the module docstring)."""

    def __init__(
        self,
        config: ResilienceConfig,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._threshold = config.consecutive_failures
        self._base = config.base_ejection_s
        self._max = max(config.max_ejection_s, config.base_ejection_s)
        self._clock = clock
        self._metrics = EjectionMetrics(registry) if registry is not None else None
        #: Pods that failed recently, ejected or not (bounded by the pods in the view).
        self._trouble: dict[str, _Trouble] = {}
        #: Keys of the pods ejected now: the set `is_ejected` reads.
        self.ejected: set[str] = set()
        #: Called with (pod key, backoff seconds; 0.0 = readmitted) on local changes.
        self.listener: Callable[[str, float], None] | None = None
        #: Set while some pod is ejected: the readmission loop sleeps on it otherwise.
        self.any_ejected = asyncio.Event()

    def is_ejected(self, key: str) -> bool:
        return key in self.ejected

    def record_success(self, endpoint: Endpoint) -> None:
        """A request to `endpoint` went well: its failure streak ends."""
        if not self._trouble:
            return
        trouble = self._trouble.get(endpoint.key)
        if trouble is None or trouble.until:
            return
        trouble.failures = 0
        if self._clock() - trouble.readmitted_at >= trouble.backoff:
            del self._trouble[endpoint.key]  # healthy for a whole backoff: forget the history

    def record_failure(self, endpoint: Endpoint, source: str = "passive") -> None:
        """A request (or an active check) to `endpoint` failed in a way that blames the pod."""
        if self._threshold == 0:
            return
        trouble = self._trouble.get(endpoint.key)
        if trouble is None:
            trouble = self._trouble[endpoint.key] = _Trouble(endpoint)
        if trouble.until:
            return  # already ejected
        trouble.endpoint = endpoint  # the pod may have come back at a new address
        trouble.failures += 1
        if trouble.failures >= self._threshold:
            self.eject(endpoint, source)

    def eject(self, endpoint: Endpoint, source: str) -> None:
        """Eject now, for a backoff that doubles with each ejection in a row."""
        trouble = self._trouble.get(endpoint.key)
        if trouble is None:
            trouble = self._trouble[endpoint.key] = _Trouble(endpoint)
        trouble.times += 1
        backoff = min(self._base * 2 ** (trouble.times - 1), self._max)
        self._eject(trouble, endpoint, source, backoff)
        if self.listener is not None:
            self.listener(endpoint.key, backoff)

    def apply_remote_eject(self, endpoint: Endpoint, backoff: float) -> None:
        """A peer ejected `endpoint` for `backoff` seconds: out here too, probed here too."""
        trouble = self._trouble.get(endpoint.key)
        if trouble is None:
            trouble = self._trouble[endpoint.key] = _Trouble(endpoint)
        if trouble.until:
            return
        trouble.times = max(trouble.times, 1)
        self._eject(trouble, endpoint, "peer", max(0.0, backoff))

    def apply_remote_readmit(self, key: str) -> None:
        """A peer's probe found `key` healthy again: readmit it here without a probe."""
        trouble = self._trouble.get(key)
        if trouble is not None and trouble.until:
            self._readmit(trouble, announce=False)

    def _eject(self, trouble: _Trouble, endpoint: Endpoint, source: str, backoff: float) -> None:
        trouble.backoff = backoff
        trouble.until = self._clock() + trouble.backoff
        trouble.failures = 0
        trouble.probing = False
        newly = endpoint.key not in self.ejected
        self.ejected.add(endpoint.key)
        self.any_ejected.set()
        log.warning("pod %s ejected for %.1f s (%s, ejection %d in a row)",
                    endpoint.key, trouble.backoff, source, trouble.times)
        if self._metrics is not None:
            self._metrics.ejections.labels(source=source).inc()
            if newly:
                self._metrics.ejected.labels(pod=endpoint.key).set(1)
                self._metrics.ejected_count.set(len(self.ejected))

    def due(self) -> list[Endpoint]:
        """Ejected pods whose backoff is over and that no probe is checking yet."""
        if not self.ejected:
            return []
        now = self._clock()
        out = []
        for key in self.ejected:
            trouble = self._trouble[key]
            if not trouble.probing and trouble.until <= now:
                trouble.probing = True
                out.append(trouble.endpoint)
        return out

    def probe_result(self, endpoint: Endpoint, ok: bool) -> None:
        """Readmit after a successful probe; eject for longer after a failed one."""
        trouble = self._trouble.get(endpoint.key)
        if trouble is None or not trouble.until:
            return
        if not ok:
            self.eject(endpoint, "probe")
            return
        self._readmit(trouble, announce=True)

    def _readmit(self, trouble: _Trouble, announce: bool) -> None:
        endpoint = trouble.endpoint
        trouble.until = 0.0
        trouble.probing = False
        trouble.failures = 0
        trouble.readmitted_at = self._clock()
        self.ejected.discard(endpoint.key)
        if not self.ejected:
            self.any_ejected.clear()
        log.warning("pod %s readmitted after a successful probe", endpoint.key)
        if self._metrics is not None:
            self._metrics.readmissions.inc()
            self._metrics.ejected.remove(endpoint.key)
            self._metrics.ejected_count.set(len(self.ejected))
        if announce and self.listener is not None:
            self.listener(endpoint.key, 0.0)

    def forget_absent(self, present: Iterable[str]) -> None:
        """Drop the state of pods that left the view."""
        keep = set(present)
        for key in [k for k in self._trouble if k not in keep]:
            del self._trouble[key]
            if key in self.ejected:
                self.ejected.discard(key)
                if self._metrics is not None:
                    self._metrics.ejected.remove(key)
        if not self.ejected:
            self.any_ejected.clear()
        if self._metrics is not None:
            self._metrics.ejected_count.set(len(self.ejected))


def without_ejected(server: ServerPods, ejected: set[str]) -> ServerPods | None:
    """`server` without the pods in `ejected`; None if no pod (PD: no whole pair) is left.

    A PD group keeps only if it still has a prefill and a decode pod. Returns `server`
    itself when none of its pods is ejected.
    """
    if not ejected:
        return server
    if not server.is_pd:
        pods = tuple(p for p in server.aggregated if p.key not in ejected)
        if len(pods) == len(server.aggregated):
            return server
        return replace(server, aggregated=pods) if pods else None
    groups: list[PDGroupPods] = []
    changed = False
    for group in server.groups:
        prefill = tuple(p for p in group.prefill if p.key not in ejected)
        decode = tuple(p for p in group.decode if p.key not in ejected)
        if len(prefill) == len(group.prefill) and len(decode) == len(group.decode):
            groups.append(group)
            continue
        changed = True
        if prefill and decode:
            groups.append(PDGroupPods(group=group.group, prefill=prefill, decode=decode))
    if not changed:
        return server
    return replace(server, groups=tuple(groups)) if groups else None
