"""From run records to the figures the report and the plots show (medians and ratios)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.results import RouterResources, RunRecord
from benchmarks.stats import Summary, median, minus, percentile, ratio


@dataclass(frozen=True, slots=True)
class OverheadRow:
    mode: str
    router: str
    kind: str
    e2e_p50: float | None  # pooled over the latency runs of every round
    e2e_p99: float | None
    added_p50: float | None  # minus direct's, same mode
    added_p99: float | None
    max_rps: float | None  # median over rounds of the closed-loop c=64 throughput
    max_rps_rounds: tuple[float, ...]
    cpu_per_1k: float | None  # router CPU s per 1,000 requests, all overhead runs pooled
    peak_rss_mib: float | None
    idle_cpu_pct: float | None  # % of one core with no traffic
    requests: int
    errors: int
    #: Concurrency 1 from the sequential client: added over direct's, p50 / p99 (pooled).
    c1_added_p50: float | None = None
    c1_added_p99: float | None = None


@dataclass(frozen=True, slots=True)
class SweepPoint:
    mode: str
    router: str
    offered: float
    achieved: float
    e2e_p50: float | None
    errors: int


@dataclass(frozen=True, slots=True)
class OverloadPoint:
    """One router at one overload level: goodput as a share of pdgate's own maximum."""

    mode: str
    router: str
    kind: str
    multiple: float  # offered / reference
    reference: float  # pdgate's closed-loop maximum, req/s
    goodput: float  # successful requests per second of the run's wall time
    shed: int  # answered 503/429 (refused at once, as asked)
    timeouts: int  # the client gave up
    other_errors: int
    requests: int
    cpu_per_1k: float | None  # router CPU per 1,000 successful requests
    e2e_p99: float | None  # of the successful requests
    max_cpu_per_1k: float | None = None  # the same router's at its maximum (same pins)

    @property
    def share(self) -> float:
        return self.goodput / self.reference if self.reference else 0.0

    @property
    def cpu_rise(self) -> float | None:
        """CPU per success here against the router's own at its maximum."""
        return ratio(self.cpu_per_1k, self.max_cpu_per_1k)


@dataclass(frozen=True, slots=True)
class StreamingRow:
    """One router relaying long streams at one concurrency."""

    mode: str
    router: str
    kind: str
    concurrency: int
    chunks_per_s: float
    cpu_per_1k_chunks: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    added_ttft_p50: float | None  # over the direct floor at the same concurrency
    added_ttft_p99: float | None
    added_itl_p50: float | None
    added_itl_p99: float | None
    requests: int
    errors: int
    # The probe client's streams beside the load (`benchmarks.probe`): one at a time, from
    # a process of its own; its TTFT is what one more user sees.
    probe_ttft_p50: float | None = None
    added_probe_ttft_p50: float | None = None
    probe_requests: int = 0
    probe_errors: int = 0


@dataclass(frozen=True, slots=True)
class SchedulingRow:
    mode: str
    workload: str
    router: str
    kind: str
    policy: str | None
    ttft_p50: float | None
    ttft_p90: float | None
    e2e_p50: float | None
    itl_p50: float | None
    hit_rate: float | None
    throughput: float
    cpu_per_1k: float | None
    peak_rss_mib: float | None
    requests: int
    errors: int


def _pooled(runs: Iterable[RunRecord]) -> tuple[list[float], int, int]:
    e2e: list[float] = []
    requests = errors = 0
    for run in runs:
        requests += len(run.results)
        for result in run.results:
            if result.ok:
                e2e.append(result.e2e)
            else:
                errors += 1
    return e2e, requests, errors


def _peak(resources: Sequence[RouterResources], router: str, mode: str, phase: str) -> float | None:
    peaks = [r.peak_rss_bytes for r in resources
             if r.router == router and r.mode == mode and r.phase.startswith(phase)]
    return max(peaks) / (1 << 20) if peaks else None


def _idle(resources: Sequence[RouterResources], router: str, mode: str) -> float | None:
    found = [r.idle_cpu_pct for r in resources
             if r.router == router and r.mode == mode and r.idle_cpu_pct is not None]
    return found[0] if found else None


def _cpu_per_1k(runs: Iterable[RunRecord]) -> float | None:
    cpu = 0.0
    ok = 0
    for run in runs:
        if run.router_cpu_s is None:
            return None
        cpu += run.router_cpu_s
        ok += run.summary.ok
    return cpu / ok * 1000.0 if ok else None


