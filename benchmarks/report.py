"""The Markdown report: medians and ratios, never a lone absolute time without its floor."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.figures import (
    OverheadRow,
    OverloadPoint,
    SchedulingRow,
    StreamingRow,
    SweepPoint,
    best_pdgate,
)
from benchmarks.stats import minus, ratio

MODE_TITLE = {"agg": "non-PD (aggregated pods)", "pd": "PD (prefill/decode pairs, NIXL handles)"}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.2f}"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def render(
    meta: dict[str, Any],
    overhead: Sequence[OverheadRow],
    sweep: Sequence[SweepPoint],
    scheduling: Sequence[SchedulingRow],
    plots: Sequence[str],
    overload: Sequence[OverloadPoint] = (),
    streaming: Sequence[StreamingRow] = (),
) -> str:
    out: list[str] = [
        f"# pdgate benchmark: {meta['date']} ({meta['preset']})",
        "",
        f"One run on one machine ({meta['machine']}), every router on the same simulated "
        f"pods with the same seeded request sequence (seed {meta['seed']}). Absolute times "
        "are of a shared, noisy 2-core machine: read the ratios. Took "
        f"{meta['elapsed_s']:.0f} s. Peers: {meta['peers']}. pdgate's scheduling hot path: "
        f"{meta.get('compiled', 'pure Python (not compiled)')}.",
        "",
    ]
    if meta.get("skipped"):
        out += ["**Skipped (time budget or failure):** " + "; ".join(meta["skipped"]), ""]
    out += _headline_section(overhead, scheduling)
    out += _overhead_section(overhead)
    out += _sweep_section(sweep)
    out += _overload_section(overload)
    out += _streaming_section(streaming)
    out += _scheduling_section(scheduling)
    out += _resources_section(overhead, scheduling)
    out += _tokenization_section(meta.get("tokenization"))
    out += _decision_section(meta.get("decision"))
    if plots:
        out += ["## Plots", ""]
        out += [f"![{name}]({name})" for name in plots]
        out.append("")
    out += ["## Method", "", *meta.get("method", []), ""]
    return "\n".join(out)


def _tokenization_section(costs: dict[str, list[float]] | None) -> list[str]:
    """`benchmarks.tokenization`: what the router's own tokenizer costs per request."""
    if not costs:
        return []
    out = [
        "## Tokenization cost per request",
        "",
        "The router's tokenizer path (`router.tokenization`) with the real DeepSeek tokenizer "
        "(128k BPE) and the simulator's DeepSeek-V3-style chat template, in-process on one "
        "thread; cold = a new text each time, warm = the same request again (memoized "
        "pieces). The last line is the event-loop side of one hand-off to the tokenize pool.",
        "",
    ]
    return out + _micros_table(costs, digits=0)


def _decision_section(costs: dict[str, list[float]] | None) -> list[str]:
    """`benchmarks.decision`: the scheduler's time to pick the pods of one request."""
    if not costs:
        return []
    out = [
        "## Scheduler decision time per request",
        "",
        "`PipelineScheduler.pick` in-process (`benchmarks.decision`): the default profile "
        "(approximate prefix index + load scorers) on an aggregated server and on a PD "
        "server (groups of 2 prefill + 2 decode pods), the PD server with new 8 KB prompts "
        "(nothing shared: every block hashed and recorded new), and the precise profile on the PD "
        "server (the request tokenized with the real DeepSeek tokenizer and hashed as the "
        "engine does; prompts of words of letters, and again of words like `w123`, \"no "
        "letters\", the tokenizer's worst text), with a warm index and fresh engine "
        "metrics; the quietest of three rounds.",
        "",
    ]
    return out + _micros_table(costs, digits=1)


def _micros_table(costs: dict[str, list[float]], digits: int) -> list[str]:
    """A `case | p50 µs | p90 µs` table (the tokenization and decision sections)."""
    rows = [f"| {case} | {p50:,.{digits}f} | {p90:,.{digits}f} |"
            for case, (p50, p90) in costs.items()]
    return ["| case | p50 µs | p90 µs |", "|---|---:|---:|", *rows, ""]


