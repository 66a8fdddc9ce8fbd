"""The reliability layer one router holds: outlier ejection, health checks, admission, drain,
and the retry budget.

`Resilience` is built once by `AppState` and passed to whoever needs a part of it; its
`run()` is the background work (health checks and readmission probes). Give the scheduler
`resilience.is_ejected` as its ejection hook.
"""

from __future__ import annotations

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
        await self.health.run()

    def _on_snapshot(self, snapshot: Snapshot) -> None:
        self.outliers.forget_absent(snapshot.endpoints())


__all__ = [
    "Admission", "Drain", "HealthChecker", "OutlierDetector", "Resilience", "ResilienceConfig",
    "RetryBudget",
]
