"""Active health checks: GET each pod's health endpoint, and probe ejected pods back in.

Two loops share one `OutlierDetector`. The sweep checks every pod in the view each
`health_interval_s`; `unhealthy_threshold` failed checks in a row eject the pod. The
readmission loop probes ejected pods whose backoff is over (passive or active ejections
alike) and reports the result, which readmits the pod or ejects it for longer. Probes run
at most `MAX_CONCURRENT_PROBES` at a time so a large cluster cannot flood the loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from prometheus_client import CollectorRegistry, Counter

from router.resilience.config import ResilienceConfig
from router.resilience.ejection import OutlierDetector
from router.view import ClusterView, Endpoint

log = logging.getLogger("pdgate.health")

MAX_CONCURRENT_PROBES = 32

Probe = Callable[[str, float], Awaitable[bool]]


class HealthChecker:
    """The sweep and the readmission probes (see the module docstring)."""

    def __init__(
        self,
        config: ResilienceConfig,
        view: ClusterView,
        detector: OutlierDetector,
        probe: Probe,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self._config = config
        self._view = view
        self._detector = detector
        self._probe = probe
        self._limit = asyncio.Semaphore(MAX_CONCURRENT_PROBES)
        #: Failed active checks in a row, per pod key (pods in the view only).
        self._failures: dict[str, int] = {}
        self._checks = (
            Counter("pdgate_health_checks", "Active health checks of pods, by result.",
                    ["result"], registry=registry)
            if registry is not None else None
        )

    async def run(self) -> None:
        """Run both loops until cancelled."""
        async with asyncio.TaskGroup() as group:
            group.create_task(self._readmit_loop())
            if self._config.health_interval_s > 0:
                group.create_task(self._sweep_loop())

    async def _readmit_loop(self) -> None:
        while True:
            if not self._detector.ejected:  # nothing to probe back in: no timer either
                await self._detector.any_ejected.wait()
            try:
                await self.readmit()
            except Exception:  # a bug here must not leave pods ejected for good
                log.exception("readmission probes failed; retrying")
            await asyncio.sleep(self._config.probe_tick_s)

    async def _sweep_loop(self) -> None:
        while True:
            try:
                await self.sweep()
            except Exception:
                log.exception("health check sweep failed; retrying")
            await asyncio.sleep(self._config.health_interval_s)

    async def readmit(self) -> None:
        """Probe every ejected pod whose backoff is over, and report the results."""
        due = self._detector.due()
        if not due:
            return
        try:
            answers = await self._check_all(due)
        except Exception:
            # A probe failed in a way it does not report (a bug): the pods did not show
            # they are healthy, so they wait out a longer backoff and are probed again
            # (left marked as being probed, no later round would ever pick them).
            for pod in due:
                self._detector.probe_result(pod, False)
            raise
        for pod in due:
            self._detector.probe_result(pod, answers[pod.base_url])

    async def sweep(self) -> None:
        """Check every admitted pod once."""
        pods = self._view.snapshot.endpoints()
        self._failures = {k: n for k, n in self._failures.items() if k in pods}
        checked = [pod for key, pod in pods.items() if not self._detector.is_ejected(key)]
        answers = await self._check_all(checked)
        threshold = max(1, self._config.unhealthy_threshold)
        for pod in checked:
            if answers[pod.base_url]:
                self._failures.pop(pod.key, None)
                continue
            failures = self._failures.get(pod.key, 0) + 1
            if failures >= threshold and not self._detector.is_ejected(pod.key):
                self._failures.pop(pod.key, None)
                self._detector.eject(pod, "active")
            else:
                self._failures[pod.key] = failures

    async def _check_all(self, pods: list[Endpoint]) -> dict[str, bool]:
        """Each pod's health by base URL: a pod whose data-parallel ranks share one API
        server (several targets, one URL) is probed once."""
        urls = list(dict.fromkeys(pod.base_url for pod in pods))
        results = await asyncio.gather(*(self._check(url) for url in urls))
        return dict(zip(urls, results, strict=True))

    async def _check(self, base_url: str) -> bool:
        async with self._limit:
            ok = await self._probe(base_url + self._config.health_path,
                                   self._config.health_timeout_s)
        if self._checks is not None:
            self._checks.labels(result="ok" if ok else "failed").inc()
        return ok