def _headline_section(
    over: Sequence[OverheadRow], sched: Sequence[SchedulingRow]
) -> list[str]:
    out = ["## Headline figures", ""]
    for mode in dict.fromkeys(r.mode for r in over):
        by_kind = {r.kind: r for r in over if r.mode == mode}
        pd, vl = by_kind.get("pdgate"), by_kind.get("vllm-router")
        if pd is None or vl is None:
            continue
        out.append(
            f"- Overhead, {MODE_TITLE.get(mode, mode)}: added latency over direct p50/p99 "
            f"pdgate {_ms(pd.added_p50)}/{_ms(pd.added_p99)} ms, vLLM Router "
            f"{_ms(vl.added_p50)}/{_ms(vl.added_p99)} ms, at concurrency 1 (sequential "
            f"client) pdgate {_ms(pd.c1_added_p50)} ms, vLLM Router {_ms(vl.c1_added_p50)} ms "
            f"p50 (pdgate minus vLLM Router, E2E "
            f"p50/p99: {_ms(minus(pd.e2e_p50, vl.e2e_p50))}/"
            f"{_ms(minus(pd.e2e_p99, vl.e2e_p99))} ms); max req/s at c=64 pdgate "
            f"{_num(pd.max_rps, 0)}, vLLM Router {_num(vl.max_rps, 0)} "
            f"(pdgate/vLLM Router {_x(ratio(pd.max_rps, vl.max_rps))}); CPU s/1k req "
            f"{_num(pd.cpu_per_1k, 2)} vs {_num(vl.cpu_per_1k, 2)}; peak RSS "
            f"{_num(pd.peak_rss_mib)} vs {_num(vl.peak_rss_mib)} MiB."
        )
    for mode in dict.fromkeys(r.mode for r in sched):
        for workload in dict.fromkeys(r.workload for r in sched if r.mode == mode):
            rows = [r for r in sched if r.mode == mode and r.workload == workload]
            best = best_pdgate(rows, mode, workload)
            if best is None:
                continue
            peers = "; ".join(
                f"{r.router} {_ms(r.ttft_p50)}/{_ms(r.ttft_p90)} ms, {_pct(r.hit_rate)}"
                for r in rows if r.kind != "pdgate"
            )
            out.append(
                f"- `{workload}` ({MODE_TITLE.get(mode, mode).split(' (')[0]}), TTFT p50/p90 "
                f"and prefix hit rate: best pdgate policy {best.router} "
                f"{_ms(best.ttft_p50)}/{_ms(best.ttft_p90)} ms, {_pct(best.hit_rate)}; {peers}."
            )
    out.append("")
    return out if len(out) > 3 else []


def _overhead_section(rows: Sequence[OverheadRow]) -> list[str]:
    if not rows:
        return []
    out = [
        "## Overhead (`overhead` workload, `--fast` engines)",
        "",
        "E2E latency at low concurrency (pooled over interleaved rounds), added latency over "
        "the direct floor, the added latency at concurrency 1 from a sequential client "
        "(`benchmarks/sequential.py`, one keep-alive connection, blocking sockets; p50 / p99), "
        "and the maximum sustained requests/s at concurrency 64 (closed loop, "
        "median of rounds). CPU is the router process tree's user+system seconds per 1,000 "
        "successful requests.",
        "",
    ]
    for mode in dict.fromkeys(r.mode for r in rows):
        mine = [r for r in rows if r.mode == mode]
        direct = next((r for r in mine if r.kind == "direct"), None)
        out += [f"### {MODE_TITLE.get(mode, mode)}", ""]
        out += _table(
            ["router", "E2E p50 ms", "E2E p99 ms", "added p50 ms", "added p99 ms",
             "added @1 ms", "max req/s @64", "vs direct", "CPU s/1k req", "peak RSS MiB",
             "errors"],
            [[r.router, _ms(r.e2e_p50), _ms(r.e2e_p99), _ms(r.added_p50), _ms(r.added_p99),
              f"{_ms(r.c1_added_p50)} / {_ms(r.c1_added_p99)}", _num(r.max_rps, 0),
              _x(ratio(r.max_rps, direct.max_rps if direct else None)),
              _num(r.cpu_per_1k, 2), _num(r.peak_rss_mib), f"{r.errors}/{r.requests}"]
             for r in mine],
        )  # fmt: skip
        pd = next((r for r in mine if r.kind == "pdgate"), None)
        vl = next((r for r in mine if r.kind == "vllm-router"), None)
        if pd and vl:
            out += [
                "",
                f"pdgate / vLLM Router: added latency p50 {_x(ratio(pd.added_p50, vl.added_p50))}"
                f", p99 {_x(ratio(pd.added_p99, vl.added_p99))}; at concurrency 1, pdgate "
                f"{_ms(pd.c1_added_p50)} ms against {_ms(vl.c1_added_p50)} ms (p50); max req/s "
                f"{_x(ratio(pd.max_rps, vl.max_rps))}; CPU per request "
                f"{_x(ratio(pd.cpu_per_1k, vl.cpu_per_1k))}; peak RSS "
                f"{_x(ratio(pd.peak_rss_mib, vl.peak_rss_mib))}.",
            ]
        out.append("")
    return out


