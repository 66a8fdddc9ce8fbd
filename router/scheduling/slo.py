"""TTFT-SLO admission (Mooncake Conductor's early rejection), off by default.

Each ModelServer may have a TTFT target (`sloAdmission.ttftTarget`, per server the
annotation `pdgate.io/ttft-slo: "2s"`). When the scheduler's best predicted TTFT for a
request (the chosen pair's cost: queue + prefill of what is not cached or pull from the
pool + transfer, `pipeline.py`) is beyond the target, the request is not sent:

- `action: reject`: a 429 OpenAI error (`code: ttft_slo`) with `Retry-After` = how far
  the prediction is over the target, rounded up, at least `retryAfter`; nothing was
  dispatched, so no counter moves and the pods' queues do not grow;
- `action: queue`: the request waits (in `prepare`, before `pick`), re-predicting every
  `queuePoll`, until the prediction fits or `maxQueueWait` runs out (then the 429).
  Queueing predicts once more per poll (a dry run of the pick), so it costs CPU only while
  the server is over its target.

Only `ttft`-unit profiles predict a TTFT; with `score` units the gate admits everything.
Counted in `pdgate_scheduler_slo_admission_total{outcome}` (admitted, rejected, queued).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal

from router.errors import APIError
from router.scheduling.context import ServerCosts
from router.scheduling.metrics import SchedulerMetrics

SLOAction = Literal["reject", "queue"]
SLO_ACTIONS: Final = ("reject", "queue")


@dataclass(frozen=True, slots=True)
class SLOConfig:
    """`sloAdmission` in the scheduler config."""

    enabled: bool = False
    #: Default TTFT target of every ModelServer, seconds (0: none; annotation overrides).
    ttft_target_s: float = 0.0
    action: str = "reject"
    retry_after_s: float = 1.0
    max_queue_wait_s: float = 2.0
    queue_poll_s: float = 0.05


def slo_rejection(predicted: float, target: float, retry_after_s: float) -> APIError:
    retry = max(math.ceil(retry_after_s), math.ceil(predicted - target), 1)
    return APIError(
        429,
        f"The predicted time to first token ({predicted:.2f} s) is beyond this model's "
        f"target ({target:.2f} s); retry later.",
        type="rate_limit_exceeded",
        code="ttft_slo",
        headers={"retry-after": str(retry)},
    )


class SLOGate:
    """The gate `PipelineScheduler.pick` consults; `config` is swapped on reload."""

    def __init__(self, config: SLOConfig, metrics: SchedulerMetrics) -> None:
        self.config = config
        self.metrics = metrics

    def target(self, costs: ServerCosts) -> float:
        return costs.slo_target_s if self.config.enabled else 0.0

    def check(self, costs: ServerCosts, predicted: float | None) -> None:
        """Raise the 429 when `predicted` is beyond the server's target."""
        target = self.target(costs)
        if target <= 0 or predicted is None:
            return
        if predicted > target:
            self.metrics.slo["rejected"].inc()
            raise slo_rejection(predicted, target, self.config.retry_after_s)
        self.metrics.slo["admitted"].inc()

    async def wait(
        self, costs: ServerCosts, predict: Callable[[], float | None]
    ) -> None:
        """`action: queue`: hold the request until its prediction fits or time runs out
        (then `pick` rejects it)."""
        config = self.config
        target = self.target(costs)
        if target <= 0 or config.action != "queue":
            return
        predicted = predict()
        if predicted is None or predicted <= target:
            return
        self.metrics.slo["queued"].inc()
        deadline = time.monotonic() + config.max_queue_wait_s
        while time.monotonic() < deadline:
            await asyncio.sleep(config.queue_poll_s)
            predicted = predict()
            if predicted is None or predicted <= target:
                return
