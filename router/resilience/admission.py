"""Admission control: a global and a per-model bound on requests in flight, a bounded queue.

uvicorn's own `--limit-concurrency` answers a plain-text 503, so the bound lives here and
answers an OpenAI error with `Retry-After`. A request that finds no room waits in one FIFO
queue of at most `max_queue` requests for up to `queue_timeout_s`; a full queue or a wait
that runs out is a 503. A waiter for a model at its own bound does not hold up waiters of
other models. The fast path (room, nobody waiting) is two integer checks.

The global bound is on by default: unless `max_inflight` is given (0: unbounded) it is
`inflight_per_pod` x the pods that serve answers (aggregated and decode pods of the view),
re-sized on every snapshot, and under it an adaptive limit (`loop_lag.py`) follows the
router's own event-loop lag. `saturated()` lets the caller refuse before parsing a body.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge

from router.errors import APIError, service_unavailable
from router.resilience.config import ResilienceConfig
from router.resilience.loop_lag import LoopLagLimit

#: `Retry-After` of a request shed at a full bound with a full queue: at the load that
#: fills the bound, slots free within about a second.
SHED_RETRY_AFTER_S = 1
SATURATED_MESSAGE = "The server is at capacity; retry later."


@dataclass(slots=True)
class _Waiter:
    model: str
    future: asyncio.Future[None]


#: Why admission refuses a request (the `reason` label's values).
REJECT_REASONS: Final = ("queue_full", "queue_timeout")


class Admission:
    """Counts admitted requests; see the module docstring."""

    def __init__(self, config: ResilienceConfig, registry: CollectorRegistry | None = None
                 ) -> None:
        explicit = config.max_inflight
        #: The bound in force (0: unbounded): `min(ceiling, adaptive limit)`.
        self.max_inflight = explicit or 0
        #: The bound the pods allow (or the one given); 0 until the pods are known.
        self.ceiling = self.max_inflight
        self.sized_from_pods = explicit is None
        self.inflight_per_pod = config.inflight_per_pod
        self.max_per_model = config.max_inflight_per_model
        self.max_queue = config.max_queue
        self.queue_timeout_s = config.queue_timeout_s
        self.enabled = explicit != 0 or self.max_per_model > 0
        self.inflight = 0
        self.adaptive = LoopLagLimit(
            config.loop_lag_target_s if explicit != 0 else 0.0, config.min_inflight,
            self.ceiling, lambda: self.inflight, self._bound_changed,
        )
        #: Admitted requests per model; models are names the view knows (bounded by it).
        self.per_model: dict[str, int] = {}
        self._waiters: deque[_Waiter] = deque()
        self._retry_after = max(1, math.ceil(self.queue_timeout_s))
        self._saturated = service_unavailable(SATURATED_MESSAGE, retry_after=SHED_RETRY_AFTER_S)
        self._rejected: Counter | None = None
        #: The rejected counter's child per reason (a fixed handful of reasons).
        self._rejected_by: dict[str, Counter] = {}
        self._queued: Gauge | None = None
        if registry is not None:
            self._rejected = Counter(
                "pdgate_admission_rejected", "Requests refused by admission control, by why.",
                ["reason"], registry=registry,
            )
            for reason in REJECT_REASONS:  # at 0 from the start: a rate reads 0, not nothing
                self._rejected_by[reason] = self._rejected.labels(reason=reason)
            self._queued = Gauge(
                "pdgate_admission_queue", "Requests waiting for admission.", registry=registry
            )
            # Read at each scrape, never written on the request path.
            Gauge("pdgate_admission_inflight", "Requests admitted and not yet done.",
                  registry=registry).set_function(lambda: self.inflight)
            Gauge("pdgate_admission_limit",
                  "Requests admitted at most at once: the pods' ceiling or, below it, the "
                  "adaptive limit (0: no bound).",
                  registry=registry).set_function(lambda: self.max_inflight)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def size_for(self, serving_pods: int) -> None:
        """Re-size a pod-sized bound: `inflight_per_pod` x the pods that serve answers
        (at least one pod's worth, so that a router with no pods yet still bounds)."""
        if not self.sized_from_pods:
            return
        self.ceiling = self.inflight_per_pod * max(1, serving_pods)
        self.adaptive.set_ceiling(self.ceiling)
        self._bound_changed()

    async def run(self) -> None:
        """Keep the adaptive limit current (returns at once when it is off)."""
        await self.adaptive.run()

    def saturated(self) -> bool:
        """Whether a new request would be refused at once (bound reached, queue full):
        lets the caller answer 503 before it reads or parses anything more."""
        bound = self.max_inflight
        return bool(bound) and self.inflight >= bound and len(self._waiters) >= self.max_queue

    def refuse_saturated(self) -> APIError:
        """Count a request shed at the full bound and return its 503: one error object for
        every such refusal (answered, never raised), so that the connection layer encodes
        its answer once and writes those bytes again (`router/http/protocol.py`)."""
        self._count("queue_full")
        return self._saturated

    def _bound_changed(self) -> None:
        ceiling = self.ceiling
        limit = self.adaptive.limit if self.adaptive.target_s > 0 else ceiling
        self.max_inflight = min(ceiling, limit) if ceiling else 0
        if self._waiters:
            self._wake()

    def _fits(self, model: str) -> bool:
        if self.max_inflight and self.inflight >= self.max_inflight:
            return False
        return not (self.max_per_model and self.per_model.get(model, 0) >= self.max_per_model)

    def _take(self, model: str) -> None:
        self.inflight += 1
        if self.inflight == 1:
            self.adaptive.wake()  # the first in flight: the lag sampler runs again
        if self.max_per_model:
            self.per_model[model] = self.per_model.get(model, 0) + 1

    def try_enter(self, model: str) -> bool:
        """Admit at once if there is room and nobody is waiting ahead."""
        if self._waiters or not self._fits(model):
            return False
        self._take(model)
        return True

    async def wait(self, model: str) -> None:
        """Queue for a slot; raises a 503 `APIError` when the queue is full or time runs out."""
        if len(self._waiters) >= self.max_queue:
            raise self._refuse("queue_full", SATURATED_MESSAGE,
                               SHED_RETRY_AFTER_S if not self.max_queue else None)
        waiter = _Waiter(model, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self._gauge()
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await waiter.future
        except TimeoutError:
            if waiter.future.done() and not waiter.future.cancelled():
                return  # admitted in the loop turn the deadline fired in: the slot is ours
            self._drop(waiter)
            raise self._refuse("queue_timeout", SATURATED_MESSAGE) from None
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.leave(model)  # admitted as we were cancelled: pass the slot on
            else:
                self._drop(waiter)
            raise

    def leave(self, model: str) -> None:
        """Release one admitted request and wake whoever now fits."""
        self.inflight -= 1
        if self.max_per_model:
            left = self.per_model.get(model, 0) - 1
            if left > 0:
                self.per_model[model] = left
            else:
                self.per_model.pop(model, None)
        if self._waiters:
            self._wake()

    def _wake(self) -> None:
        for waiter in list(self._waiters):
            if self.max_inflight and self.inflight >= self.max_inflight:
                break
            if waiter.future.done():
                self._waiters.remove(waiter)
                continue
            if self._fits(waiter.model):
                self._waiters.remove(waiter)
                self._take(waiter.model)
                waiter.future.set_result(None)
        self._gauge()

    def _drop(self, waiter: _Waiter) -> None:
        if waiter in self._waiters:
            self._waiters.remove(waiter)
        self._gauge()

    def _refuse(self, reason: str, message: str, retry_after: int | None = None) -> APIError:
        self._count(reason)
        return service_unavailable(message, retry_after=retry_after or self._retry_after)

    def _count(self, reason: str) -> None:
        if self._rejected is None:
            return
        child = self._rejected_by.get(reason)
        if child is None:
            child = self._rejected_by[reason] = self._rejected.labels(reason=reason)
        child.inc()

    def _gauge(self) -> None:
        if self._queued is not None:
            self._queued.set(len(self._waiters))
