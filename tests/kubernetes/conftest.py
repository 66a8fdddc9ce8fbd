"""Fixtures: a fake API server on loopback, a kubeconfig for it, and a running source.

Reusable by other suites (e.g. an end-to-end "pod churn during traffic" test): take
`fake_apiserver` for the server and `kubeconfig` for the file the real client loads, or
`start_source` to run a KubernetesSource feeding a fresh ClusterView (helpers such as
`wait_until` live in kube_testkit).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from fake_apiserver import FakeApiServer
from kube_testkit import FAST_EVENTS, FAST_TIMING, RunningSource, StartSource, wait_until
from prometheus_client import CollectorRegistry

from router.sources.kubernetes import KubernetesSource
from router.view import ClusterView


@pytest.fixture
async def fake_apiserver() -> AsyncIterator[FakeApiServer]:
    server = FakeApiServer(bookmark_interval=0.5)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
def kubeconfig(fake_apiserver: FakeApiServer, tmp_path: Path) -> Path:
    return fake_apiserver.write_kubeconfig(tmp_path / "kubeconfig")


@pytest.fixture
async def start_source(kubeconfig: Path) -> AsyncIterator[StartSource]:
    """`await start_source(namespace="default", **kwargs)`: a synced, running source."""
    running: list[RunningSource] = []

    async def start(
        namespace: str | None = "default", *, wait_synced: bool = True, **kwargs: object
    ) -> RunningSource:
        kwargs.setdefault("timing", FAST_TIMING)
        kwargs.setdefault("event_limits", FAST_EVENTS)
        registry = CollectorRegistry()
        source = KubernetesSource(namespace, str(kubeconfig), registry, **kwargs)  # type: ignore[arg-type]
        view = ClusterView()
        task = asyncio.create_task(source.run(view))
        handle = RunningSource(source, view, registry, task)
        running.append(handle)
        if wait_synced:
            await wait_until(lambda: source.synced or task.done())
            if task.done():
                task.result()
        return handle

    yield start
    for handle in running:
        handle.task.cancel()
    for handle in running:
        try:
            await handle.task
        except asyncio.CancelledError:
            pass
