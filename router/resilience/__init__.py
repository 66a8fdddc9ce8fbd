"""The reliability layer one router holds: outlier ejection, health checks, admission, drain,
and the retry budget.

`Resilience` is built once by `AppState` and passed to whoever needs a part of it; its
`run()` is the background work (health checks and readmission probes). Give the scheduler
`resilience.is_ejected` as its ejection hook.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from router.resilience.admission import Admission
from router.resilience.config import ResilienceConfig
from router.resilience.drain import Drain
from router.resilience.ejection import OutlierDetector
from router.resilience.health import HealthChecker, Probe
from router.resilience.retry_budget import RetryBudget
from router.view import ClusterView, Snapshot


class Resilience:
    def __init__(
        self,
        config: ResilienceConfig,
        view: ClusterView,
        probe: Probe,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config
        self.outliers = OutlierDetector(config, registry)
        self.health = HealthChecker(config, view, self.outliers, probe, registry)
        self.admission = Admission(config, registry)
        self.drain = Drain()
        self.retry_budget = RetryBudget(
            config.retry_budget_percent, config.retry_min_concurrency, registry
        )
        self.is_ejected = self.outliers.is_ejected
        view.subscribe(self._on_snapshot)

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(self.health.run())
            group.create_task(self.admission.run())

    def _on_snapshot(self, snapshot: Snapshot) -> None:
        endpoints = snapshot.endpoints()
        self.outliers.forget_absent(endpoints)
        self.admission.size_for(sum(1 for pod in endpoints.values() if pod.role != "prefill"))


__all__ = [
    "Admission", "Drain", "HealthChecker", "OutlierDetector", "Resilience", "ResilienceConfig",
    "RetryBudget",
]
