"""Everything one router process holds, built once and passed in (no module globals)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from prometheus_client import CollectorRegistry, generate_latest

from router.busy_poll import BusyPoll
from router.config_watch import ConfigWatch
from router.errors import APIError
from router.load import InFlight
from router.metrics import RouterMetrics
from router.proxy import Proxy
from router.resilience import Resilience, ResilienceConfig
from router.routing import lora_name_of
from router.scheduling import Scheduler, ScheduleRequest
from router.scheduling.runtime import build_scheduler
from router.security import Security, SecurityConfig
from router.sources.base import Source
from router.sources.kube_events import EventRecorder, model_server_notifier
from router.supervise import kept_running
from router.sync import SyncConfig, SyncNode
from router.sync.exposition import WorkerMetrics
from router.tracing import tracing_from_env
from router.upstream import Upstream
from router.view import ClusterView, Snapshot

log = logging.getLogger("pdgate.state")

#: Seconds a router waits, at start, for its view and its tokenizers: a worker of several
#: (`--workers N`) before it accepts connections, a single process before `/readyz` says
#: ready. After that it serves (and says ready) anyway, logged.
WARM_UP_TIMEOUT_S: Final = 60.0


@dataclass(slots=True)
class RouterConfig:
    """How a router process is wired: where objects come from, how pods are chosen."""

    config_dir: Path | None = None
    kubernetes: bool = False
    namespace: str | None = None
    kubeconfig: str | None = None
    scheduler_config: Path | None = None
    extra_sources: list[Source] = field(default_factory=list)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    #: State shared with other workers and replicas (`router.sync`); None: this one only.
    sync: SyncConfig | None = None
    #: Keep the loop polling this long after the last request in flight (0: off;
    #: `router.busy_poll`).
    busy_poll_s: float = 0.0


class AppState:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.registry = CollectorRegistry()
        self.metrics = RouterMetrics(self.registry)
        self.view = ClusterView()
        self.config_watch = ConfigWatch(self.view, self.registry, lambda: self.synced)
        self.inflight = InFlight(self.registry)
        self.upstream = Upstream()
        self.scheduler_runtime = build_scheduler(
            config.scheduler_config, self.inflight, self.view, self.registry
        )
        self.scheduler: Scheduler = self.scheduler_runtime.scheduler
        self.resilience = Resilience(
            config.resilience, self.view, self.upstream.probe, self.registry
        )
        self.scheduler_runtime.set_ejection_hook(self.resilience.is_ejected)
        drain = self.resilience.drain
        self.busy_poll = BusyPoll(config.busy_poll_s, lambda: drain.active)
        self.security = Security(config.security, self.view, self.registry)
        self.tracing = tracing_from_env()
        self.proxy = Proxy(
            self.view, self.scheduler, self.inflight, self.upstream, self.metrics,
            outliers=self.resilience.outliers, limiter=self.security.rate_limiter,
            retry_budget=self.resilience.retry_budget, tracing=self.tracing,
        )
        self.sync = None if config.sync is None else SyncNode(
            config.sync, inflight=self.inflight, backlog=self.scheduler_runtime.deps.backlog,
            outliers=self.resilience.outliers,
            approx=self.scheduler_runtime.approx, engines=self.scheduler_runtime.engines,
            scraper=self.scheduler_runtime.scraper, view=self.view, registry=self.registry,
            prefilling=self.scheduler_runtime.deps.inflight_prefixes,
        )
        if self.sync is not None:  # new prompts are placed by the sync's leader
            self.sync.placer = self._place_for_peer
            self.scheduler_runtime.deps.place = self.sync.place
            self.scheduler_runtime.deps.catch_up = self.sync.catch_up
        #: `--workers N`: this worker's metrics for its siblings, and theirs for a scrape.
        self.worker_metrics = (
            WorkerMetrics(config.sync, self.render_metrics)
            if config.sync is not None and config.sync.workers > 1 else None
        )
        self.sources: list[Source] = list(config.extra_sources)
        self.started_at = time.time()
        #: The first view is in and its tokenizers loaded (or given up on): `_warm_up`.
        self.warm = False
        self._tasks: list[asyncio.Task[None]] = []
        self.view.subscribe(self._on_snapshot)

    def _place_for_peer(
        self, asker: str, server: str, model: str, path: str, flow: str,
        body: Mapping[str, Any],
    ) -> tuple[str, ...] | None:
        """As the sync's leader, pick the pods for another process's new prompt (as for a
        request of its own: recorded in the index, but neither shared nor counted in the
        decision metrics, which the asker's own pick does) and count the request in flight
        on them for `asker` until its own report arrives. (Its prefill joins the pod's
        backlog as the asker's in the pick itself, which `ScheduleRequest.asker` tells.)
        None: unknown server, no pod, or refused by the SLO gate (the asker then decides,
        and gates, itself)."""
        namespace, _, name = server.partition("/")
        snapshot = self.view.snapshot
        pods = snapshot.servers.get((namespace, name))
        if pods is None:
            return None
        route = snapshot.routes_by_model.get(model)
        lora = None if route is None else lora_name_of(route, model)
        try:
            request = ScheduleRequest(model, path, dict(body), {}, flow=flow, asker=asker,
                                      lora_name=lora)
            pick = self.scheduler.pick(pods, request, frozenset())
        except APIError:
            return None
        if pick is None:
            return None
        for endpoint in pick.endpoints:
            self.inflight.add_remote(asker, endpoint.key)
        return tuple(endpoint.key for endpoint in pick.endpoints)

    def _on_snapshot(self, snapshot: Snapshot) -> None:
        self.inflight.forget_absent(set(snapshot.endpoints()))
        self.metrics.ambiguous_pods.set(snapshot.ambiguous_pods)
        self.metrics.retain_models(snapshot.routes_by_model)

    @property
    def draining(self) -> bool:
        return self.resilience.drain.draining

    @property
    def synced(self) -> bool:
        return bool(self.sources) and all(source.synced for source in self.sources)

    @property
    def ready(self) -> bool:
        return self.synced and self.warm and not self.draining

    def refresh_gauges(self) -> None:
        self.metrics.ready.set(1 if self.ready else 0)

    def render_metrics(self) -> bytes:
        """This process's own exposition."""
        self.refresh_gauges()
        return generate_latest(self.registry)

    async def metrics_exposition(self) -> bytes:
        """What `/metrics` answers: this process's, or with `--workers N` every worker's."""
        if self.worker_metrics is not None:
            return await self.worker_metrics.gather()
        return self.render_metrics()

    async def start(self) -> None:
        if self.config.config_dir is not None:
            from router.sources.files import FileSource

            self.sources.append(FileSource(self.config.config_dir, registry=self.registry))
        if self.config.kubernetes:
            from router.sources.kubernetes import KubernetesSource

            self.sources.append(
                KubernetesSource(
                    namespace=self.config.namespace,
                    kubeconfig=self.config.kubeconfig,
                    registry=self.registry,
                )
            )
        for source in self.sources:  # tokenizer mismatches become Kubernetes Events too
            recorder = getattr(source, "recorder", None)
            if isinstance(recorder, EventRecorder):
                self.scheduler_runtime.parity.set_notifier(model_server_notifier(recorder))
        for source in self.sources:
            self._tasks.append(asyncio.create_task(source.run(self.view)))
        self._tasks.append(asyncio.create_task(self.config_watch.run()))
        self._tasks.append(asyncio.create_task(self.scheduler_runtime.run()))
        self._tasks.append(asyncio.create_task(self.resilience.run()))
        self._tasks.append(asyncio.create_task(self.security.run()))
        if self.busy_poll.enabled:
            self._tasks.append(asyncio.create_task(self.busy_poll.run()))
        if self.sync is not None:
            self._tasks.append(asyncio.create_task(kept_running("state sync", self.sync.run)))
        if self.worker_metrics is not None:
            self._tasks.append(asyncio.create_task(self.worker_metrics.serve()))
        if self.config.sync is not None and self.config.sync.workers > 1:
            await self._warm_up()
        else:
            self._tasks.append(asyncio.create_task(self._warm_up()))

    async def _warm_up(self) -> None:
        """Wait for the first view and its tokenizers, then count as warm (`ready`).

        Until a ModelServer's tokenizer is loaded its precise prefix-cache scoring falls
        back to the approximate index, and the load (a second or more holding the GIL)
        stalls the event loop: a router that said ready at once took traffic it could
        neither score nor serve promptly. Only the first view is waited for: a tokenizer
        loaded later (a new ModelServer) must not take every replica out of its Service
        at once. A worker of several (`--workers N`) awaits this before its SO_REUSEPORT
        socket listens (`router.sync.workers.reuseport_socket`), since the kernel hands
        connections to any listening worker, ready or not. Bounded: after
        `WARM_UP_TIMEOUT_S` the router serves and says ready anyway.
        """
        try:
            async with asyncio.timeout(WARM_UP_TIMEOUT_S):
                while not self.synced:  # noqa: ASYNC110 - sources signal no event
                    await asyncio.sleep(0.05)
                await self.scheduler_runtime.tokenizers.wait_loaded()
        except TimeoutError:
            log.warning("not warm after %.0f s (view synced: %s): serving anyway",
                        WARM_UP_TIMEOUT_S, self.synced)
        self.warm = True

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.security.close()
        await self.upstream.close()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # flushes the last spans
