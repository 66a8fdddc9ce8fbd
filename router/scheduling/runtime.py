"""The one entry point the app uses: `build_scheduler(...)` -> `SchedulerRuntime`.

    runtime = build_scheduler(config_path, inflight, view, registry, rng=None,
                              is_ejected=None)
    proxy = Proxy(view, runtime.scheduler, ...)        # the Scheduler protocol
    task = asyncio.create_task(runtime.run())          # scraper, KV events, config reload
    ...
    task.cancel()                                      # stops and closes everything

- `config_path`: the scheduler YAML (`pdgate serve --scheduler-config`), hot-reloaded;
  None runs on the defaults (`config.DEFAULT_PROFILES`). An invalid file at start raises
  `SchedulerConfigError`; an invalid edit later is logged and ignored.
- `inflight`: the proxy's `InFlight` counters (read by `least-request` and the guard).
- `view`: the `ClusterView`; the runtime subscribes, so pods that leave lose their index
  entries, metrics and event subscriptions.
- `registry`: where the scheduler's metrics go (`metrics.SchedulerMetrics`).
- `rng`: every random choice (ties, the `random` scorer); seed it for reproducible runs.
- `is_ejected(pod_key) -> bool`: the reliability layer's ejection hook (default: never);
  also settable later with `runtime.set_ejection_hook`.
- `tokenize(path, body) -> token ids | None`: overrides the ModelServers' own
  tokenizers (`router.tokenization`, annotation `pdgate.io/tokenizer`) for the precise
  index (see `block_hash.py` for the contract).

Next to the tokenizer registry: `runtime.parity` (`router.tokenization.parity`) probes
every engine's `/tokenize` against the router's tokens when its pod appears and every
`PARITY_INTERVAL_S` (one of the background jobs; `parity.set_notifier` sends mismatch
notices to the Kubernetes Event recorder), and `runtime.fallback`
(`router.scheduling.fallback`) tells the precise scorer which ModelServers to score with
the approximate index instead.

`runtime.background()` lists the coroutine factories `run()` runs, for an app that
prefers to supervise them itself.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from router.kvhash.keyspace import KeySpace
from router.load import InFlight
from router.scheduling.approx_index import ApproximatePrefixIndex
from router.scheduling.block_hash import PreciseHasher, TokenSource
from router.scheduling.config import SchedulerConfig, key_settings, load_scheduler_config
from router.scheduling.context import LoadEstimator, SchedulerDeps, SessionTable
from router.scheduling.fallback import PreciseFallback
from router.scheduling.filters import never_ejected
from router.scheduling.kv_events import KVEventsManager, StreamSettings
from router.scheduling.metrics import SchedulerMetrics
from router.scheduling.metrics_scraper import (
    EngineMetricsStore,
    MetricsScraper,
    ScrapeSettings,
)
from router.scheduling.pipeline import PipelineScheduler
from router.scheduling.pool_view import PoolView, pool_writers
from router.scheduling.precise_index import PrecisePrefixIndex
from router.scheduling.ttft_model import TTFTModels
from router.scheduling.watcher import SchedulerConfigWatcher
from router.supervise import RESTART_DELAY_S, kept_running
from router.tokenization import TokenizePool, TokenizerRegistry
from router.tokenization.parity import ParityProber
from router.view import ClusterView, Snapshot

BackgroundFactory = Callable[[], Coroutine[Any, Any, None]]


def _scrape_settings(config: SchedulerConfig) -> ScrapeSettings:
    m = config.engine_metrics
    return ScrapeSettings(
        m.interval_s, m.timeout_s, m.stale_after_intervals, m.max_concurrency, m.enabled
    )


def _stream_settings(config: SchedulerConfig) -> StreamSettings:
    p = config.precise_index
    return StreamSettings(replay_timeout_s=p.replay_timeout_s, replay_on_join=p.replay_on_join)


def _hasher(
    config: SchedulerConfig, tokenize: TokenSource | None, tokenizers: TokenizerRegistry
) -> PreciseHasher:
    space = KeySpace(key_settings(config.precise_index))
    return PreciseHasher(space, tokenize=tokenize, tokenizers=tokenizers)


class SchedulerRuntime:
    """The scheduler plus the background work that feeds it."""

    def __init__(
        self,
        config: SchedulerConfig,
        inflight: InFlight,
        view: ClusterView,
        registry: CollectorRegistry,
        rng: random.Random | None = None,
        is_ejected: Callable[[str], bool] | None = None,
        tokenize: TokenSource | None = None,
        config_path: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tokenize_pool = TokenizePool()
        self.metrics = SchedulerMetrics(registry, tokenize_cpu=self.tokenize_pool.cpu)
        self._tokenize = tokenize
        approx_cfg = config.approximate_index
        precise_cfg = config.precise_index
        self.approx = ApproximatePrefixIndex(
            approx_cfg.block_bytes, approx_cfg.chars_per_token,
            approx_cfg.default_capacity_tokens, approx_cfg.max_blocks_per_pod,
        )
        self.precise = PrecisePrefixIndex(
            precise_cfg.max_blocks_per_pod, precise_cfg.max_store_blocks, precise_cfg.store_media
        )
        self.engines = EngineMetricsStore()
        self.tokenizers = TokenizerRegistry()
        self.parity = ParityProber(self.tokenizers, registry)
        self.fallback = PreciseFallback(
            self.tokenizers, self.parity, registry, injected=tokenize is not None,
            enabled=lambda: self.config.uses("precise-prefix-cache"),
        )
        self.pools = PoolView()
        self.deps = SchedulerDeps(
            inflight=inflight,
            engines=self.engines,
            approx=self.approx,
            precise=self.precise,
            hasher=_hasher(config, tokenize, self.tokenizers),
            sessions=SessionTable.create(config.sessions.max_sessions),
            rng=rng or random.Random(),
            is_ejected=is_ejected or never_ejected,
            estimator=LoadEstimator(),
            tokenizers=self.tokenizers,
            tokenize_pool=self.tokenize_pool,
            pools=self.pools,
            ttft=TTFTModels(
                config.cost_model.seed(), config.ttft_model,
                on_new=self.metrics.track_fit, on_drop=self.metrics.untrack_fit,
            ),
            fallback=self.fallback,
        )
        #: The scheduler's clock (seconds): what its backlog and TTFT predictions count in.
        self.clock = clock
        self.scheduler = PipelineScheduler(config, self.deps, self.metrics, clock)
        self.scraper = MetricsScraper(
            self.engines, self.metrics, _scrape_settings(config),
            on_capacity=self.approx.set_capacity_tokens, clock=clock,
        )
        self.kv_events = KVEventsManager(
            self.precise, self.metrics, _stream_settings(config),
            events_port=precise_cfg.events_port, replay_port=precise_cfg.replay_port,
            enabled=config.precise_enabled, key_defaults=key_settings(precise_cfg),
        )
        self.watcher = (
            None
            if config_path is None
            else SchedulerConfigWatcher(
                config_path, self.apply_config, self.metrics, config.reload.interval_s
            )
        )
        self.metrics.track_index(
            "approximate", lambda: self.approx.total_blocks, self.approx.memory_bytes,
            lambda: self.approx.evictions,
        )
        self.metrics.track_index(
            "precise", lambda: self.precise.total_blocks, self.precise.memory_bytes,
            lambda: self.precise.overflow_evictions,
        )
        self.metrics.track_index(
            "pool", lambda: self.pools.total_blocks, self.pools.memory_bytes,
            lambda: self.pools.evictions,
        )
        self._view = view
        view.subscribe(self._on_snapshot)
        self._on_snapshot(view.snapshot)

    @property
    def config(self) -> SchedulerConfig:
        return self.scheduler.config

    def set_ejection_hook(self, is_ejected: Callable[[str], bool]) -> None:
        self.deps.is_ejected = is_ejected

    def _on_snapshot(self, snapshot: Snapshot) -> None:
        keys = set(snapshot.endpoints())
        self.tokenizers.on_snapshot(snapshot)
        self.parity.on_snapshot(snapshot)
        self.fallback.on_snapshot(snapshot)
        self.scheduler.forget_layouts()
        self.approx.retain(keys)
        self.deps.backlog.retain(keys)
        scopes = {f"{s.server.meta.namespace}/{s.server.meta.name}"
                  for s in snapshot.servers.values()}
        self.pools.retain_scopes(scopes)
        self.deps.ttft.retain_scopes(scopes)
        self.scraper.on_snapshot(snapshot)
        self.kv_events.on_snapshot(snapshot)
        self._set_pool_writers(snapshot)

    def _set_pool_writers(self, snapshot: Snapshot) -> None:
        pool = self.config.pool_view
        self.precise.set_pool_writers(
            pool_writers(snapshot.servers.values(), pool.enabled, pool.capacity_tokens)
        )

    def apply_config(self, config: SchedulerConfig) -> None:
        """Switch to a new config (what the watcher calls on a valid edit)."""
        old = self.scheduler.config
        self.scheduler.set_config(config)  # builds everything first: raises before any change
        a = config.approximate_index
        self.approx.reconfigure(
            a.block_bytes, a.chars_per_token, a.default_capacity_tokens, a.max_blocks_per_pod
        )
        p = config.precise_index
        self.precise.max_blocks_per_pod = p.max_blocks_per_pod
        self.precise.max_store_blocks = p.max_store_blocks
        self.precise.store_media = frozenset(p.store_media)
        keying = key_settings(p)
        if keying != key_settings(old.precise_index):
            self.deps.hasher = _hasher(config, self._tokenize, self.tokenizers)
            self.kv_events.set_key_defaults(keying)
        self.deps.sessions.max_sessions = config.sessions.max_sessions
        self.scraper.reconfigure(_scrape_settings(config))
        self.kv_events.settings = _stream_settings(config)
        ports = (p.events_port, p.replay_port)
        if ports != (self.kv_events.events_port, self.kv_events.replay_port):
            self.kv_events.events_port, self.kv_events.replay_port = ports
            self.kv_events.set_enabled(not config.precise_enabled)  # force a refresh
        self.kv_events.set_enabled(config.precise_enabled)
        if config.pool_view != old.pool_view:
            self._set_pool_writers(self._view.snapshot)
        self.fallback.check()

    def background(self) -> list[BackgroundFactory]:
        """The coroutines that keep the scheduler's inputs fresh."""
        jobs: list[BackgroundFactory] = [self.kv_events.run, self.scraper.run, self.parity.run]
        if self.watcher is not None:
            jobs.append(self.watcher.run)
        return jobs

    async def run(self) -> None:
        """Run every background job until cancelled; a crashed job is logged and restarted."""
        async with asyncio.TaskGroup() as group:
            for job in self.background():  # a second's pause between restarts, always
                group.create_task(kept_running(f"scheduler background job {job}", job,
                                               max_delay_s=RESTART_DELAY_S))


def build_scheduler(
    config_path: Path | None,
    inflight: InFlight,
    view: ClusterView,
    registry: CollectorRegistry,
    rng: random.Random | None = None,
    *,
    is_ejected: Callable[[str], bool] | None = None,
    tokenize: TokenSource | None = None,
) -> SchedulerRuntime:
    """Build the scheduler and its background work (see the module docstring)."""
    config = load_scheduler_config(config_path)
    return SchedulerRuntime(
        config, inflight, view, registry, rng=rng, is_ejected=is_ejected, tokenize=tokenize,
        config_path=config_path,
    )


__all__ = ["SchedulerRuntime", "build_scheduler"]
