"""Replay a Mooncake trace through each router on fresh simulated PD pods (`--phases trace`).

    python -m benchmarks --phases trace [--trace PATH] [--trace-window 800] ...
    python -m benchmarks.trace_bench --trace PATH --out DIR     # this phase alone

Per router (pdgate's `local`, `global`, `global-precise`, `global-slo` policies; vLLM
Router `cache_aware` and `round_robin`): a fresh Mooncake master and G PD groups whose
prefill engines read prefix blocks from the Mooncake Store (`--store-prefix-cache`; not
for `local`, Mooncake's "local cache-aware" baseline, where a prefix is reused only on
the engine that computed it), compute one
prompt at a time (`engine_sim.compute`; a store read waits beside that line, as vLLM's
KV connector loads before the request is scheduled) and hold `--trace-cache-share`
(default 15%) of the window's distinct prompt tokens in their own KV cache: how much of
the reuse `local` can keep without the pool depends on it. KV moves at the simulator's MLA
bytes per token over 12.5 GB/s; the store carries 64-byte proofs per block.

The prefill cost per token is derived from the window so that the prefill pods would be
`busy` (default 80%) without any cache: busy x G x window duration / prompt tokens. Every
pdgate policy is told that cost as its seed (`costModel.prefillSecondsPerToken`) and
calibrates from there; the ModelServer is annotated `pdgate.io/kv-pool: mooncake-store`
(the `local` policy turns the pool view off). `global-slo` adds Conductor's early
rejection: a request predicted beyond the SLO gets a 429 at once (counted as missed).

TTFT SLOs (stated in the report; `TraceSLO`): the flat one is the prefill time of the
window's 90th-percentile prompt, uncached, on an idle pod, with its ceiling: the share of
requests that would compute no more than that prompt even if every block an earlier
request had were cached (`trace.best_within`; about 92% on the published traces' first
800 requests), which no router can beat. Every prompt longer than the p90 one misses a
flat SLO unless it is cached, however it is routed, so the report also counts a
length-aware SLO: a request's target is the flat one or `LENGTH_FACTOR` (2) x its own
prompt's uncached prefill on an idle pod, whichever is longer (a long prompt may wait as
long as its own prefill takes, a short one is held to the flat target). Its ceiling is
100%: any request fits it on an idle cluster. `global-slo` gates on the same target
(`sloAdmission.lengthFactor`). The paper's own threshold (30 s for prompts of up to 128k
tokens on 8 A800s) is flat but sits near the longest prompt's prefill: every request can
meet it, which neither a p90-prompt flat target nor any flat target short of the longest
prompt allows. Hit rates are the engines' own counters
(`vllm:prefix_cache_*`: local; `vllm:external_prefix_cache_*`: read from the store) over
the prefill pods, against the window's best possible (`trace.best_hit_rate`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from benchmarks.cluster import MODEL, ClusterShape, PodSpec, SimCluster
from benchmarks.loadgen import LoadLimits, run_at
from benchmarks.procs import StartupError, main_thread_cpu_seconds
from benchmarks.routers import RouterSpec, RunningRouter
from benchmarks.specs import RequestSpec
from benchmarks.trace import DEFAULT_TRACE, TraceOptions, TraceWindow, trace_window
from engine_sim.block_hash import DEFAULT_HASH_SEED
from engine_sim.prompts import DEFAULT_CHAT_TEMPLATE, DEFAULT_TOKENIZER
from router.tokenization import CHAT_TEMPLATE_ANNOTATION, TOKENIZER_ANNOTATION

log = logging.getLogger("benchmarks.trace")

#: The ModelServer's annotations: its prefill pods write every block to the Mooncake
#: Store (the pool view), and the engines' tokenizer and chat template (precise index).
POOL_ANNOTATIONS: Final = {
    "pdgate.io/kv-pool": "mooncake-store",
    TOKENIZER_ANNOTATION: DEFAULT_TOKENIZER,
    CHAT_TEMPLATE_ANNOTATION: str(DEFAULT_CHAT_TEMPLATE),
}
PREFILL_OVERHEAD_MS: Final = 5.0  # the simulator's default --prefill-overhead-ms
#: k of the length-aware TTFT SLO: max(flat SLO, k x the prompt's own idle prefill).
LENGTH_FACTOR: Final = 2.0
_HEADER: Final = "apiVersion: pdgate.io/v1alpha1\nkind: SchedulerConfig\n"
#: Queue time: the prefill seconds this router has queued on each pod (Conductor's
#: estimate), plus the engine's own waiting queue (weighted half: it counts ours too).
_LOAD: Final = ("      - {type: prefill-backlog, weight: 1.0}\n"
                "      - {type: queue, weight: 0.5, threshold: 32}\n")


def _policy(prefix: str, pool: bool, precise: bool, seeded: bool = False) -> str:
    """`seeded`: the router is told the engines' PYTHONHASHSEED (the pods run with
    `DEFAULT_HASH_SEED`), so the precise index keys blocks by the engines' own hashes
    instead of recomputing router keys from each event's token ids."""
    body = (f"profiles:\n  prefill:\n    unit: ttft\n    scorers:\n"
            f"      - {{type: {prefix}, weight: 1.0}}\n{_LOAD}")
    body += f"poolView: {{enabled: {'true' if pool else 'false'}}}\n"
    if precise:
        seed = f", hashSeed: '{DEFAULT_HASH_SEED}'" if seeded else ""
        body += f"preciseIndex: {{enabled: true{seed}}}\n"
    return body


