"""Helpers for tests against the fake API server: timing, polling, a running source."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from router.sources.kube_backoff import BackoffPolicy
from router.sources.kube_events import EventLimits
from router.sources.kube_informer import WatchTiming
from router.sources.kubernetes import KubernetesSource
from router.view import ClusterView

#: Production shapes, test-sized numbers: watches renewed within a minute, and a
#: backoff that starts at 50 ms and caps at 0.5 s so restarts take well under a second.
FAST_TIMING = WatchTiming(
    min_timeout_s=30,
    max_timeout_s=60,
    connect_timeout_s=1.0,
    read_grace_s=5.0,
    list_read_timeout_s=5.0,
    page_size=500,
    min_stream_s=0.2,
    backoff=BackoffPolicy(initial_s=0.05, cap_s=0.5, reset_after_s=5.0),
)
FAST_EVENTS = EventLimits(per_object_interval_s=60.0, burst=50, per_second=10.0)


async def wait_until(
    predicate: Callable[[], bool], within_s: float = 5.0, interval: float = 0.002
) -> float:
    """Poll until `predicate()` holds; return the seconds it took (fail after `within_s`)."""
    start = time.perf_counter()
    while not predicate():
        if time.perf_counter() - start > within_s:
            raise AssertionError(f"condition not met within {within_s}s")
        await asyncio.sleep(interval)
    return time.perf_counter() - start


@dataclass
class RunningSource:
    source: KubernetesSource
    view: ClusterView
    registry: CollectorRegistry
    task: asyncio.Task[None]

    def metric(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    def pod_names(self) -> set[str]:
        names: set[str] = set()
        for server in self.view.snapshot.servers.values():
            for ep in server.aggregated:
                names.add(ep.pod_name)
            for group in server.groups:
                names.update(ep.pod_name for ep in group.prefill + group.decode)
        return names

    def endpoint_keys(self) -> list[str]:
        """Every endpoint key in the snapshot, duplicates kept (to catch them)."""
        keys: list[str] = []
        for server in self.view.snapshot.servers.values():
            keys.extend(ep.key for ep in server.aggregated)
            for group in server.groups:
                keys.extend(ep.key for ep in group.prefill + group.decode)
        return keys


StartSource = Callable[..., Awaitable[RunningSource]]
