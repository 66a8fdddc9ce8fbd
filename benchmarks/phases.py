"""The three phases of a run, each bounded in runs and in time.

1. Overhead (`--fast` engines, tiny prompts): every router of a mode is started on the same
   pods; rounds go A B C ... then ... C B A so that drift cancels; each turn measures
   latency at low concurrency, then the maximum req/s at concurrency 64 (closed loop).
2. Sweep (same pods, right after): open-loop Poisson levels as fractions of the direct
   floor's maximum, every router at every level, interleaved.
3. Scheduling (engines with the latency model and a small KV cache): every workload through
   every router, each on a fresh Mooncake master and fresh pods, so that no router inherits
   another's warm cache; the prefix hit rate is read from the engines' `/metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from benchmarks.cluster import MODEL, ClusterShape, Mode, SimCluster, total_prefix_counters
from benchmarks.config import BenchConfig
from benchmarks.loadgen import LoadLimits, LoadResult, run_closed, run_open
from benchmarks.pinning import GeneratorCore
from benchmarks.probe import running_probe
from benchmarks.procs import StartupError
from benchmarks.results import RouterResources, RunRecord
from benchmarks.routers import RouterSpec, RunningRouter
from benchmarks.sequential import run_sequential
from benchmarks.specs import RequestSpec, Session
from benchmarks.stats import median
from benchmarks.workloads import (
    OverheadParams,
    Workload,
    multi_round,
    overhead,
    random_prompts,
    shared_prefix,
)

log = logging.getLogger("benchmarks")



class Reporter(Protocol):
    """Where progress goes (a tqdm bar in the CLI)."""

    def begin(self, label: str) -> None: ...

    def request(self, count: int) -> None: ...

    def end(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Lineup:
    """Who runs in which phase."""

    overhead: dict[Mode, tuple[RouterSpec, ...]]
    scheduling: dict[Mode, tuple[RouterSpec, ...]]


@dataclass
class Bench:
    config: BenchConfig
    lineup: Lineup
    work_dir: Path
    deadline: float  # time.monotonic() after which no new run starts
    reporter: Reporter
    runs: list[RunRecord] = field(default_factory=list)
    resources: list[RouterResources] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    stopping: list[threading.Thread] = field(default_factory=list)

    def join_stopping(self, timeout: float = 30.0) -> None:
        """Wait (bounded) for clusters stopping in the background."""
        deadline = time.monotonic() + timeout
        for thread in self.stopping:
            thread.join(max(0.0, deadline - time.monotonic()))
        self.stopping = [t for t in self.stopping if t.is_alive()]

    # ---- helpers -------------------------------------------------------------------

    def _out_of_time(self, label: str) -> bool:
        if time.monotonic() < self.deadline:
            return False
        self.skipped.append(label)
        log.warning("time budget spent: skipping %s", label)
        return True

    async def _measure(
        self,
        router: RunningRouter,
        cluster: SimCluster,
        record: RunRecord,
        sessions: Sequence[Session],
        limits: LoadLimits,
        *,
        rate: float | None = None,
        with_prefix: bool = False,
        streams: int | None = None,
    ) -> RunRecord:
        """One load run (closed loop at `streams`, default the record's concurrency, or
        open loop at `rate`) with the router's CPU over it."""
        self.reporter.begin(f"{record.phase} {record.mode} {record.workload} {record.router}")
        prefix_before = total_prefix_counters(cluster.compute_pods) if with_prefix else None
        cpu_before = router.cpu_seconds()
        client_before = time.process_time()
        load: LoadResult
        if rate is None:
            load = await run_closed(
                router.target, sessions,
                streams if streams is not None else record.concurrency or 1, limits,
                self.reporter.request,
            )
        else:
            load = await run_open(
                router.target, sessions, rate, self.config.seed, limits, self.reporter.request
            )
        cpu_after = router.cpu_seconds()
        record.client_cpu_s = time.process_time() - client_before
        if cpu_before is not None and cpu_after is not None:
            record.router_cpu_s = cpu_after - cpu_before
        if prefix_before is not None:
            record.prefix = total_prefix_counters(cluster.compute_pods) - prefix_before
        record.wall = load.wall
        record.results = load.results
        if not router.alive():
            log.error("%s exited during %s", router.spec.name, record.phase)
        self.runs.append(record)
        self.reporter.end()
        return record

    async def _measure_sequential(
        self, router: RunningRouter, record: RunRecord, specs: Sequence[RequestSpec]
    ) -> None:
        """Concurrency 1 from the sequential client (`benchmarks.sequential`)."""
        self.reporter.begin(f"{record.phase} {record.mode} {record.router}")
        cpu_before = router.cpu_seconds()
        record.results, record.wall = await run_sequential(
            router.target, specs, self.config.overhead.latency_seconds * 4)
        cpu_after = router.cpu_seconds()
        if cpu_before is not None and cpu_after is not None:
            record.router_cpu_s = cpu_after - cpu_before
        self.runs.append(record)
        self.reporter.end()

    def _failed(self, label: str, exc: BaseException) -> None:
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        self.skipped.append(f"{label}: {first_line}")
        log.error("%s failed: %s", label, exc)

    def _limits(self, time_limit: float) -> LoadLimits:
        return LoadLimits(time_limit=time_limit, request_timeout=self.config.request_timeout)

    # ---- phase 1 + 2 -----------------------------------------------------------------

    async def overhead_and_sweep(self, mode: Mode) -> None:
        cfg = self.config.overhead
        specs = [s for s in self.lineup.overhead.get(mode, ()) if s.supports(mode)]
        if not specs or self._out_of_time(f"overhead {mode}"):
            return
        size = cfg.pd_groups if mode == "pd" else cfg.agg_pods
        shape = ClusterShape(mode, size, fast=True)
        workload = overhead(cfg.params, MODEL, self.config.seed)
        sessions = workload.sessions
        started: list[RunningRouter] = []
        idle: dict[str, float] = {}
        with SimCluster(shape, self.work_dir / "logs") as cluster, contextlib.ExitStack() as stack:
            for spec in specs:
                try:
                    router = stack.enter_context(RunningRouter(spec, cluster, self.work_dir))
                except (StartupError, OSError) as exc:
                    self._failed(f"overhead {mode} {spec.name}", exc)
                    continue
                started.append(router)
                self.reporter.begin(f"warm-up {mode} {spec.name}")
                await run_closed(router.target, sessions[: cfg.warmup_requests], 8,
                                 self._limits(10.0))
            idle = await self._idle_cpu(started, cfg.idle_seconds)
            for round_index in range(cfg.rounds):
                order = started if round_index % 2 == 0 else started[::-1]
                for router in order:
                    if self._out_of_time(f"overhead {mode} round {round_index}"):
                        break
                    await self._measure(
                        router, cluster,
                        self._record("overhead-latency", mode, router, workload, round_index,
                                     cfg.latency_concurrency),
                        sessions[: cfg.latency_requests], self._limits(cfg.latency_seconds),
                    )  # fmt: skip
                    await self._measure(
                        router, cluster,
                        self._record("overhead-throughput", mode, router, workload, round_index,
                                     cfg.throughput_concurrency),
                        sessions, self._limits(cfg.throughput_seconds),
                    )  # fmt: skip
                    await self._measure_sequential(
                        router, self._record("overhead-c1", mode, router, workload, round_index, 1),
                        [spec for session in sessions[: cfg.sequential_requests]
                         for spec in session],
                    )  # fmt: skip
            if mode in self.config.sweep.modes:
                await self._sweep(mode, cluster, started, workload)
            if mode in self.config.overload.modes:
                await self._overload(mode, cluster, started, workload)
        for router in started:
            if router.peak_rss is not None:
                self.resources.append(RouterResources(
                    router.spec.name, mode, "overhead", router.peak_rss,
                    idle.get(router.spec.name),
                ))  # fmt: skip

    async def _idle_cpu(self, routers: list[RunningRouter], seconds: float) -> dict[str, float]:
        """Each router's CPU (% of one core) over the same quiet window."""
        self.reporter.begin("idle CPU")
        before = {r.spec.name: r.cpu_seconds() for r in routers}
        began = time.monotonic()
        await asyncio.sleep(seconds)
        wall = time.monotonic() - began
        out: dict[str, float] = {}
        for router in routers:
            start, end = before[router.spec.name], router.cpu_seconds()
            if start is not None and end is not None:
                out[router.spec.name] = (end - start) / wall * 100.0
        return out

    async def _sweep(
        self, mode: Mode, cluster: SimCluster, routers: list[RunningRouter], workload: Workload
    ) -> None:
        cfg = self.config.sweep
        # Levels are fractions of the fastest router's closed-loop maximum (median of its
        # rounds): the direct floor's own maximum is beyond every router (non-PD) or bound
        # by the client doing both PD legs itself, so it would waste levels.
        by_router: dict[str, list[float]] = {}
        for r in self.runs:
            if r.phase == "overhead-throughput" and r.mode == mode:
                by_router.setdefault(r.kind if r.kind == "direct" else r.router, []).append(
                    r.summary.throughput
                )
        routed = [median(v) or 0.0 for k, v in by_router.items() if k != "direct"]
        peak = max(routed, default=0.0) or median(by_router.get("direct", []))
        if not peak:
            self.skipped.append(f"sweep {mode}: no throughput measured")
            return
        for level, fraction in enumerate(cfg.fractions):
            rate = max(1.0, fraction * peak)
            count = min(len(workload.sessions), int(rate * cfg.seconds * 1.5) + 16)
            order = routers if level % 2 == 0 else routers[::-1]
            for router in order:
                if self._out_of_time(f"sweep {mode} level {fraction}"):
                    return
                record = self._record("sweep", mode, router, workload, level, None)
                record.offered_rate = rate
                await self._measure(router, cluster, record, workload.sessions[:count],
                                    self._limits(cfg.seconds), rate=rate)

    async def _overload(
        self, mode: Mode, cluster: SimCluster, routers: list[RunningRouter], workload: Workload
    ) -> None:
        """Open loop at multiples of pdgate's own maximum, measured first under the same
        pins: the load generator on a core of its own (`pinning.py`, `OverloadConfig`)."""
        routers = [r for r in routers if r.spec.kind != "direct"]
        with GeneratorCore() as pins:
            log.info("overload %s: %s", mode, pins.describe())
            await self._overload_levels(mode, cluster, routers, workload)

    async def _overload_levels(
        self, mode: Mode, cluster: SimCluster, routers: list[RunningRouter], workload: Workload
    ) -> None:
        cfg = self.config.overload
        concurrency = self.config.overhead.throughput_concurrency
        for round_index in range(cfg.max_rounds):
            for router in routers if round_index % 2 == 0 else routers[::-1]:
                if self._out_of_time(f"overload {mode} maximum"):
                    return
                await self._measure(
                    router, cluster,
                    self._record("overload-max", mode, router, workload, round_index,
                                 concurrency),
                    workload.sessions, self._limits(cfg.seconds),
                )  # fmt: skip
        pdgate = median([r.summary.throughput for r in self.runs
                         if r.phase == "overload-max" and r.mode == mode
                         and r.kind == "pdgate"])
        if not pdgate:
            self.skipped.append(f"overload {mode}: no pdgate maximum measured")
            return
        for level, multiple in enumerate(cfg.multiples):
            rate = multiple * pdgate
            count = min(len(workload.sessions), int(rate * cfg.seconds * 1.5) + 16)
            order = routers if level % 2 == 0 else routers[::-1]
            for router in order:
                if self._out_of_time(f"overload {mode} x{multiple:g}"):
                    return
                record = self._record("overload", mode, router, workload, level, None)
                record.offered_rate = rate
                record.reference_rate = pdgate
                await self._measure(router, cluster, record, workload.sessions[:count],
                                    self._limits(cfg.seconds), rate=rate)

    # ---- streaming ---------------------------------------------------------------------

    async def streaming(self, mode: Mode) -> None:
        """Long streams at each concurrency, every router of the overhead lineup and the
        direct floor on the same pods, interleaved (see `StreamingConfig`)."""
        cfg = self.config.streaming
        specs = [s for s in self.lineup.overhead.get(mode, ()) if s.supports(mode)]
        if mode not in cfg.modes or not specs or self._out_of_time(f"streaming {mode}"):
            return
        shape = ClusterShape(mode, cfg.agg_pods, fast=False, sim_flags=cfg.sim_flags)
        params = OverheadParams(requests=40_000, output_tokens=cfg.output_tokens)
        workload = overhead(params, MODEL, self.config.seed)
        workload = Workload("streaming", workload.sessions,
                            f"{cfg.output_tokens} tokens {cfg.itl_ms:g} ms apart")
        probe_params = OverheadParams(requests=1, output_tokens=cfg.probe_tokens)
        probe_spec = overhead(probe_params, MODEL, self.config.seed + 1).sessions[0][0]
        with SimCluster(shape, self.work_dir / "logs") as cluster, contextlib.ExitStack() as stack:
            started: list[RunningRouter] = []
            for spec in specs:
                try:
                    router = stack.enter_context(RunningRouter(spec, cluster, self.work_dir))
                except (StartupError, OSError) as exc:
                    self._failed(f"streaming {mode} {spec.name}", exc)
                    continue
                started.append(router)
                self.reporter.begin(f"warm-up streaming {spec.name}")
                await run_closed(router.target, workload.sessions[:16], 8, self._limits(2.0))
            for level, concurrency in enumerate(cfg.concurrencies):
                order = started if level % 2 == 0 else started[::-1]
                for router in order:
                    if self._out_of_time(f"streaming {mode} c={concurrency}"):
                        return
                    record = self._record("streaming", mode, router, workload, level,
                                          concurrency)
                    # The generator holds all streams but one; the probe sends the last.
                    async with running_probe(router.target, probe_spec, cfg.seconds) as probe:
                        await self._measure(router, cluster, record, workload.sessions,
                                            self._limits(cfg.seconds),
                                            streams=max(1, concurrency - 1))
                    record.probe = probe.results

    # ---- phase 3 -------------------------------------------------------------------------

    def scheduling_workloads(self) -> list[Workload]:
        cfg = self.config.scheduling
        seed = self.config.seed
        builders = {
            "shared-prefix": lambda: shared_prefix(cfg.shared_prefix, MODEL, seed),
            "multi-round": lambda: multi_round(cfg.multi_round, MODEL, seed),
            "random": lambda: random_prompts(cfg.random, MODEL, seed),
        }
        return [builders[name]() for name in cfg.workloads]

    async def scheduling(self, mode: Mode) -> None:
        cfg = self.config.scheduling
        specs = [s for s in self.lineup.scheduling.get(mode, ()) if s.supports(mode)]
        size = cfg.pd_groups if mode == "pd" else cfg.agg_pods
        shape = ClusterShape(mode, size, fast=False, sim_flags=cfg.sim_flags)
        for index, workload in enumerate(self.scheduling_workloads()):
            concurrency = (
                cfg.multi_round_concurrency if workload.name == "multi-round" else cfg.concurrency
            )
            order = specs if index % 2 == 0 else specs[::-1]
            for spec in order:
                if self._out_of_time(f"scheduling {mode} {workload.name} {spec.name}"):
                    continue
                try:
                    await self._scheduling_run(spec, shape, workload, concurrency)
                except (StartupError, OSError) as exc:
                    self._failed(f"scheduling {mode} {workload.name} {spec.name}", exc)

    async def _scheduling_run(
        self, spec: RouterSpec, shape: ClusterShape, workload: Workload, concurrency: int
    ) -> None:
        cfg = self.config.scheduling
        cluster = SimCluster(shape, self.work_dir / "logs")
        try:
            cluster.start()
            with RunningRouter(spec, cluster, self.work_dir) as router:
                await self._measure(
                    router, cluster,
                    self._record("scheduling", shape.mode, router, workload, 0, concurrency),
                    workload.sessions, self._limits(cfg.time_limit), with_prefix=True,
                )  # fmt: skip
        finally:
            # The next run's pods start meanwhile (new port); the router is already gone.
            self.stopping.append(cluster.stop_in_background())
        if router.peak_rss is not None:
            self.resources.append(
                RouterResources(spec.name, shape.mode, f"scheduling {workload.name}",
                                router.peak_rss)
            )

    @staticmethod
    def _record(
        phase: str,
        mode: Mode,
        router: RunningRouter,
        workload: Workload,
        round_index: int,
        concurrency: int | None,
    ) -> RunRecord:
        spec = router.spec
        return RunRecord(
            phase=phase, mode=mode, router=spec.name, kind=spec.kind, policy=spec.policy,
            workload=workload.name, round=round_index, concurrency=concurrency,
        )  # fmt: skip


def planned_runs(config: BenchConfig, lineup: Lineup) -> int:
    """How many measured runs a config makes (for the progress bar)."""
    total = 0
    for mode, specs in lineup.overhead.items():
        count = sum(1 for s in specs if s.supports(mode))
        total += 3 * count * config.overhead.rounds
        if mode in config.sweep.modes:
            total += count * len(config.sweep.fractions)
        if mode in config.overload.modes:
            routed = sum(1 for s in specs if s.supports(mode) and s.kind != "direct")
            total += routed * (config.overload.max_rounds + len(config.overload.multiples))
        if mode in config.streaming.modes:
            total += count * len(config.streaming.concurrencies)
    for mode, specs in lineup.scheduling.items():
        count = sum(1 for s in specs if s.supports(mode))
        total += count * len(config.scheduling.workloads)
    return total
