"""`python -m benchmarks [--quick]`: run every phase, then write JSON, Markdown and PNGs."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib.metadata
import json
import logging
import os
import platform
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any, cast

from tqdm import tqdm

from benchmarks import figures, plots, report, trace_bench
from benchmarks.cluster import Mode
from benchmarks.config import BenchConfig, full, quick
from benchmarks.phases import Bench, planned_runs
from benchmarks.policies import PDGATE_POLICIES, QUICK_POLICIES, lineup
from benchmarks.procs import StartupError
from benchmarks.results import RouterResources, RunRecord, read_raw, write_raw
from router import build

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PHASES = ("overhead", "streaming", "scheduling", "tokenization", "decision", "trace")
#: Iterations per case of the tokenization phase (in-process, a few seconds in all).
TOKENIZATION_ITERATIONS = {"quick": 15, "full": 30}
#: Requests per case of the decision phase (in-process; a quarter for the precise profile).
DECISION_REQUESTS = {"quick": 300, "full": 1000}
MODES: tuple[Mode, ...] = ("agg", "pd")
#: Wall-clock budgets: no new run starts after them (a run in progress finishes). The
#: default ones are sized for the phases before the trace, which they never skip (`_trace`).
QUICK_BUDGET_S = 160.0
FULL_BUDGET_S = 1080.0


class BarReporter:
    """A tqdm bar over runs; its postfix counts the requests of the current run."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = tqdm(total=total, unit="run", disable=not enabled, dynamic_ncols=True)
        self.requests = 0
        self._last = 0.0

    def begin(self, label: str) -> None:
        self.requests = 0
        self.bar.set_description(label[:70])

    def request(self, count: int) -> None:
        self.requests += count
        now = time.monotonic()
        if now - self._last > 0.5:
            self._last = now
            self.bar.set_postfix_str(f"{self.requests} req")

    def end(self) -> None:
        self.bar.set_postfix_str(f"{self.requests} req", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    add = parser.add_argument
    add("--quick", action="store_true", help="the short preset (under 3 minutes)")
    add("--out", type=Path, help="output directory (default: benchmarks/results/<date>[-quick])")
    add("--seed", type=int, default=0, help="workload and arrival seed")
    add("--phases", default=",".join(PHASES),
        help=f"comma list of: {', '.join(PHASES)}")
    add("--modes", default=",".join(MODES), help="comma list of: agg, pd")
    add("--pdgate-policies",
        help=f"comma list of: {', '.join(PDGATE_POLICIES)} (default: all; quick: "
             f"{', '.join(QUICK_POLICIES)})")
    add("--time-budget", type=float, help="seconds after which no new run starts")
    add("--no-progress", action="store_true", help="no progress bar")
    add("--report-only", type=Path, metavar="DIR",
        help="re-render DIR's report and plots from DIR/raw/runs.json, run nothing")
    add("--log-level", default="warning")
    trace_bench.add_arguments(parser)
    return parser.parse_args(argv)


def _split(text: str, allowed: Sequence[str], what: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    bad = [item for item in items if item not in allowed]
    if bad:
        raise SystemExit(f"unknown {what}: {bad} (choose from {list(allowed)})")
    return items


def _peers() -> str:
    found = []
    for name in ("vllm-router", "sglang-router"):
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return ", ".join(found)


def _method(config: BenchConfig) -> list[str]:
    o, s = config.overhead, config.scheduling
    return [
        f"- Overhead: `overhead` workload ({o.params.prompt_tokens}-token prompts, "
        f"{o.params.output_tokens} output tokens, streaming), `--fast` engines: non-PD "
        f"{o.agg_pods} pods, PD {o.pd_groups} prefill/decode pair(s). {o.rounds} interleaved "
        f"rounds (A B C, then C B A); per turn up to {o.latency_requests} requests or "
        f"{o.latency_seconds:g} s at concurrency {o.latency_concurrency} for latency, then "
        f"{o.throughput_seconds:g} s at concurrency "
        f"{o.throughput_concurrency} for max throughput. Every router is warmed up first.",
        "- Direct floor: non-PD, the client sends each request to the next pod (round "
        "robin); PD, the client itself sends prefill (`max_tokens: 1`, NIXL "
        "`kv_transfer_params`) then decode with the handle, to the next group's prefill and "
        "decode pod. That floor makes the Python client send two requests, "
        "so it can be slower than a fast router (negative added latency): compare the routers "
        "with each other there (the headline gives pdgate minus vLLM Router).",
        f"- Sweep: open-loop Poisson at {', '.join(f'{f:.0%}' for f in config.sweep.fractions)} "
        f"of the fastest router's max at c=64, {config.sweep.seconds:g} s per level and "
        "router; "
        "arrivals beyond 512 in flight are shed and counted as `client_overload` errors.",
        f"- Overload: the load generator on a core of its own, routers and pods on the "
        f"other(s) (`benchmarks/pinning.py`); each router's max at "
        f"c={config.overhead.throughput_concurrency} measured first under those pins "
        f"({config.overload.max_rounds} interleaved rounds), then open-loop Poisson at "
        f"{', '.join(f'{m:g}x' for m in config.overload.multiples)} of pdgate's (median), "
        f"{config.overload.seconds:g} s per level and router, "
        f"modes {', '.join(config.overload.modes)}.",
        f"- Streaming: {config.streaming.output_tokens}-token streams "
        f"{config.streaming.itl_ms:g} ms apart from {config.streaming.agg_pods} aggregated "
        f"pods, closed loop at {', '.join(map(str, config.streaming.concurrencies))} streams, "
        f"{config.streaming.seconds:g} s per router and level, one stream of each level "
        f"the probe client's ({config.streaming.probe_tokens}-token streams one at a time "
        "from a process of its own); the direct floor streams straight from the pods, "
        "round robin.",
        f"- Scheduling: {s.pd_groups} PD groups (pdgate pairs inside a group; vLLM Router "
        f"pairs any prefill with any decode) or {s.agg_pods} aggregated pods, simulator latency "
        f"model on, flags `{' '.join(s.sim_flags)}`; closed loop at concurrency "
        f"{s.concurrency} ({s.multi_round_concurrency} users at once for multi-round); fresh "
        "Mooncake master and pods for every run.",
        f"- Workloads: shared-prefix {s.shared_prefix}; multi-round {s.multi_round}; "
        f"random {s.random}.",
        "- Peers: vLLM Router with `--vllm-pd-disaggregation --kv-connector nixl` (PD) or "
        "`--worker-urls` (non-PD); SGLang's router `launch --worker-urls` (non-PD only). "
        "Overhead runs use round_robin for the peers (their cheapest policy) and pdgate's "
        "default profiles. pdgate's cost model is told the engines' prefill cost "
        f"(`costModel.prefillSecondsPerToken: {s.prefill_ms_per_token / 1e3:g}`); the peers "
        "have no such setting. All routers log at warning level.",
    ]


async def _trace(bench: Bench, args: argparse.Namespace) -> None:
    """The Mooncake trace replay (`benchmarks.trace_bench`): its own tables and plots."""
    paths, options, config = trace_bench.options_of(args)
    if not paths:
        bench.skipped.append("trace: no trace file (pass --trace PATH)")
        return
    # Its length is fixed by its windows (one run of a window per trace and router), and a
    # slower machine spending the default budget on the phases before it must not lose the
    # trace tables: only a budget the user gave skips it.
    if args.time_budget is not None and bench._out_of_time("trace"):
        return
    await trace_bench.run_traces(paths, options, config, bench.work_dir.parent, args.seed)


async def _run(
    bench: Bench, phases: list[str], modes: list[Mode], args: argparse.Namespace | None = None
) -> None:
    steps: list[tuple[str, Callable[[], Awaitable[None]]]] = []
    if "overhead" in phases:
        steps += [(f"overhead {m}", partial(bench.overhead_and_sweep, m)) for m in modes]
    if "streaming" in phases:
        steps += [(f"streaming {m}", partial(bench.streaming, m)) for m in modes]
    if "scheduling" in phases:
        steps += [(f"scheduling {m}", partial(bench.scheduling, m))
                  for m in sorted(modes, reverse=True)]  # pd first
    if "trace" in phases and args is not None:
        steps.append(("trace", partial(_trace, bench, args)))
    for label, step in steps:
        try:
            await step()
        except (StartupError, OSError, RuntimeError) as exc:  # one phase failing: go on
            bench.skipped.append(f"{label}: {str(exc).splitlines()[0] if str(exc) else exc!r}")
            logging.getLogger("benchmarks").exception("%s failed", label)


def _tokenization(iterations: int, bench: Bench) -> dict[str, list[float]] | None:
    """The router's tokenization cost per request (`benchmarks.tokenization`), in-process."""
    from benchmarks import tokenization

    try:
        return {case: [p50, p90] for case, (p50, p90) in tokenization.run(iterations).items()}
    except (OSError, ValueError) as exc:  # no tokenizer installed: report, go on
        bench.skipped.append(f"tokenization: {exc}")
        return None


def _decision(requests: int, bench: Bench) -> dict[str, list[float]] | None:
    """The scheduler's decision time per request (`benchmarks.decision`), in-process."""
    from benchmarks import decision

    try:
        return {case: [p50, p90] for case, (p50, p90) in decision.run(requests).items()}
    except (OSError, ValueError) as exc:  # no tokenizer for the precise case: report, go on
        bench.skipped.append(f"decision: {exc}")
        return None


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return cast(Callable[[], asyncio.AbstractEventLoop], uvloop.new_event_loop)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.report_only is not None:
        saved, runs, resources = read_raw(args.report_only / "raw" / "runs.json")
        _write_reports(args.report_only, saved, runs, resources)
        print(f"results: {args.report_only}")
        return 0
    config = quick(args.seed) if args.quick else full(args.seed)
    phases = _split(args.phases, PHASES, "phases")
    modes = cast(list[Mode], _split(args.modes, MODES, "modes"))
    policies = (
        _split(args.pdgate_policies, list(PDGATE_POLICIES), "pdgate policies")
        if args.pdgate_policies
        else list(QUICK_POLICIES if args.quick else PDGATE_POLICIES)
    )
    the_lineup = lineup(modes, policies, config.scheduling.include_agg,
                        config.scheduling.prefill_ms_per_token)
    if "overhead" not in phases and "streaming" not in phases:
        the_lineup = type(the_lineup)(overhead={}, scheduling=the_lineup.scheduling)
    if "scheduling" not in phases:
        the_lineup = type(the_lineup)(overhead=the_lineup.overhead, scheduling={})
    today = dt.date.today().isoformat()
    out = args.out or RESULTS_DIR / (today + ("-quick" if args.quick else ""))
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    budget = args.time_budget or (QUICK_BUDGET_S if args.quick else FULL_BUDGET_S)
    started = time.monotonic()
    reporter = BarReporter(planned_runs(config, the_lineup), enabled=not args.no_progress)
    bench = Bench(config, the_lineup, raw, started + budget, reporter)
    token_costs = (
        _tokenization(TOKENIZATION_ITERATIONS["quick" if args.quick else "full"], bench)
        if "tokenization" in phases
        else None
    )
    decision_costs = (
        _decision(DECISION_REQUESTS["quick" if args.quick else "full"], bench)
        if "decision" in phases
        else None
    )
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(_run(bench, phases, modes, args))
    except KeyboardInterrupt:
        bench.skipped.append("interrupted")
    finally:
        reporter.close()
        bench.join_stopping()
    elapsed = time.monotonic() - started
    meta: dict[str, Any] = {
        "date": today,
        "preset": config.name,
        "seed": config.seed,
        "elapsed_s": elapsed,
        "machine": f"{os.cpu_count()} CPUs, {platform.platform()}, "
                   f"Python {platform.python_version()}",
        "peers": _peers(),
        "compiled": build.summary(),
        "skipped": bench.skipped,
        "method": _method(config),
    }  # fmt: skip
    if token_costs is not None:
        meta["tokenization"] = token_costs
    if decision_costs is not None:
        meta["decision"] = decision_costs
    write_raw(raw / "runs.json", meta, bench.runs, bench.resources)
    _write_reports(out, meta, bench.runs, bench.resources)
    print(f"results: {out} ({elapsed:.0f} s)")
    return 0 if not bench.skipped else 2


def _write_reports(
    out: Path, meta: dict[str, Any], runs: list[RunRecord], resources: list[RouterResources]
) -> None:
    over = figures.overhead_rows(runs, resources)
    sweep = figures.sweep_points(runs)
    sched = figures.scheduling_rows(runs, resources)
    overload = figures.overload_points(runs)
    streaming = figures.streaming_rows(runs)
    # Colours and bar order: direct, then pdgate's policies, then the peers.
    kinds = ("direct", "pdgate", "vllm-router", "sglang-router")
    names = [r.router for kind in kinds for r in runs if r.kind == kind]
    palette = plots.Palette(names)
    drawn: list[str] = []
    drawers: list[tuple[str, Callable[[Path], bool]]] = [
        ("overhead.png", lambda p: plots.plot_overhead(over, p, palette)),
        ("ttft_cdf.png", lambda p: plots.plot_cdfs(runs, "ttft", p, palette)),
        ("e2e_cdf.png", lambda p: plots.plot_cdfs(runs, "e2e", p, palette)),
        ("throughput_vs_load.png", lambda p: plots.plot_sweep(sweep, p, palette)),
        ("cpu_per_1k.png", lambda p: plots.plot_cpu(over, sched, p, palette)),
        ("prefix_hit_rate.png", lambda p: plots.plot_hit_rate(sched, p, palette)),
    ]
    for name, draw in drawers:
        if draw(out / name):
            drawn.append(name)
    (out / "README.md").write_text(report.render(meta, over, sweep, sched, drawn,
                                                       overload, streaming))
    summary = {"meta": meta, **figures.headline(over, sched),
               "sweep": [asdict(p) for p in sweep],
               "overload": [{**asdict(p), "share": p.share} for p in overload],
               "streaming": [asdict(r) for r in streaming]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
