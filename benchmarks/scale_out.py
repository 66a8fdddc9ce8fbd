"""One router process vs `--workers 2` vs two peer replicas, same pods, same requests.

    .venv/bin/python -m benchmarks.scale_out [--groups 3] [--prompts 8] [--questions 6]

The simulated PD cluster of `benchmarks.sched_policies` (prefill pods with a small KV
cache, so where a prompt goes decides whether it hits), and the router as real
`pdgate serve` processes in three setups, one after the other, each with its own
`cache_salt`: one process; `--workers 2` (SO_REUSEPORT, one client connection per request
so the kernel spreads them); two replicas peered over `--sync-port`, the client
alternating between them. Reported per setup: prefix hit rate at the prefill engines,
TTFT p50/p90, errors, and the router processes' CPU seconds per request (psutil, the
whole process tree) on the shared-prefix workload.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
import psutil

from benchmarks.sched_policies import (
    DECODE_FLAGS,
    MODEL,
    PolicyCluster,
    Prompt,
    RequestResult,
    RunResult,
    SharedPrefix,
    best_hit_tokens,
    prefill_flags,
    shared_prefix,
    stream_chat,
)
from engine_sim.ports import common_free_port as free_port
from engine_sim.ports import wait_http


class _PodsOnly(PolicyCluster):
    """The pods and their config, no in-process router."""

    async def _start_router(self) -> None:
        return None


def _cpu(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        with contextlib.suppress(psutil.Error):
            for p in [process, *process.children(recursive=True)]:
                times = p.cpu_times()
                total += times.user + times.system
    return total


async def _routers(
    cluster: PolicyCluster, setup: str, workdir: Path
) -> tuple[list[str], list[psutil.Popen]]:
    base = [sys.executable, "-m", "router", "serve", "--config", str(cluster.config_dir),
            "--scheduler-config", str(cluster.scheduler_file), "--host", "127.0.0.1",
            "--log-level", "warning"]  # fmt: skip
    ports = [free_port(), free_port()]
    if setup == "one process":
        argvs = [[*base, "--port", str(ports[0])]]
    elif setup == "--workers 2":
        argvs = [[*base, "--port", str(ports[0]), "--workers", "2"]]
    else:
        syncs = [free_port(), free_port()]
        argvs = [[*base, "--port", str(ports[i]), "--sync-port", str(syncs[i]),
                  "--peers", f"127.0.0.1:{syncs[1 - i]}"] for i in range(2)]
    procs = []
    for i, argv in enumerate(argvs):
        log = (workdir / f"router-{setup.replace(' ', '_')}-{i}.log").open("wb")
        procs.append(psutil.Popen(argv, stdout=log, stderr=log))
    urls = [f"http://127.0.0.1:{ports[i]}" for i in range(len(argvs))]
    for url in urls:
        await asyncio.to_thread(wait_http, f"{url}/readyz")
    await asyncio.sleep(2.0)  # every worker ready, peers heard
    return urls, procs


async def run_setup(cluster: PolicyCluster, setup: str, prompts: list[Prompt],
                    concurrency: int, workdir: Path) -> tuple[RunResult, float]:
    urls, procs = await _routers(cluster, setup, workdir)
    try:
        hits0, queries0, store0 = await cluster.prefix_counters()
        cpu0 = _cpu(procs)
        started = time.perf_counter()
        results: list[RequestResult | None] = [None] * len(prompts)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(len(prompts)):
            queue.put_nowait(i)
        # A fresh connection per request: SO_REUSEPORT spreads connections, not requests.
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=60),
        ) as http:

            async def worker() -> None:
                while not queue.empty():
                    i = queue.get_nowait()
                    body = prompts[i].body(MODEL, 4, f"scale-{setup}")
                    results[i] = await stream_chat(http, urls[i % len(urls)], body)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - started
        cpu = _cpu(procs) - cpu0
        hits1, queries1, store1 = await cluster.prefix_counters()
        best_hits, best_total = best_hit_tokens(prompts)
        done = [r for r in results if r is not None]
        run = RunResult(setup, done, hits1 - hits0, queries1 - queries0, best_hits, best_total,
                        seconds, Counter(r.prefill for r in done if r.prefill), store1 - store0)
        return run, cpu / max(1, len(done))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            with contextlib.suppress(psutil.TimeoutExpired):
                p.wait(20)


async def bench(args: argparse.Namespace) -> None:
    prompts = shared_prefix(SharedPrefix(groups=args.prompts, questions=args.questions,
                                         seed=args.seed))
    workdir = Path(tempfile.mkdtemp(prefix="pdgate-bench-scale-"))
    print(f"shared-prefix: {len(prompts)} requests, concurrency {args.concurrency}; "
          f"load average {psutil.getloadavg()[0]:.1f} on {psutil.cpu_count()} CPUs", flush=True)
    rows = []
    async with _PodsOnly(workdir, groups=args.groups, prefill_flags=prefill_flags(),
                         decode_flags=DECODE_FLAGS) as cluster:
        for setup in ("one process", "--workers 2", "2 replicas, alternating"):
            run, cpu = await run_setup(cluster, setup, prompts, args.concurrency, workdir)
            rows.append((run, cpu))
            print(f"  {setup}: hit {run.hit_rate:.1%}, TTFT p90 "
                  f"{1e3 * run.ttft_quantile(0.9):.0f} ms, {run.errors} errors", flush=True)
    print("\n| setup | prefix hit rate | best possible | TTFT p50 (ms) | TTFT p90 (ms) "
          "| router CPU ms / request | errors |\n| --- | --- | --- | --- | --- | --- | --- |")
    for run, cpu in rows:
        print(f"| {run.policy} | {run.hit_rate:.1%} | {run.best_hit_rate:.1%} "
              f"| {1e3 * run.ttft_quantile(0.5):.0f} | {1e3 * run.ttft_quantile(0.9):.0f} "
              f"| {1e3 * cpu:.2f} | {run.errors} |")


def main() -> None:
    parser = argparse.ArgumentParser(prog="benchmarks.scale_out", description=__doc__)
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--questions", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    asyncio.run(bench(parser.parse_args()))


if __name__ == "__main__":
    main()
