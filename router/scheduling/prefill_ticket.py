"""`PrefillTicket`: one sequential-PD prefill's predicted duration, from its dispatch to
its measured end (the pipeline makes one per PD decision with a Conductor cost or a
backlog; `backlog.py` keeps what every ticket dispatched).

Compiled (router/build.py): a plain class with `__slots__`, built on every PD decision.
"""

from __future__ import annotations

from collections.abc import Callable

from router.scheduling.backlog import PrefillBacklog
from router.scheduling.metrics import SchedulerMetrics
from router.scheduling.ttft_model import PrefillFit


class PrefillTicket:
    """One sequential-PD prefill's prediction, from dispatch to its measured end.

    Predicted duration = the pod's backlog (`backlog.py`; at least the engine's own
    waiting queue x the mean prefill, which counts other routers' requests too) + the fit
    of the uncached tokens + the pool pull. The measured duration feeds the
    prediction-error metrics, the fit (only when the pod had nothing in flight from this
    router and nothing waiting in the engine: the sample is then pure service time) and
    the backlog's correction."""

    __slots__ = (
        "_backlog", "_calibrates", "_clean", "_clock", "_end", "_fit", "_idle", "_key",
        "_metrics", "_pull_s", "_sent", "_service_s", "compute", "predicted",
    )

    def __init__(
        self, fit: PrefillFit, metrics: SchedulerMetrics, backlog: PrefillBacklog,
        clock: Callable[[], float], key: str, compute: float, pull_s: float, idle: bool,
        now: float, others_s: float, calibrates: bool,
    ) -> None:
        self._fit, self._metrics, self._backlog, self._clock = fit, metrics, backlog, clock
        self._key, self.compute, self._pull_s, self._idle = key, compute, pull_s, idle
        self._calibrates = calibrates
        self._clean = idle and others_s <= 0.0
        self._service_s = fit.predict(compute) + pull_s
        wait = max(0.0 if idle else backlog.wait_s(key, now), others_s)
        self.predicted = wait + self._service_s
        self._sent = now
        self._end = now + self.predicted

    def dispatch(self) -> None:
        """The request goes to the pod: its service joins the pod's backlog."""
        self._end = self._backlog.dispatch(self._key, self._service_s, self._sent, self._idle)

    def dispatch_for(self, origin: str) -> None:
        """The pick was made for another router process's request (the sync's leader
        placing its new prompt): its service joins that process's part of the pod's
        backlog until that process reports its own (`PrefillBacklog.add_remote`)."""
        self._backlog.add_remote(origin, self._key, self._service_s, self._sent)

    def failed(self) -> None:
        """The prefill ended now without a KV handle: the pod is no longer busy with it."""
        self._backlog.finished(self._key, self._end, self._clock())

    def done(self, seconds: float) -> None:
        """The prefill took `seconds` (from sending it to its KV handle)."""
        self._backlog.finished(self._key, self._end, self._clock())
        if not self._calibrates:
            return
        self._fit.observe_error(self.predicted, seconds)
        self._metrics.observe_prefill(self.predicted, seconds)
        if self._clean:
            self._fit.add_sample(self.compute, seconds - self._pull_s)