def _sweep_section(points: Sequence[SweepPoint]) -> list[str]:
    if not points:
        return []
    out = ["## Throughput against offered load (open loop, Poisson, `overhead` workload)", ""]
    for mode in dict.fromkeys(p.mode for p in points):
        mine = [p for p in points if p.mode == mode]
        routers = list(dict.fromkeys(p.router for p in mine))
        levels = sorted(set(round(p.offered, 1) for p in mine))
        out += [f"### {MODE_TITLE.get(mode, mode)}: achieved req/s (E2E p50 ms)", ""]
        rows = []
        for level in levels:
            row = [f"{level:.0f}"]
            for router in routers:
                hit = next((p for p in mine
                            if p.router == router and round(p.offered, 1) == level), None)
                row.append("-" if hit is None else
                           f"{hit.achieved:.0f} ({_ms(hit.e2e_p50)})"
                           + (f" {hit.errors} err" if hit.errors else ""))
            rows.append(row)
        out += _table(["offered req/s", *routers], rows)
        out.append("")
    return out


def _overload_section(points: Sequence[OverloadPoint]) -> list[str]:
    if not points:
        return []
    out = [
        "## Overload (open loop, Poisson, multiples of pdgate's own maximum)",
        "",
        "The load generator runs on a core of its own, the routers and pods on the other(s); "
        "every router's closed-loop maximum is measured first under the same pins. "
        "Goodput = successful requests per second of the run, as a share of pdgate's "
        "maximum. `shed` = answered 503/429 at once; `timeouts` = the "
        "client gave up. CPU per 1,000 successful requests, and against the same router's "
        "at its maximum.",
        "",
    ]
    for mode in dict.fromkeys(p.mode for p in points):
        mine = [p for p in points if p.mode == mode]
        out += [f"### {MODE_TITLE.get(mode, mode)}", ""]
        out += _table(
            ["load", "router", "goodput req/s", "share of max", "shed", "timeouts",
             "other errors", "E2E p99 ms (ok)", "CPU s/1k ok", "CPU vs at max"],
            [[f"{p.multiple:.1f}x ({p.multiple * p.reference:.0f} req/s)", p.router,
              _num(p.goodput, 0), _num(p.share, 2), f"{p.shed}/{p.requests}",
              str(p.timeouts), str(p.other_errors), _ms(p.e2e_p99), _num(p.cpu_per_1k, 2),
              _x(p.cpu_rise)]
             for p in sorted(mine, key=lambda p: (p.multiple, p.kind))],
        )  # fmt: skip
        for multiple in sorted({round(p.multiple, 2) for p in mine}):
            at = [p for p in mine if round(p.multiple, 2) == multiple]
            pd = next((p for p in at if p.kind == "pdgate"), None)
            vl = next((p for p in at if p.kind == "vllm-router"), None)
            if pd and vl:
                out += ["", f"At {multiple:g}x: pdgate / vLLM Router goodput "
                            f"{_x(ratio(pd.goodput, vl.goodput))}, CPU per success "
                            f"{_x(ratio(pd.cpu_per_1k, vl.cpu_per_1k))}."]
        out.append("")
    return out


def _streaming_section(rows: Sequence[StreamingRow]) -> list[str]:
    if not rows:
        return []
    out = [
        "## Streaming (long streams, closed loop)",
        "",
        "Chunks relayed per second, router CPU per 1,000 content chunks, and the TTFT and ITL "
        "the client sees, added over the direct floor at the same concurrency. At each level "
        "the load generator holds all streams but one; the last is the probe client's "
        "(`benchmarks.probe`): short streams one at a time from a process of its own, whose "
        "TTFT is what one more user sees beside the load. The generator's TTFT also counts "
        "the time its one event loop takes to reach a stream among all the others'.",
        "",
    ]
    for mode in dict.fromkeys(r.mode for r in rows):
        mine = sorted((r for r in rows if r.mode == mode), key=lambda r: r.concurrency)
        out += [f"### {MODE_TITLE.get(mode, mode)}", ""]
        out += _table(
            ["streams", "router", "chunks/s", "CPU s/1k chunks", "TTFT p50/p99 ms",
             "added TTFT p50/p99 ms", "ITL p50/p99 ms", "added ITL p50/p99 ms", "errors",
             "probe TTFT p50 ms (added)", "probe errors"],
            [[str(r.concurrency), r.router, _num(r.chunks_per_s, 0),
              _num(r.cpu_per_1k_chunks, 3), f"{_ms(r.ttft_p50)}/{_ms(r.ttft_p99)}",
              f"{_ms(r.added_ttft_p50)}/{_ms(r.added_ttft_p99)}",
              f"{_ms(r.itl_p50)}/{_ms(r.itl_p99)}",
              f"{_ms(r.added_itl_p50)}/{_ms(r.added_itl_p99)}", f"{r.errors}/{r.requests}",
              f"{_ms(r.probe_ttft_p50)} ({_ms(r.added_probe_ttft_p50)})",
              f"{r.probe_errors}/{r.probe_requests}"]
             for r in mine],
        )  # fmt: skip
        for concurrency in dict.fromkeys(r.concurrency for r in mine):
            pd = next((r for r in mine if r.kind == "pdgate" and r.concurrency == concurrency),
                      None)
            vl = next((r for r in mine
                       if r.kind == "vllm-router" and r.concurrency == concurrency), None)
            if pd and vl:
                out += ["", f"{concurrency} streams, pdgate / vLLM Router: CPU per chunk "
                            f"{_x(ratio(pd.cpu_per_1k_chunks, vl.cpu_per_1k_chunks))}, added "
                            f"TTFT p50 {_x(ratio(pd.added_ttft_p50, vl.added_ttft_p50))} "
                            f"(seen by the probe client "
                            f"{_x(ratio(pd.added_probe_ttft_p50, vl.added_probe_ttft_p50))}), "
                            f"chunks/s {_x(ratio(pd.chunks_per_s, vl.chunks_per_s))}."]
        out.append("")
    return out