#: pdgate's policies on a trace: name -> scheduler YAML body (the cost model is appended).
TRACE_POLICIES: Final[dict[str, str]] = {
    "local": _policy("prefix-cache", pool=False, precise=False),
    "global": _policy("prefix-cache", pool=True, precise=False),
    "global-precise": _policy("precise-prefix-cache", pool=True, precise=True),
    "global-precise-seeded": _policy("precise-prefix-cache", pool=True, precise=True,
                                     seeded=True),
    # `global` with Conductor's early rejection: a request whose best predicted TTFT is
    # beyond the window's SLO is answered 429 at once (counted as outside the SLO).
    "global-slo": _policy("prefix-cache", pool=True, precise=False),
}
#: What `--phases trace` runs unless `--trace-policies` says otherwise (the seeded precise
#: index is opt-in: it differs from `global-precise` only in the router's CPU and memory).
DEFAULT_POLICIES: Final = ("local", "global", "global-precise", "global-slo")
PEERS: Final = ("cache_aware", "round_robin")
#: Policies whose prefill engines do not read the pool (Mooncake's "local cache-aware"
#: scheduling: a prefix is reused only where it was computed; no pulls from the store).
LOCAL_ONLY: Final = frozenset({"local"})
#: Each prefill engine's own KV cache, as a share of the window's distinct prompt tokens
#: (about 1.4M tokens of the unscaled conversation trace's first 800 requests).
CACHE_SHARE: Final = 0.15


@dataclass(frozen=True, slots=True)
class TraceBenchConfig:
    groups: int = 4
    busy: float = 0.8
    capacity_share: float = CACHE_SHARE
    request_timeout: float = 180.0
    policies: tuple[str, ...] = DEFAULT_POLICIES
    peers: tuple[str, ...] = PEERS


def idle_prefill_s(tokens: int, per_token_ms: float) -> float:
    """What computing `tokens` takes on an idle simulated pod."""
    return (PREFILL_OVERHEAD_MS + tokens * per_token_ms) / 1e3


@dataclass(frozen=True, slots=True)
class TraceSLO:
    """The report's two TTFT SLOs for one window (module docstring)."""

    per_token_ms: float
    flat_tokens: int
    flat_s: float
    #: The length-aware target of each request, in window order (seconds).
    targets: tuple[float, ...]

    def prefill_s(self, tokens: int) -> float:
        return idle_prefill_s(tokens, self.per_token_ms)

    @classmethod
    def of(cls, window: TraceWindow, per_token_ms: float) -> TraceSLO:
        flat_tokens = window.input_quantile(0.9)
        flat = idle_prefill_s(flat_tokens, per_token_ms)
        targets = tuple(max(flat, LENGTH_FACTOR * idle_prefill_s(t, per_token_ms))
                        for t in window.input_tokens())
        return cls(per_token_ms, flat_tokens, flat, targets)


@dataclass(slots=True)
class TraceRun:
    trace: str
    router: str
    requests: int
    ok: int
    ttfts: list[float]
    slo_s: float
    #: Share of all requests within the length-aware SLO (`TraceSLO.targets`).
    within_length_slo: float
    #: Requests answered 429 (`global-slo`'s early rejection; counted as outside the SLOs).
    refused: int
    local_hit: float
    store_hit: float
    best_hit: float
    router_cpu_s: float | None
    #: The router's main thread (its event loop, where KV events are applied).
    main_cpu_s: float | None
    peak_rss: int | None
    wall_s: float
    load_before: float
    load_after: float
    prediction: dict[str, float] = field(default_factory=dict)

    def quantile(self, q: float) -> float:
        values = sorted(self.ttfts)
        if not values:
            return float("nan")
        return values[min(len(values) - 1, int(q * len(values)))]

    @property
    def mean(self) -> float:
        return sum(self.ttfts) / len(self.ttfts) if self.ttfts else float("nan")

    @property
    def within_slo(self) -> float:
        return sum(1 for t in self.ttfts if t <= self.slo_s) / max(1, self.requests)