def overhead_rows(
    runs: Sequence[RunRecord], resources: Sequence[RouterResources]
) -> list[OverheadRow]:
    rows: list[OverheadRow] = []
    for mode in _ordered(r.mode for r in runs if r.phase.startswith("overhead")):
        mine = [r for r in runs if r.mode == mode and r.phase.startswith("overhead")]
        direct_e2e, _, _ = _pooled(r for r in mine if r.kind == "direct" and
                                   r.phase == "overhead-latency")
        d50, d99 = percentile(direct_e2e, 50), percentile(direct_e2e, 99)
        direct_c1, _, _ = _pooled(r for r in mine if r.kind == "direct" and
                                  r.phase == "overhead-c1")
        c1_d50, c1_d99 = percentile(direct_c1, 50), percentile(direct_c1, 99)
        for router in _ordered(r.router for r in mine):
            latency = [r for r in mine if r.router == router and r.phase == "overhead-latency"]
            throughput = [r for r in mine
                          if r.router == router and r.phase == "overhead-throughput"]
            sequential = [r for r in mine if r.router == router and r.phase == "overhead-c1"]
            _, requests, errors = _pooled(latency + throughput + sequential)
            lat_e2e, _, _ = _pooled(latency)
            p50, p99 = percentile(lat_e2e, 50), percentile(lat_e2e, 99)
            rounds = tuple(r.summary.throughput for r in throughput)
            c1_e2e, _, _ = _pooled(sequential)
            c1_50, c1_99 = percentile(c1_e2e, 50), percentile(c1_e2e, 99)
            kind = mine[[r.router for r in mine].index(router)].kind
            rows.append(OverheadRow(
                mode=mode, router=router, kind=kind, e2e_p50=p50, e2e_p99=p99,
                added_p50=None if p50 is None or d50 is None else p50 - d50,
                added_p99=None if p99 is None or d99 is None else p99 - d99,
                max_rps=median(list(rounds)), max_rps_rounds=rounds,
                cpu_per_1k=_cpu_per_1k(latency + throughput),
                peak_rss_mib=_peak(resources, router, mode, "overhead"),
                idle_cpu_pct=_idle(resources, router, mode),
                requests=requests, errors=errors,
                c1_added_p50=minus(c1_50, c1_d50), c1_added_p99=minus(c1_99, c1_d99),
            ))  # fmt: skip
    return rows


def sweep_points(runs: Sequence[RunRecord]) -> list[SweepPoint]:
    return [
        SweepPoint(r.mode, r.router, r.offered_rate or 0.0, r.summary.throughput,
                   r.summary.e2e_p50, r.summary.requests - r.summary.ok)
        for r in runs if r.phase == "sweep"
    ]  # fmt: skip


def overload_points(runs: Sequence[RunRecord]) -> list[OverloadPoint]:
    at_max: dict[tuple[str, str], list[float]] = {}
    for r in runs:
        if r.phase == "overload-max" and r.cpu_per_1k is not None:
            at_max.setdefault((r.mode, r.router), []).append(r.cpu_per_1k)
    points = []
    for r in runs:
        if r.phase != "overload" or not r.reference_rate:
            continue
        s = r.summary
        shed = s.errors.get("http_503", 0) + s.errors.get("http_429", 0)
        timeouts = s.errors.get("timeout", 0)
        points.append(OverloadPoint(
            mode=r.mode, router=r.router, kind=r.kind,
            multiple=(r.offered_rate or 0.0) / r.reference_rate, reference=r.reference_rate,
            goodput=s.throughput, shed=shed, timeouts=timeouts,
            other_errors=s.requests - s.ok - shed - timeouts, requests=s.requests,
            cpu_per_1k=r.cpu_per_1k, e2e_p99=s.e2e_p99,
            max_cpu_per_1k=median(at_max.get((r.mode, r.router), [])) or None,
        ))  # fmt: skip
    return points


