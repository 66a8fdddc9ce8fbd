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

The target may grow with the prompt:

- `lengthFactor` k > 0 (default 0: one target for every prompt): a request's target is
  max(target, k x its idle TTFT), the idle TTFT being what its whole prompt would take
  uncached on an idle pod (the calibrated prefill curve, plus the PD transfer). A flat
  target turns away every prompt whose own prefill is longer than the target even on an
  idle cluster; with k the long prompts are held to their own length instead (k = 1: no
  wait beyond computing the prompt; a service's "a long document may take longer").

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
from router.scheduling.metrics import DecisionCounts, SchedulerMetrics

#: Slack in comparing a prediction with its target: the prediction is a sum of costs, and
#: its rounding must not refuse a request predicted exactly at its idle TTFT (k = 1).
_SLACK_S: Final = 1e-6

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
    #: k in max(target, k x idle TTFT); 0 keeps one target for every prompt length.
    length_factor: float = 0.0


@dataclass(frozen=True, slots=True)
class Prediction:
    """A request's predicted TTFT on the pods the scheduler would choose, and its idle
    TTFT (its whole prompt uncached on an idle pod) that a length-aware target grows with."""

    ttft_s: float
    idle_s: float


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

    def target(self, costs: ServerCosts, idle_s: float = 0.0) -> float:
        """The server's target for a request of idle TTFT `idle_s` (0: no gate)."""
        config = self.config
        if not config.enabled or costs.slo_target_s <= 0:
            return 0.0
        return max(costs.slo_target_s, config.length_factor * idle_s)

    def _fits(self, costs: ServerCosts, prediction: Prediction | None) -> bool:
        return (
            prediction is None
            or prediction.ttft_s <= self.target(costs, prediction.idle_s) + _SLACK_S
        )

    def check(
        self, costs: ServerCosts, prediction: Prediction | None, counts: DecisionCounts
    ) -> None:
        """Raise the 429 when the prediction is beyond the request's target; the outcome
        goes to `counts` (the pick's: see `metrics.DecisionCounts`)."""
        if prediction is None:
            return
        target = self.target(costs, prediction.idle_s)
        if target <= 0:
            return
        if prediction.ttft_s > target + _SLACK_S:
            counts.slo["rejected"].inc()
            raise slo_rejection(prediction.ttft_s, target, self.config.retry_after_s)
        counts.slo["admitted"].inc()

    async def wait(
        self, costs: ServerCosts, predict: Callable[[], Prediction | None]
    ) -> None:
        """`action: queue`: hold the request until its prediction fits or time runs out
        (then `pick` rejects it)."""
        config = self.config
        if self.target(costs) <= 0 or config.action != "queue":
            return
        if self._fits(costs, predict()):
            return
        self.metrics.decisions.slo["queued"].inc()
        deadline = time.monotonic() + config.max_queue_wait_s
        while time.monotonic() < deadline:
            await asyncio.sleep(config.queue_poll_s)
            if self._fits(costs, predict()):
                return
