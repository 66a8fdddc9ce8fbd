"""PNG plots with matplotlib's Agg backend (no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.axes import Axes

from benchmarks.figures import OverheadRow, SchedulingRow, SweepPoint
from benchmarks.results import RunRecord

MODE_SHORT = {"agg": "non-PD", "pd": "PD"}
DPI = 110


class Palette:
    """A stable colour per router name within one report."""

    def __init__(self, names: Sequence[str]) -> None:
        cmap = plt.get_cmap("tab10")
        self._colors = {name: cmap(i % 10) for i, name in enumerate(dict.fromkeys(names))}

    def rank(self, name: str) -> int:
        """Position in the report's router order (bars follow it in every group)."""
        names = list(self._colors)
        return names.index(name) if name in self._colors else len(names)

    def __call__(self, name: str) -> tuple[float, float, float, float]:
        color = self._colors.get(name)
        return color if color is not None else (0.5, 0.5, 0.5, 1.0)


def _cdf(ax: Axes, values: Sequence[float], label: str, color: object) -> None:
    if not values:
        return
    ordered = sorted(v * 1e3 for v in values)
    n = len(ordered)
    ax.step(ordered, [(i + 1) / n for i in range(n)], where="post", label=label, color=color)


def _panels(runs: Sequence[RunRecord]) -> list[tuple[str, list[RunRecord]]]:
    """One panel per scheduling (mode, workload) and per overhead mode (latency runs)."""
    panels: list[tuple[str, list[RunRecord]]] = []
    keys = dict.fromkeys((r.mode, r.workload) for r in runs if r.phase == "scheduling")
    for mode, workload in keys:
        panels.append((f"{workload}, {MODE_SHORT.get(mode, mode)}",
                       [r for r in runs if r.phase == "scheduling" and r.mode == mode
                        and r.workload == workload]))
    for mode in dict.fromkeys(r.mode for r in runs if r.phase == "overhead-latency"):
        panels.append((f"overhead, {MODE_SHORT.get(mode, mode)} (fast engines)",
                       [r for r in runs if r.phase == "overhead-latency" and r.mode == mode]))
    return panels