def streaming_rows(runs: Sequence[RunRecord]) -> list[StreamingRow]:
    mine = [r for r in runs if r.phase == "streaming"]
    rows = []
    for r in mine:
        s = r.summary
        chunks = sum(x.chunks for x in (*r.results, *r.probe) if x.ok)
        floor = next((d for d in mine if d.kind == "direct" and d.mode == r.mode
                      and d.concurrency == r.concurrency), None)
        direct = None if floor is None else floor.summary
        probe_p50 = _probe_ttft_p50(r)
        direct_probe_p50 = None if floor is None else _probe_ttft_p50(floor)

        def added(mine_v: float | None, attr: str, floor: Summary | None = direct) -> float | None:
            base = None if floor is None else getattr(floor, attr)
            return None if mine_v is None or base is None else mine_v - base

        rows.append(StreamingRow(
            mode=r.mode, router=r.router, kind=r.kind, concurrency=r.concurrency or 0,
            chunks_per_s=chunks / r.wall if r.wall else 0.0,
            cpu_per_1k_chunks=(r.router_cpu_s / chunks * 1000.0
                               if r.router_cpu_s is not None and chunks else None),
            ttft_p50=s.ttft_p50, ttft_p99=s.ttft_p99, itl_p50=s.itl_p50, itl_p99=s.itl_p99,
            added_ttft_p50=added(s.ttft_p50, "ttft_p50"),
            added_ttft_p99=added(s.ttft_p99, "ttft_p99"),
            added_itl_p50=added(s.itl_p50, "itl_p50"), added_itl_p99=added(s.itl_p99, "itl_p99"),
            requests=s.requests, errors=s.requests - s.ok,
            probe_ttft_p50=probe_p50,
            added_probe_ttft_p50=minus(probe_p50, direct_probe_p50),
            probe_requests=len(r.probe), probe_errors=sum(1 for x in r.probe if not x.ok),
        ))  # fmt: skip
    return rows


def _probe_ttft_p50(run: RunRecord) -> float | None:
    return median([x.ttft for x in run.probe if x.ok and x.ttft is not None])


def scheduling_rows(
    runs: Sequence[RunRecord], resources: Sequence[RouterResources]
) -> list[SchedulingRow]:
    rows = []
    for r in runs:
        if r.phase != "scheduling":
            continue
        s = r.summary
        rows.append(SchedulingRow(
            mode=r.mode, workload=r.workload, router=r.router, kind=r.kind, policy=r.policy,
            ttft_p50=s.ttft_p50, ttft_p90=s.ttft_p90, e2e_p50=s.e2e_p50, itl_p50=s.itl_p50,
            hit_rate=r.hit_rate, throughput=s.throughput, cpu_per_1k=r.cpu_per_1k,
            peak_rss_mib=_peak(resources, r.router, r.mode, f"scheduling {r.workload}"),
            requests=s.requests, errors=s.requests - s.ok,
        ))  # fmt: skip
    return rows


def best_pdgate(rows: Sequence[SchedulingRow], mode: str, workload: str) -> SchedulingRow | None:
    """pdgate's policy with the lowest TTFT p50 on one workload."""
    mine = [r for r in rows if r.mode == mode and r.workload == workload and r.kind == "pdgate"
            and r.ttft_p50 is not None]
    return min(mine, key=lambda r: r.ttft_p50 or 0.0) if mine else None


def headline(
    over: Sequence[OverheadRow], sched: Sequence[SchedulingRow]
) -> dict[str, Any]:
    """The figures the design note quotes, with pdgate / vLLM Router ratios."""
    out: dict[str, Any] = {"overhead": {}, "scheduling": {}}
    for mode in _ordered(r.mode for r in over):
        by_kind = {r.kind: r for r in over if r.mode == mode}
        pd, vl = by_kind.get("pdgate"), by_kind.get("vllm-router")
        entry: dict[str, Any] = {k: asdict(v) for k, v in by_kind.items()}
        if pd is not None and vl is not None:
            entry["ratio_pdgate_over_vllm_router"] = {
                "added_p50": ratio(pd.added_p50, vl.added_p50),
                "added_p99": ratio(pd.added_p99, vl.added_p99),
                "max_rps": ratio(pd.max_rps, vl.max_rps),
                "cpu_per_1k": ratio(pd.cpu_per_1k, vl.cpu_per_1k),
                "peak_rss": ratio(pd.peak_rss_mib, vl.peak_rss_mib),
            }
        out["overhead"][mode] = entry
    for mode in _ordered(r.mode for r in sched):
        for workload in _ordered(r.workload for r in sched if r.mode == mode):
            rows = [r for r in sched if r.mode == mode and r.workload == workload]
            best = best_pdgate(rows, mode, workload)
            entry = {"rows": [asdict(r) for r in rows],
                     "pdgate_best": None if best is None else best.router}
            for peer in rows:
                if best is not None and peer.kind != "pdgate":
                    entry[f"ttft_p50_ratio_vs_{peer.router}"] = ratio(best.ttft_p50, peer.ttft_p50)
            out["scheduling"][f"{mode}/{workload}"] = entry
    return out


def _ordered(items: Iterable[str]) -> list[str]:
    seen: dict[str, None] = {}
    for item in items:
        seen.setdefault(item, None)
    return list(seen)
