"""The benchmark's figures, Markdown and plots from synthetic runs (no processes started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import figures, plots, report
from benchmarks.cluster import PrefixCounters
from benchmarks.results import RouterResources, RunRecord, read_raw, write_raw
from benchmarks.specs import RequestResult
from benchmarks.stats import percentile, ratio


def _results(e2e_ms: float, count: int = 50, ttft_ms: float | None = None) -> list[RequestResult]:
    return [
        RequestResult(i, 0, i * 0.01, e2e=(e2e_ms + i % 5) / 1e3,
                      ttft=None if ttft_ms is None else (ttft_ms + i % 5) / 1e3, itl=[0.01])
        for i in range(count)
    ]  # fmt: skip


def _runs() -> list[RunRecord]:
    runs = []
    for kind, policy, e2e, rps in (("direct", None, 2.0, 1000), ("pdgate", "prefix-cache", 4.0,
                                   600), ("vllm-router", "round_robin", 3.0, 800)):
        name = kind if policy is None else f"{kind} ({policy})"
        for round_index in range(2):
            runs.append(RunRecord("overhead-latency", "pd", name, kind, policy, "overhead",
                                  round_index, 4, wall=1.0, results=_results(e2e),
                                  router_cpu_s=None if kind == "direct" else 0.05))
            runs.append(RunRecord("overhead-throughput", "pd", name, kind, policy, "overhead",
                                  round_index, 64, wall=rps / 1000 * 0.05 * 1000 / rps,
                                  results=_results(e2e, count=50),
                                  router_cpu_s=None if kind == "direct" else 0.02))
        runs.append(RunRecord("sweep", "pd", name, kind, policy, "overhead", 0, None, 100.0,
                              wall=1.0, results=_results(e2e)))
    for name, kind, policy, ttft, hits in (
        ("pdgate (prefix-cache)", "pdgate", "prefix-cache", 80.0, 900.0),
        ("pdgate (least-request)", "pdgate", "least-request", 400.0, 400.0),
        ("vllm-router (cache_aware)", "vllm-router", "cache_aware", 90.0, 900.0),
    ):
        runs.append(RunRecord("scheduling", "pd", name, kind, policy, "shared-prefix", 0, 4,
                              wall=5.0, results=_results(ttft + 100, ttft_ms=ttft),
                              router_cpu_s=0.1, prefix=PrefixCounters(1000.0, hits)))
    return runs


RESOURCES = [
    RouterResources("pdgate (prefix-cache)", "pd", "overhead", 80 << 20, 1.0),
    RouterResources("vllm-router (round_robin)", "pd", "overhead", 100 << 20, 0.0),
]


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None


def test_ratio_refuses_non_positive_values() -> None:
    assert ratio(2.0, 4.0) == 0.5
    assert ratio(-1.0, 4.0) is None and ratio(1.0, 0.0) is None and ratio(None, 1.0) is None


def test_overhead_rows_subtract_the_direct_floor() -> None:
    rows = {r.kind: r for r in figures.overhead_rows(_runs(), RESOURCES)}
    assert rows["direct"].added_p50 == pytest.approx(0.0)
    assert rows["pdgate"].added_p50 == pytest.approx(0.002)
    assert rows["vllm-router"].added_p50 == pytest.approx(0.001)
    assert rows["pdgate"].peak_rss_mib == pytest.approx(80.0)
    assert rows["pdgate"].idle_cpu_pct == 1.0
    # 4 runs x 0.05/0.02 s of CPU over 200 ok requests
    assert rows["pdgate"].cpu_per_1k == pytest.approx((0.05 + 0.02) * 2 / 200 * 1000)


def test_best_pdgate_policy_is_the_lowest_ttft_p50() -> None:
    rows = figures.scheduling_rows(_runs(), RESOURCES)
    best = figures.best_pdgate(rows, "pd", "shared-prefix")
    assert best is not None and best.router == "pdgate (prefix-cache)"
    assert best.hit_rate == pytest.approx(0.9)


def test_report_and_plots_render(tmp_path: Path) -> None:
    runs = _runs()
    over = figures.overhead_rows(runs, RESOURCES)
    sweep = figures.sweep_points(runs)
    sched = figures.scheduling_rows(runs, RESOURCES)
    palette = plots.Palette([r.router for r in runs])
    drawn = [
        name for name, ok in (
            ("overhead.png", plots.plot_overhead(over, tmp_path / "overhead.png", palette)),
            ("ttft.png", plots.plot_cdfs(runs, "ttft", tmp_path / "ttft.png", palette)),
            ("sweep.png", plots.plot_sweep(sweep, tmp_path / "sweep.png", palette)),
            ("cpu.png", plots.plot_cpu(over, sched, tmp_path / "cpu.png", palette)),
            ("hits.png", plots.plot_hit_rate(sched, tmp_path / "hits.png", palette)),
        ) if ok
    ]  # fmt: skip
    assert len(drawn) == 5
    assert all((tmp_path / name).stat().st_size > 1000 for name in drawn)
    meta = {"date": "2026-01-01", "preset": "test", "machine": "m", "seed": 0,
            "elapsed_s": 1.0, "peers": "p", "skipped": [], "method": ["- m"]}
    text = report.render(meta, over, sweep, sched, drawn)
    assert "## Headline figures" in text
    assert "pdgate / vLLM Router" in text and "90.0%" in text
    headline = figures.headline(over, sched)
    assert headline["overhead"]["pd"]["ratio_pdgate_over_vllm_router"]["added_p50"] == (
        pytest.approx(2.0)
    )


def test_raw_json_round_trips(tmp_path: Path) -> None:
    runs = _runs()
    path = tmp_path / "raw" / "runs.json"
    write_raw(path, {"date": "d"}, runs, RESOURCES)
    meta, again, resources = read_raw(path)
    assert meta == {"date": "d"} and resources == RESOURCES
    assert [r.header() for r in again] == [r.header() for r in runs]


def test_overload_points_compare_cpu_with_the_routers_own_maximum() -> None:
    runs = []
    for kind, name, cpu_max, cpu_over in (("pdgate", "pdgate", 0.10, 0.13),
                                          ("vllm-router", "vllm-router (round_robin)", 0.08, 0.08)):
        for round_index in range(2):
            runs.append(RunRecord("overload-max", "agg", name, kind, None, "overhead",
                                  round_index, 64, wall=1.0, results=_results(1.0, count=100),
                                  router_cpu_s=cpu_max))
        runs.append(RunRecord("overload", "agg", name, kind, None, "overhead", 0, None,
                              offered_rate=150.0, reference_rate=100.0, wall=1.0,
                              results=_results(1.0, count=90), router_cpu_s=cpu_over * 0.9))
    points = {p.kind: p for p in figures.overload_points(runs)}
    assert points["pdgate"].share == pytest.approx(0.9)
    assert points["pdgate"].multiple == pytest.approx(1.5)
    assert points["pdgate"].cpu_rise == pytest.approx(1.3)  # 1.3 ms per success against 1.0
    assert points["vllm-router"].cpu_rise == pytest.approx(1.0)
    text = "\n".join(report._overload_section(list(points.values())))
    assert "CPU vs at max" in text and "1.30x" in text


def test_added_latency_at_concurrency_1_is_over_directs_sequential_runs() -> None:
    runs = _runs()
    for kind, policy, e2e in (("direct", None, 0.3), ("pdgate", "prefix-cache", 0.55),
                              ("vllm-router", "round_robin", 0.5)):
        name = kind if policy is None else f"{kind} ({policy})"
        runs.append(RunRecord("overhead-c1", "pd", name, kind, policy, "overhead", 0, 1,
                              wall=1.0, results=_results(e2e, count=5)))
    rows = {r.kind: r for r in figures.overhead_rows(runs, RESOURCES)}
    # e2e (ms) of the five results: e, e+1, ..., e+4: p50 e+2, same offsets for every router
    assert rows["pdgate"].c1_added_p50 == pytest.approx(0.25e-3)
    assert rows["vllm-router"].c1_added_p50 == pytest.approx(0.2e-3)
    assert rows["direct"].c1_added_p50 == pytest.approx(0.0)
    assert rows["pdgate"].requests == sum(len(r.results) for r in runs
                                          if r.router == "pdgate (prefix-cache)"
                                          and r.phase.startswith("overhead"))
    text = "\n".join(report._overhead_section(list(rows.values())))
    assert "at concurrency 1, pdgate 0.25 ms against 0.20 ms" in text


def test_streaming_rows_report_the_probe_clients_ttft_over_its_own_floor(tmp_path: Path) -> None:
    runs = []
    for kind, name, ttft, probe_ttft in (("direct", "direct", 10.0, 7.0),
                                         ("pdgate", "pdgate", 14.0, 8.0),
                                         ("vllm-router", "vllm-router (round_robin)", 12.0, 8.5)):
        probe = _results(probe_ttft + 20, count=11, ttft_ms=probe_ttft)
        results = _results(ttft + 100, ttft_ms=ttft)
        for result in results:
            result.chunks = 4
        for result in probe:
            result.chunks = 2
        probe[-1].error = "http_503"  # not counted in the p50 nor in the chunks
        runs.append(RunRecord("streaming", "agg", name, kind, None, "streaming", 0, 64, wall=1.0,
                              results=results,
                              router_cpu_s=None if kind == "direct" else 0.05, probe=probe))
    path = tmp_path / "runs.json"
    write_raw(path, {}, runs, [])
    rows = {r.kind: r for r in figures.streaming_rows(read_raw(path)[1])}
    # ttft (ms) of the ten good probe streams: t, t+1, ..., t+4 twice: p50 t+2
    assert rows["pdgate"].probe_ttft_p50 == pytest.approx(10.0e-3)
    assert rows["pdgate"].added_probe_ttft_p50 == pytest.approx(1.0e-3)
    assert rows["vllm-router"].added_probe_ttft_p50 == pytest.approx(1.5e-3)
    assert (rows["pdgate"].probe_requests, rows["pdgate"].probe_errors) == (11, 1)
    assert rows["pdgate"].added_ttft_p50 == pytest.approx(4.0e-3)  # the generator's own
    # every good stream's chunks, the probe's included: 50 x 4 + 10 x 2 in one second
    assert rows["pdgate"].chunks_per_s == pytest.approx(220.0)
    text = "\n".join(report._streaming_section(list(rows.values())))
    assert "10.00 (1.00)" in text and "1/11" in text
    assert "added TTFT p50 2.00x (seen by the probe client 0.67x)" in text