def _counters(pod: PodSpec) -> dict[str, float]:
    with urllib.request.urlopen(f"{pod.base_url}/metrics", timeout=5) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")
        if "prefix_cache_" in name:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _engine_hits(pods: list[PodSpec]) -> dict[str, float]:
    total: dict[str, float] = {}
    for pod in pods:
        for key, value in _counters(pod).items():
            total[key] = total.get(key, 0.0) + value
    return total


def _router_prediction(base_url: str) -> dict[str, float]:
    """The TTFT model's figures and the CPU of its background work (KV events, tokenizing)
    from pdgate's /metrics (empty for other routers)."""
    try:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pdgate_scheduler_prefill_fit{"):
            term = line.split('term="', 1)[1].split('"', 1)[0]
            out[f"fit_{term}"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("pdgate_scheduler_prefill_prediction_error_seconds_sum"):
            out["abs_error_sum"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("pdgate_scheduler_prefill_prediction_error_seconds_count"):
            out["abs_error_count"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("pdgate_background_cpu_seconds_total{"):
            work = line.split('work="', 1)[1].split('"', 1)[0]
            out[f"cpu_{work}"] = float(line.rsplit(" ", 1)[1])
    return out


def shape_for(window: TraceWindow, config: TraceBenchConfig) -> tuple[ClusterShape, float]:
    """The pods for a window, and the derived prefill cost (ms per token)."""
    duration = max(1.0, window.duration_s)
    per_token_s = config.busy * config.groups * duration / max(1, window.prompt_tokens)
    capacity = max(256, int(config.capacity_share * window.unique_tokens() / 16))
    common = ("--prefill-per-token-ms", f"{per_token_s * 1e3:.6g}", "--itl-ms", "5",
              "--kv-block-bytes", "64", "--max-model-len", "262144", "--max-waiting", "4096",
              "--kv-capacity-blocks", "65536")
    prefill = ("--store-prefix-cache", "--kv-capacity-blocks", str(capacity))
    return ClusterShape("pd", config.groups, sim_flags=common, prefill_flags=prefill), (
        per_token_s * 1e3
    )


def specs_for(
    config: TraceBenchConfig, per_token_ms: float, slo_s: float
) -> list[RouterSpec]:
    cost = (f"costModel:\n  prefillSecondsPerToken: {per_token_ms / 1e3:.6g}\n"
            f"  prefillOverhead: {PREFILL_OVERHEAD_MS / 1e3:g}\n")
    gate = (f"sloAdmission: {{enabled: true, ttftTarget: {slo_s * 1e3:.0f}ms, "
            f"lengthFactor: {LENGTH_FACTOR:g}, action: reject}}\n")
    out = [RouterSpec("pdgate", name, _HEADER + TRACE_POLICIES[name] + cost
                      + (gate if name.endswith("-slo") else ""))
           for name in config.policies]
    out += [RouterSpec("vllm-router", peer) for peer in config.peers]
    return out


async def replay(
    window: TraceWindow, config: TraceBenchConfig, work_dir: Path
) -> tuple[list[TraceRun], dict[str, Any]]:
    shape, per_token_ms = shape_for(window, config)
    slo = TraceSLO.of(window, per_token_ms)
    setup = {
        "trace": window.name, "requests": len(window.requests),
        "start": window.options.start, "duration_s": round(window.duration_s, 1),
        "time_scale": window.options.time_scale, "token_scale": window.options.token_scale,
        "prompt_tokens": window.prompt_tokens, "best_hit_rate": window.best_hit_rate,
        "prefill_ms_per_token": per_token_ms, "slo_s": slo.flat_s,
        "slo_ceiling": window.best_within(slo.flat_tokens), "length_factor": LENGTH_FACTOR,
        "p90_floor_s": slo.prefill_s(window.best_uncached_quantile(0.9)),
        "groups": config.groups,
        "sim_flags": " ".join(shape.sim_flags), "prefill_flags": " ".join(shape.prefill_flags),
    }  # fmt: skip
    runs: list[TraceRun] = []
    sessions = [(spec,) for spec in window.specs]
    limits = LoadLimits(time_limit=window.duration_s + 1.0,
                        request_timeout=config.request_timeout)
    skipped: list[str] = []
    setup["skipped"] = skipped
    for spec in specs_for(config, per_token_ms, slo.flat_s):
        try:
            run = await _one_router(spec, window, shape, sessions, limits, slo, work_dir)
        except (StartupError, OSError) as exc:  # one router failing: go on with the next
            first = str(exc).splitlines()[0] if str(exc) else repr(exc)
            skipped.append(f"{spec.name}: {first}")
            log.error("trace %s: %s failed: %s", window.name, spec.name, first)
            continue
        runs.append(run)
        log.warning("  p50 %.2f p90 %.2f s, hit %.1f%% + %.1f%% (best %.1f%%), ok %d/%d",
                    run.quantile(0.5), run.quantile(0.9), 100 * run.local_hit,
                    100 * run.store_hit, 100 * run.best_hit, run.ok, run.requests)
    return runs, setup


async def _one_router(
    spec: RouterSpec,
    window: TraceWindow,
    shape: ClusterShape,
    sessions: list[tuple[RequestSpec]],
    limits: LoadLimits,
    slo: TraceSLO,
    work_dir: Path,
) -> TraceRun:
    if spec.kind == "pdgate" and spec.policy in LOCAL_ONLY:
        # The paper's local cache-aware baseline: each engine reuses only its own cache.
        flags = tuple(f for f in shape.prefill_flags if f != "--store-prefix-cache")
        shape = dataclasses.replace(shape, prefill_flags=flags)
    cluster = SimCluster(shape, work_dir / "logs", server_annotations=dict(POOL_ANNOTATIONS))
    try:
        cluster.start()
        with RunningRouter(spec, cluster, work_dir) as router:
            log.warning("trace %s: %s", window.name, spec.name)
            before = _engine_hits(cluster.prefill)
            cpu0 = router.cpu_seconds()
            main0 = _main_thread_cpu(router)
            load0 = os.getloadavg()[0]
            began = time.monotonic()
            load = await run_at(router.target, sessions, window.offsets, limits)
            wall = time.monotonic() - began
            cpu1 = router.cpu_seconds()
            main1 = _main_thread_cpu(router)
            after = _engine_hits(cluster.prefill)
            prediction = (
                _router_prediction(router.target.base_url)  # type: ignore[attr-defined]
                if spec.kind == "pdgate" else {}
            )
            load1 = os.getloadavg()[0]
    finally:
        cluster.stop()
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    queries = delta.get("vllm:prefix_cache_queries", 0.0)
    return TraceRun(
        trace=window.name, router=spec.name, requests=len(sessions),
        ok=sum(1 for r in load.results if r.ok),
        ttfts=[r.ttft for r in load.results if r.ok and r.ttft is not None],
        slo_s=slo.flat_s,
        within_length_slo=sum(
            1 for r in load.results
            if r.ok and r.ttft is not None and r.ttft <= slo.targets[r.session]
        ) / max(1, len(sessions)),
        refused=sum(1 for r in load.results if r.status == 429),
        local_hit=delta.get("vllm:prefix_cache_hits", 0.0) / queries if queries else 0.0,
        store_hit=(delta.get("vllm:external_prefix_cache_hits", 0.0) / queries
                   if queries else 0.0),
        best_hit=window.best_hit_rate,
        router_cpu_s=None if cpu0 is None or cpu1 is None else cpu1 - cpu0,
        main_cpu_s=None if main0 is None or main1 is None else main1 - main0,
        peak_rss=router.peak_rss, wall_s=wall, load_before=load0, load_after=load1,
        prediction=prediction,
    )  # fmt: skip


def _main_thread_cpu(router: RunningRouter) -> float | None:
    process = router.process
    return None if process is None else main_thread_cpu_seconds(process.pid)


def _fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _fmt_mb(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def render(results: list[tuple[dict[str, Any], list[TraceRun]]]) -> str:
    lines = ["# Mooncake trace replay", ""]
    for setup, runs in results:
        lines += [
            f"## {setup['trace']}: requests {setup['start']}..{setup['start'] + setup['requests']}"
            f" ({setup['duration_s']} s at time scale {setup['time_scale']}, token scale "
            f"{setup['token_scale']})", "",
            f"{setup['groups']} PD groups; prefill {setup['prefill_ms_per_token']:.4f} ms a "
            f"token (80% busy without cache); TTFT SLO {setup['slo_s']:.2f} s (uncached "
            f"prefill of the window's p90 prompt on an idle pod; no router can bring more "
            f"than {100 * setup.get('slo_ceiling', 1.0):.1f}% of requests within it: the "
            f"rest compute more than that even with every block an earlier request had "
            f"cached); length-aware TTFT SLO: that, or {setup.get('length_factor', 2):g}x "
            f"the request's own uncached prefill on an idle pod, whichever is longer "
            f"(ceiling 100%); TTFT p90 floor {setup.get('p90_floor_s', 0.0):.2f} s (the p90 "
            f"of each request's prefill with every block an earlier request had cached, on "
            f"idle pods: no router that answers every request has a lower p90); best "
            f"possible hit "
            f"{100 * setup['best_hit_rate']:.1f}%. Engines: `{setup['sim_flags']}`, prefill "
            f"`{setup['prefill_flags']}`.", "",
            "| router | TTFT mean | p50 | p90 | p99 (s) | within SLO | within length-aware "
            "SLO | hit local + store | of best | router CPU (s) | peak RSS (MB) | ok "
            "| refused (429) | load avg |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
            "| --- |",
        ]
        for r in runs:
            hit = r.local_hit + r.store_hit
            lines.append(
                f"| {r.router} | {r.mean:.2f} | {r.quantile(0.5):.2f} | {r.quantile(0.9):.2f} "
                f"| {r.quantile(0.99):.2f} | {100 * r.within_slo:.1f}% "
                f"| {100 * r.within_length_slo:.1f}% "
                f"| {100 * r.local_hit:.1f}% + {100 * r.store_hit:.1f}% "
                f"| {100 * hit / r.best_hit if r.best_hit else 0:.0f}% "
                f"| {'-' if r.router_cpu_s is None else f'{r.router_cpu_s:.1f}'} "
                f"| {_fmt_mb(r.peak_rss)} | {r.ok}/{r.requests} | {r.refused} "
                f"| {r.load_before:.1f}->{r.load_after:.1f} |"
            )
        lines.append("")
        for skipped in setup.get("skipped", []):
            lines.append(f"Skipped: {skipped}")
        preds = [r for r in runs if r.prediction]
        if preds:
            lines += ["Prefill-phase prediction (pdgate's calibrated model): ", "",
                      "| policy | fit a (s) | b (ms/token) | c | samples | mean abs error (s) "
                      "| relative error, recent |", "| --- | --- | --- | --- | --- | --- | --- |"]
            for r in preds:
                p = r.prediction
                count = p.get("abs_error_count", 0.0)
                mean_abs = p.get("abs_error_sum", 0.0) / count if count else float("nan")
                lines.append(
                    f"| {r.router} | {p.get('fit_a', float('nan')):.3f} "
                    f"| {1e3 * p.get('fit_b', float('nan')):.4f} | {p.get('fit_c', 0):.2e} "
                    f"| {p.get('fit_samples', 0):.0f} | {mean_abs:.3f} "
                    f"| {100 * p.get('fit_error_ratio', float('nan')):.0f}% |"
                )
            lines += ["", "Mean abs error: over every prefill of the run "
                      "(`pdgate_scheduler_prefill_prediction_error_seconds`). Relative error, "
                      "recent: the router's at the end of the run "
                      "(`pdgate_scheduler_prefill_fit{term=\"error_ratio\"}`: the running "
                      "mean error over the running mean duration, each prefill weighted "
                      "0.05, about its last 20).", "",
                      "Where pdgate's CPU went (s): the router's main thread (its event "
                      "loop) and its other threads, and in them the work "
                      "`pdgate_background_cpu_seconds` times where it runs (KV events on the "
                      "loop, tokenizing in its own thread):", "",
                      "| policy | router CPU | main thread | of it KV events | other threads "
                      "| of them tokenizing |", "| --- | --- | --- | --- | --- | --- |"]
            for r in preds:
                events = r.prediction.get("cpu_kv_events", 0.0)
                tokenize = r.prediction.get("cpu_tokenize", 0.0)
                total, main = r.router_cpu_s, r.main_cpu_s
                others = None if total is None or main is None else total - main
                lines.append(
                    f"| {r.router} | {_fmt_s(total)} | {_fmt_s(main)} | {events:.2f} "
                    f"| {_fmt_s(others)} | {tokenize:.2f} |"
                )
            lines.append("")
    return "\n".join(lines)


def plot(results: list[tuple[dict[str, Any], list[TraceRun]]], out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    drawn: list[str] = []
    for setup, runs in results:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        for r in runs:
            values = sorted(r.ttfts)
            if values:
                ax1.plot(values, [(i + 1) / r.requests for i in range(len(values))],
                         label=r.router)
        ax1.axvline(setup["slo_s"], color="grey", linestyle="--", label="SLO")
        ax1.set_xscale("log")
        ax1.set_xlabel("TTFT (s)")
        ax1.set_ylabel("share of requests")
        ax1.legend(fontsize=7)
        names = [r.router for r in runs]
        ax2.bar(names, [100 * r.local_hit for r in runs], label="local")
        ax2.bar(names, [100 * r.store_hit for r in runs],
                bottom=[100 * r.local_hit for r in runs], label="from store")
        ax2.axhline(100 * setup["best_hit_rate"], color="grey", linestyle="--", label="best")
        ax2.set_ylabel("prefix hit rate (%)")
        ax2.tick_params(axis="x", labelrotation=30, labelsize=7)
        ax2.legend(fontsize=7)
        fig.suptitle(f"{setup['trace']} ({setup['requests']} requests)")
        fig.tight_layout()
        name = f"trace_{setup['trace']}.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        drawn.append(name)
    return drawn


async def run_traces(
    paths: list[Path], options: TraceOptions, config: TraceBenchConfig, out: Path, seed: int = 0
) -> list[tuple[dict[str, Any], list[TraceRun]]]:
    results = []
    for path in paths:
        window = trace_window(path, options, MODEL, seed)
        runs, setup = await replay(window, config, out / "raw")
        results.append((setup, runs))
        (out / "trace.md").write_text(render(results))  # after each trace: nothing lost
    (out / "trace.md").write_text(render(results))
    (out / "trace.json").write_text(json.dumps(
        [{"setup": s, "runs": [asdict(r) for r in runs]} for s, runs in results], indent=1))
    plot(results, out)
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--trace", type=Path, action="append",
        help=f"a Mooncake trace file (repeatable; default {DEFAULT_TRACE} when present)")
    add("--trace-start", type=int, default=0, help="first request of the window")
    add("--trace-window", type=int, default=800, help="requests replayed")
    add("--trace-time-scale", type=float, default=0.4,
        help="x the gaps (0.4: 2.5 times the rate, engines 2.5 times faster)")
    add("--trace-token-scale", type=float, default=0.25, help="x every length (0.25: 128-token "
        "blocks)")
    add("--trace-max-output", type=int, default=16, help="cap on output tokens")
    add("--trace-groups", type=int, default=4, help="PD groups")
    add("--trace-cache-share", type=float, default=CACHE_SHARE,
        help="each prefill engine's own KV cache, as a share of the window's distinct "
             "prompt tokens")
    add("--trace-policies", default=",".join(DEFAULT_POLICIES),
        help=f"pdgate policies, of: {', '.join(TRACE_POLICIES)}")
    add("--trace-peers", default=",".join(PEERS), help="vLLM Router policies")


def options_of(args: argparse.Namespace) -> tuple[list[Path], TraceOptions, TraceBenchConfig]:
    paths = args.trace or ([DEFAULT_TRACE] if DEFAULT_TRACE.exists() else [])
    options = TraceOptions(args.trace_start, args.trace_window, args.trace_time_scale,
                           args.trace_token_scale, args.trace_max_output)
    policies = tuple(p for p in args.trace_policies.split(",") if p)
    unknown = [p for p in policies if p not in TRACE_POLICIES]
    if unknown:
        raise SystemExit(f"unknown trace policies {unknown} (known: {list(TRACE_POLICIES)})")
    if not 0 < args.trace_cache_share <= 1:
        raise SystemExit("--trace-cache-share must be in (0, 1]")
    config = TraceBenchConfig(groups=args.trace_groups, policies=policies,
                              peers=tuple(p for p in args.trace_peers.split(",") if p),
                              capacity_share=args.trace_cache_share)
    return paths, options, config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level="WARNING", format="%(levelname)s %(name)s: %(message)s")
    paths, options, config = options_of(args)
    if not paths:
        raise SystemExit("no trace: pass --trace PATH")
    args.out.mkdir(parents=True, exist_ok=True)
    asyncio.run(run_traces(paths, options, config, args.out, args.seed))
    print((args.out / "trace.md").read_text())


if __name__ == "__main__":
    main()
