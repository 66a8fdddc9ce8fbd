"""`python -m benchmarks.busy_poll`: what `pdgate serve --busy-poll` buys at concurrency 1.

At concurrency 1 the router's event loop sleeps between a request's steps, and on a
virtual machine the sleeping vCPU halts and wakes on cold caches (`router/busy_poll.py`).
This runs the overhead phase's concurrency-1 measurement (the sequential client of
`benchmarks.sequential`, `--fast` pods, the overhead workload) for pdgate with its loop
sleeping (the default) and polling (`--busy-poll MS`), vLLM Router and the direct floor,
all on the same pods, in rounds that alternate the order, and prints per mode the added
latency p50 / p99 over the direct floor (pooled over the rounds) and each router's CPU
per request.

Not part of `make bench`: a polling pdgate spends up to a core while it serves, which
every CPU figure of the main bench would carry. `benchmarks/HISTORY.md` ("Concurrency 1:
the sleeping loop") has the first reading.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from benchmarks.cluster import MODEL, ClusterShape, Mode, SimCluster
from benchmarks.config import full
from benchmarks.policies import OVERHEAD_POLICY, pdgate_specs
from benchmarks.routers import RouterSpec, RunningRouter
from benchmarks.sequential import run_sequential
from benchmarks.specs import RequestSpec
from benchmarks.stats import minus, percentile
from benchmarks.workloads import overhead

#: Requests each router gets before the rounds (its connections open, its caches warm).
WARM_REQUESTS = 300


@dataclass
class Tally:
    """One router's pooled concurrency-1 results over the rounds."""

    e2e: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    ok: int = 0
    errors: int = 0


def lineup(busy_poll_ms: float) -> list[RouterSpec]:
    pdgate = pdgate_specs([OVERHEAD_POLICY], prefill_ms_per_token=0.1)[0]
    polling = RouterSpec("pdgate", pdgate.policy, pdgate.scheduler_yaml,
                         ("--busy-poll", f"{busy_poll_ms:g}"))
    return [RouterSpec("direct"), pdgate, polling, RouterSpec("vllm-router", "round_robin")]


async def _round(routers: Sequence[RunningRouter], specs: Sequence[RequestSpec],
                 seconds: float, tallies: dict[str, Tally]) -> None:
    for router in routers:
        before = router.cpu_seconds()
        results, _ = await run_sequential(router.target, specs, seconds)
        after = router.cpu_seconds()
        tally = tallies.setdefault(router.spec.name, Tally())
        good = [r.e2e for r in results if r.ok]
        tally.e2e += good
        tally.ok += len(good)
        tally.errors += len(results) - len(good)
        if before is not None and after is not None:
            tally.cpu_s += after - before


async def measure(mode: Mode, busy_poll_ms: float, rounds: int, seconds: float,
                  work_dir: Path) -> list[str]:
    """Markdown lines: one table of the mode's routers."""
    overhead_config = full().overhead
    size = overhead_config.pd_groups if mode == "pd" else overhead_config.agg_pods
    workload = overhead(overhead_config.params, MODEL, 0)
    specs = [spec for session in workload.sessions for spec in session]
    tallies: dict[str, Tally] = {}
    with SimCluster(ClusterShape(mode, size, fast=True), work_dir / "logs") as cluster:
        routers = [RunningRouter(spec, cluster, work_dir) for spec in lineup(busy_poll_ms)]
        try:
            for router in routers:
                router.start()
                await run_sequential(router.target, specs[:WARM_REQUESTS], 10.0)
            for index in range(rounds):
                order = routers if index % 2 == 0 else routers[::-1]
                await _round(order, specs[WARM_REQUESTS:], seconds, tallies)
        finally:
            for router in routers:
                router.stop()
    floor = tallies["direct"].e2e
    lines = [f"### {mode}: {size} {'PD group' if mode == 'pd' else 'pod'}(s), {rounds} "
             f"rounds of {seconds:g} s", "",
             "| router | requests | E2E p50 ms | added p50 ms | added p99 ms | "
             "CPU µs / request |", "|---|---:|---:|---:|---:|---:|"]
    for name, tally in tallies.items():
        p50, p99 = percentile(tally.e2e, 50), percentile(tally.e2e, 99)
        added = [minus(p50, percentile(floor, 50)), minus(p99, percentile(floor, 99))]
        cpu = f"{tally.cpu_s / tally.ok * 1e6:.0f}" if name != "direct" and tally.ok else "-"
        cells = ["-" if value is None or name == "direct" else f"{value * 1e3:+.3f}"
                 for value in added]
        lines.append(f"| {name} | {tally.ok} ({tally.errors} errors) | "
                     f"{(p50 or 0) * 1e3:.3f} | {cells[0]} | {cells[1]} | {cpu} |")
    return [*lines, ""]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.busy_poll", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="agg,pd", help="comma-separated: agg, pd")
    parser.add_argument("--busy-poll", type=float, default=2.0, metavar="MS",
                        help="the polling pdgate's --busy-poll")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0, help="one router's share of a round")
    parser.add_argument("--work-dir", type=Path, default=Path("benchmarks/results/busy-poll/raw"))
    parser.add_argument("--out", type=Path, help="also write the tables to this file")
    args = parser.parse_args(argv)
    modes = [cast(Mode, m) for m in args.modes.split(",") if m in ("agg", "pd")]
    args.work_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"# Concurrency 1: pdgate's loop sleeping and polling (`--busy-poll "
             f"{args.busy_poll:g}`)", ""]
    for mode in modes:
        lines += asyncio.run(measure(mode, args.busy_poll, args.rounds, args.seconds,
                                     args.work_dir))
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