def plot_cdfs(runs: Sequence[RunRecord], metric: str, path: Path, palette: Palette) -> bool:
    panels = _panels(runs)
    if not panels:
        return False
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax, (title, mine) in zip(axes.flat, panels, strict=False):
        for router in sorted(dict.fromkeys(r.router for r in mine), key=palette.rank):
            values = [
                (res.ttft if metric == "ttft" else res.e2e)
                for r in mine if r.router == router for res in r.results if res.ok
            ]
            _cdf(ax, [v for v in values if v is not None], router, palette(router))
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(f"{'TTFT' if metric == 'ttft' else 'end-to-end latency'} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="lower right")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"{'TTFT' if metric == 'ttft' else 'E2E latency'} CDF per router", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True


def plot_sweep(points: Sequence[SweepPoint], path: Path, palette: Palette) -> bool:
    modes = list(dict.fromkeys(p.mode for p in points))
    if not modes:
        return False
    fig, axes = plt.subplots(2, len(modes), figsize=(6 * len(modes), 8.0), squeeze=False)
    for ax, mode in zip(axes[1], modes, strict=False):
        mine = [p for p in points if p.mode == mode]
        for router in sorted(dict.fromkeys(p.router for p in mine), key=palette.rank):
            series = sorted((p.offered, p.e2e_p50) for p in mine
                            if p.router == router and p.e2e_p50 is not None)
            ax.plot([s[0] for s in series], [s[1] * 1e3 for s in series], marker="o",
                    label=router, color=palette(router))
        ax.set_yscale("log")
        ax.set_title(f"{MODE_SHORT.get(mode, mode)}: median latency vs offered load",
                     fontsize=10)
        ax.set_xlabel("offered load (req/s, Poisson)")
        ax.set_ylabel("E2E p50 (ms, log scale)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    for ax, mode in zip(axes[0], modes, strict=False):
        mine = [p for p in points if p.mode == mode]
        top = max(max(p.offered for p in mine), max(p.achieved for p in mine)) * 1.05
        ax.plot([0, top], [0, top], ls=":", color="grey", lw=1, label="achieved = offered")
        for router in sorted(dict.fromkeys(p.router for p in mine), key=palette.rank):
            series = sorted((p.offered, p.achieved) for p in mine if p.router == router)
            ax.plot([s[0] for s in series], [s[1] for s in series], marker="o",
                    label=router, color=palette(router))
        ax.set_title(f"{MODE_SHORT.get(mode, mode)}: throughput vs offered load", fontsize=10)
        ax.set_xlabel("offered load (req/s, Poisson)")
        ax.set_ylabel("achieved throughput (successful req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True


def plot_cpu(
    over: Sequence[OverheadRow], sched: Sequence[SchedulingRow], path: Path, palette: Palette
) -> bool:
    bars: list[tuple[str, str, float]] = []  # (group, router, value)
    for row in over:
        if row.cpu_per_1k is not None:
            bars.append((f"overhead {MODE_SHORT.get(row.mode, row.mode)}", row.router,
                         row.cpu_per_1k))
    for srow in sched:
        if srow.cpu_per_1k is not None:
            bars.append((f"{srow.workload} {MODE_SHORT.get(srow.mode, srow.mode)}",
                         srow.router, srow.cpu_per_1k))
    return _grouped_bars(bars, "router CPU seconds per 1,000 requests", path, palette, "{:.2f}")


def plot_hit_rate(sched: Sequence[SchedulingRow], path: Path, palette: Palette) -> bool:
    bars = [(f"{r.workload} {MODE_SHORT.get(r.mode, r.mode)}", r.router, r.hit_rate * 100)
            for r in sched if r.hit_rate is not None]
    return _grouped_bars(bars, "prefix-cache hit rate at the engines (%)", path, palette,
                         "{:.0f}")


def plot_overhead(over: Sequence[OverheadRow], path: Path, palette: Palette) -> bool:
    routed = [r for r in over if r.kind != "direct"]
    if not over:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    lat: list[tuple[str, str, float]] = []
    for r in routed:
        mode = MODE_SHORT.get(r.mode, r.mode)
        if r.added_p50 is not None:
            lat.append((f"{mode} p50", r.router, r.added_p50 * 1e3))
        if r.added_p99 is not None:
            lat.append((f"{mode} p99", r.router, r.added_p99 * 1e3))
    _bars_on(left, lat, palette, "{:.2f}")
    left.set_ylabel("added latency over direct (ms)")
    left.set_title("router-added E2E latency (low concurrency)", fontsize=10)
    rps = [(MODE_SHORT.get(r.mode, r.mode), r.router, r.max_rps) for r in over
           if r.max_rps is not None]
    _bars_on(right, rps, palette, "{:.0f}")
    right.set_ylabel("max sustained req/s at concurrency 64")
    right.set_title("max sustained throughput (closed loop, c=64)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True


def _grouped_bars(
    bars: Sequence[tuple[str, str, float]], ylabel: str, path: Path, palette: Palette, fmt: str
) -> bool:
    if not bars:
        return False
    groups = list(dict.fromkeys(b[0] for b in bars))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.9 * len(groups) + 3), 4.4))
    _bars_on(ax, bars, palette, fmt)
    ax.set_ylabel(ylabel)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True


def _bars_on(ax: Axes, bars: Sequence[tuple[str, str, float]], palette: Palette, fmt: str) -> None:
    """Grouped bars; each group holds only the routers measured in it (no empty slots)."""
    groups = list(dict.fromkeys(b[0] for b in bars))
    labelled: set[str] = set()
    for g, group in enumerate(groups):
        mine = sorted((b for b in bars if b[0] == group), key=lambda b: palette.rank(b[1]))
        width = 0.8 / max(1, len(mine))
        for i, (_, router, value) in enumerate(mine):
            x = g + (i - (len(mine) - 1) / 2) * width
            drawn = ax.bar([x], [value], width=width, color=palette(router),
                           label=None if router in labelled else router)
            labelled.add(router)
            ax.bar_label(drawn, labels=[fmt.format(value)], fontsize=6, padding=1)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8, rotation=15 if len(groups) > 4 else 0)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
