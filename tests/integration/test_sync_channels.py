"""`router.sync` over its real channels, without routers around it: a host of two workers
(Unix datagrams) peered with a second host (ZMQ over TCP on loopback). A prompt routed
on one worker reaches the sibling worker and, relayed by worker 0, the peer host; the
peer's in-flight count comes back the other way."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from router.load import InFlight
from router.resilience.config import ResilienceConfig
from router.resilience.ejection import OutlierDetector
from router.scheduling.approx_index import ApproximatePrefixIndex
from router.scheduling.backlog import PrefillBacklog
from router.scheduling.metrics import SchedulerMetrics
from router.scheduling.metrics_scraper import EngineMetricsStore, MetricsScraper
from router.sync import SyncConfig, SyncNode
from router.view import ClusterView, Endpoint
from tests.integration.harness import loopback_net
from tests.polling import eventually

NET = loopback_net()
SYNC_PORT = 5601
POD = Endpoint(namespace="default", pod_name="a", ip="127.0.0.1", port=8000, role="decode",
               group="g0")


class Process:
    """One router process's state and its sync node."""

    def __init__(self, config: SyncConfig) -> None:
        registry = CollectorRegistry()
        self.inflight = InFlight(registry)
        self.approx = ApproximatePrefixIndex()
        engines = EngineMetricsStore()
        self.node = SyncNode(
            config, inflight=self.inflight, backlog=PrefillBacklog(),
            outliers=OutlierDetector(ResilienceConfig()), approx=self.approx,
            engines=engines, scraper=MetricsScraper(engines, SchedulerMetrics(registry)),
            view=ClusterView(), registry=registry,
        )
        self.node._endpoints = {POD.key: POD}


@pytest.fixture
async def processes(tmp_path: Path) -> AsyncIterator[list[Process]]:
    host_a, host_b = f"{NET}.1", f"{NET}.2"
    configs = [
        SyncConfig(host_id="a", worker=w, workers=2, run_dir=str(tmp_path),
                   sync_port=SYNC_PORT, sync_host=host_a, peers=(f"{host_b}:{SYNC_PORT}",))
        for w in (0, 1)
    ] + [SyncConfig(host_id="b", sync_port=SYNC_PORT, sync_host=host_b,
                    peers=(f"{host_a}:{SYNC_PORT}",))]
    procs = [Process(c) for c in configs]
    tasks = [asyncio.create_task(p.node.run()) for p in procs]
    try:
        await eventually(lambda: all(len(p.node.peers()) == 2 for p in procs))
        yield procs
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_routes_and_counts_cross_workers_and_hosts(processes: list[Process]) -> None:
    a0, a1, b = processes
    hashes = [101, 202, 303]
    a1.approx.record(POD.key, hashes)  # worker 1: reaches worker 0, which relays to b
    await eventually(lambda: a0.approx.match([POD.key], hashes) == [3])
    await eventually(lambda: b.approx.match([POD.key], hashes) == [3])
    b.inflight.acquire(POD)
    await eventually(lambda: a0.inflight.get(POD) == 1 and a1.inflight.get(POD) == 1)
    b.inflight.release(POD)
    await eventually(lambda: a0.inflight.get(POD) == 0 and a1.inflight.get(POD) == 0)
