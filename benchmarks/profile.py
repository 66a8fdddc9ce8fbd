"""`python -m benchmarks.profile`: where pdgate's CPU goes under the overhead workload.

Starts `--fast` pods and pdgate, drives the `overhead` workload at a fixed concurrency, and
samples the router with py-spy (`pip install py-spy`) for the duration. Writes the
collapsed stacks (`profile.txt`, flamegraph input) and an SVG flame graph, and prints the
functions with the most self and inclusive samples.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import cast

from benchmarks.cluster import MODEL, ClusterShape, Mode, SimCluster
from benchmarks.loadgen import LoadLimits, run_closed
from benchmarks.policies import OVERHEAD_POLICY, PDGATE_POLICIES, pdgate_specs
from benchmarks.routers import RunningRouter
from benchmarks.stats import summarize
from benchmarks.workloads import OverheadParams, overhead


def _py_spy() -> str:
    beside = Path(sys.executable).parent / "py-spy"
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise SystemExit("py-spy not found: pip install py-spy")
    return found


def top_functions(collapsed: str, limit: int = 30) -> tuple[list[tuple[str, int]],
                                                            list[tuple[str, int]], int]:
    """(self samples, inclusive samples, total) per frame from py-spy's raw output."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = stack.split(";")
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    return own.most_common(limit), inclusive.most_common(limit), total


async def _drive(router: RunningRouter, seconds: float, concurrency: int,
                 stream: bool = True, output_tokens: int = 4) -> str:
    params = OverheadParams(requests=200_000, output_tokens=output_tokens)
    workload = overhead(params, MODEL, 0, stream)
    await run_closed(router.target, workload.sessions[:200], 8, LoadLimits(10.0))
    before = router.cpu_seconds() or 0.0
    load = await run_closed(router.target, workload.sessions, concurrency,
                            LoadLimits(seconds, 30.0))
    cpu = (router.cpu_seconds() or 0.0) - before
    s = summarize(load.results, load.wall)
    return (f"{s.ok} ok / {s.requests} in {load.wall:.1f} s = {s.throughput:.0f} req/s, "
            f"E2E p50 {1e3 * (s.e2e_p50 or 0):.2f} ms; router CPU {cpu / max(1, s.ok) * 1e6:.0f}"
            f" us/request")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__)
    parser.add_argument("--mode", choices=("agg", "pd"), default="pd")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--policy", default=OVERHEAD_POLICY, choices=list(PDGATE_POLICIES))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/profile/raw"))
    parser.add_argument("--native", action="store_true", help="py-spy --native")
    parser.add_argument("--no-stream", action="store_true", help="non-streaming requests")
    parser.add_argument("--blocking", action="store_true",
                        help="pause the router for each sample: slower, but whole stacks (the "
                             "default sampling often sees only the loop's bottom frame)")
    parser.add_argument("--streaming", action="store_true",
                        help="the streaming phase's workload: long streams from latency-model "
                             "pods (see --tokens, --itl-ms) instead of `--fast` pods")
    parser.add_argument("--tokens", type=int, default=256, help="output tokens (--streaming)")
    parser.add_argument("--itl-ms", type=float, default=5.0, help="pods' ITL (--streaming)")
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    mode = cast(Mode, args.mode)
    size = 1 if mode == "pd" else 2
    shape = (ClusterShape(mode, size, sim_flags=("--itl-ms", f"{args.itl_ms:g}",
                                                 "--itl-per-running-ms", "0"))
             if args.streaming else ClusterShape(mode, size, fast=True))
    with SimCluster(shape, out / "logs") as c:
        spec = pdgate_specs([args.policy], prefill_ms_per_token=0.1)[0]
        with RunningRouter(spec, c, out) as router:
            assert router.process is not None
            common = [_py_spy(), "record", "--pid", str(router.process.pid), "--rate",
                      str(args.rate), "--duration", str(int(args.seconds)),
                      # --native cannot sample without pausing the process
                      *(["--native"] if args.native else []),
                      *([] if args.native or args.blocking else ["--nonblocking"])]
            raw = out / "profile.txt"
            spy = subprocess.Popen([*common, "--format", "raw", "--output", str(raw)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                line = asyncio.run(_drive(router, args.seconds, args.concurrency,
                                           not args.no_stream,
                                           args.tokens if args.streaming else 4))
            finally:
                spy.wait(timeout=args.seconds + 30)
    print(line)
    own, inclusive, total = top_functions(raw.read_text())
    print(f"\n{total} samples. Self time:")
    for frame, count in own:
        print(f"  {100 * count / total:5.1f}%  {frame}")
    print("\nInclusive time:")
    for frame, count in inclusive:
        print(f"  {100 * count / total:5.1f}%  {frame}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
