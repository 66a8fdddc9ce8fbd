"""Kubernetes Events about objects pdgate refused, so `kubectl describe` shows why.

Best effort and never in the way: `record` only enqueues (a bounded queue; full means
dropped), one object's same complaint is posted at most once per interval, a token bucket
caps the total rate, and a failed POST (say, RBAC without `create events`) is counted
and logged once, not retried.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from router.resources import API_VERSION, ModelServer
from router.sources.kube_metrics import KubeMetrics

log = logging.getLogger(__name__)

COMPONENT = "pdgate"
MAX_MESSAGE = 1024  # the API server rejects longer Event messages


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """The `involvedObject` of an Event."""

    kind: str
    api_version: str
    namespace: str
    name: str
    uid: str = ""
    resource_version: str = ""


@dataclass(frozen=True, slots=True)
class EventLimits:
    queue_size: int = 64
    per_object_interval_s: float = 600.0  # same object + reason: once per 10 min
    burst: int = 10
    per_second: float = 1 / 6  # refill of the global token bucket
    remembered: int = 1024  # (object, reason) pairs kept for the per-object limit


Post = Callable[[str, dict[str, Any]], Awaitable[None]]


class EventRecorder:
    """Queues Warning Events and posts them from `run`, within the limits."""

    def __init__(
        self,
        metrics: KubeMetrics,
        limits: EventLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._metrics = metrics
        self._limits = limits or EventLimits()
        self._clock = clock
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(self._limits.queue_size)
        self._last_sent: OrderedDict[tuple[str, str, str, str], float] = OrderedDict()
        self._tokens = float(self._limits.burst)
        self._refilled = clock()
        self._failure_logged = False
        self._host = socket.gethostname()

    def record(self, ref: ObjectRef, reason: str, message: str) -> bool:
        """Enqueue a Warning Event about `ref`; False if it was rate-limited or dropped."""
        key = (ref.kind, ref.namespace, ref.name, reason)
        now = self._clock()
        last = self._last_sent.get(key)
        if (last is not None and now - last < self._limits.per_object_interval_s) or (
            not self._take_token(now)
        ):
            self._metrics.events.labels("rate_limited").inc()
            return False
        try:
            self._queue.put_nowait(self._event(ref, reason, message))
        except asyncio.QueueFull:
            self._metrics.events.labels("dropped").inc()
            return False
        self._last_sent[key] = now
        self._last_sent.move_to_end(key)
        while len(self._last_sent) > self._limits.remembered:
            self._last_sent.popitem(last=False)
        return True

    async def run(self, post: Post) -> None:
        """Post queued Events until cancelled."""
        while True:
            event = await self._queue.get()
            namespace = event["metadata"]["namespace"]
            try:
                await post(namespace, event)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._metrics.events.labels("failed").inc()
                if not self._failure_logged:
                    self._failure_logged = True
                    log.warning("cannot post Kubernetes Events (%s); counting failures only",
                                exc)
            else:
                self._metrics.events.labels("posted").inc()

    def _take_token(self, now: float) -> bool:
        limits = self._limits
        self._tokens = min(
            float(limits.burst), self._tokens + (now - self._refilled) * limits.per_second
        )
        self._refilled = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def _event(self, ref: ObjectRef, reason: str, message: str) -> dict[str, Any]:
        now = datetime.now(UTC)
        stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        involved: dict[str, Any] = {
            "apiVersion": ref.api_version,
            "kind": ref.kind,
            "namespace": ref.namespace,
            "name": ref.name,
        }
        if ref.uid:
            involved["uid"] = ref.uid
        if ref.resource_version:
            involved["resourceVersion"] = ref.resource_version
        return {
            "apiVersion": "v1",
            "kind": "Event",
            # client-go names Events "<object>.<unix nanos in hex>".
            "metadata": {"name": f"{ref.name}.{time.time_ns():x}", "namespace": ref.namespace},
            "involvedObject": involved,
            "reason": reason,
            "message": message[:MAX_MESSAGE],
            "type": "Warning",
            "source": {"component": COMPONENT, "host": self._host},
            "reportingComponent": COMPONENT,
            "reportingInstance": self._host,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }


def model_server_notifier(recorder: EventRecorder) -> Callable[[ModelServer, str, str], None]:
    """A Warning Event on a ModelServer, for notices from outside the source (tokenizer
    parity, `router.tokenization.parity`), within the recorder's limits."""

    def notify(server: ModelServer, reason: str, message: str) -> None:
        meta = server.meta
        ref = ObjectRef(
            "ModelServer", API_VERSION, meta.namespace, meta.name, meta.uid,
            meta.resource_version,
        )
        recorder.record(ref, reason, message)

    return notify