def _scheduling_section(rows: Sequence[SchedulingRow]) -> list[str]:
    if not rows:
        return []
    out = [
        "## Scheduling (engines with the latency model, small KV cache)",
        "",
        "TTFT at the first content chunk, client side. Prefix hit rate = "
        "`vllm:prefix_cache_hits` / `vllm:prefix_cache_queries` (tokens) summed over the pods "
        "that compute prompts (prefill pods in PD), read from the engines, so it means the "
        "same thing for every router. Fresh pods for every run.",
        "",
    ]
    for mode in dict.fromkeys(r.mode for r in rows):
        for workload in dict.fromkeys(r.workload for r in rows if r.mode == mode):
            mine = [r for r in rows if r.mode == mode and r.workload == workload]
            best = best_pdgate(mine, mode, workload)
            out += [f"### `{workload}`, {MODE_TITLE.get(mode, mode)}", ""]
            out += _table(
                ["router", "TTFT p50 ms", "TTFT p90 ms", "E2E p50 ms", "ITL p50 ms",
                 "prefix hit rate", "req/s", "CPU s/1k req", "errors",
                 *(["TTFT p50 vs best pdgate"] if best else [])],
                [[r.router + (" **(best pdgate)**" if best and r is best else ""),
                  _ms(r.ttft_p50), _ms(r.ttft_p90), _ms(r.e2e_p50), _ms(r.itl_p50),
                  _pct(r.hit_rate), _num(r.throughput, 1), _num(r.cpu_per_1k, 2),
                  f"{r.errors}/{r.requests}",
                  *([_x(ratio(r.ttft_p50, best.ttft_p50))] if best else [])]
                 for r in mine],
            )  # fmt: skip
            out.append("")
    return out


def _resources_section(over: Sequence[OverheadRow], sched: Sequence[SchedulingRow]) -> list[str]:
    routers = list(dict.fromkeys([r.router for r in over if r.kind != "direct"]
                                 + [r.router for r in sched]))
    if not routers:
        return []
    rows = []
    for router in routers:
        o = [r for r in over if r.router == router]
        s = [r for r in sched if r.router == router]
        cpu_s = [r.cpu_per_1k for r in s if r.cpu_per_1k is not None]
        rss = [r.peak_rss_mib for r in o if r.peak_rss_mib is not None]
        rss += [r.peak_rss_mib for r in s if r.peak_rss_mib is not None]
        rows.append([
            router,
            " / ".join(f"{r.mode}: {_num(r.cpu_per_1k, 2)}" for r in o) or "-",
            _num(sum(cpu_s) / len(cpu_s), 2) if cpu_s else "-",
            " / ".join(f"{r.mode}: {_num(r.idle_cpu_pct, 2)}" for r in o
                       if r.idle_cpu_pct is not None) or "-",
            _num(max(rss)) if rss else "-",
        ])  # fmt: skip
    return [
        "## Router resources",
        "",
        "CPU seconds per 1,000 requests (router process and children, psutil; in the "
        "scheduling runs, at a few requests per second, background work such as pdgate's "
        "engine-metrics scraping weighs in), CPU with no traffic, and peak resident memory "
        "over the router's life (sampled every 200 ms, or the kernel's high-water mark if "
        "larger).",
        "",
        *_table(["router", "CPU s/1k, overhead", "CPU s/1k, scheduling (mean)",
                 "idle CPU % of a core", "peak RSS MiB"], rows),
        "",
    ]
