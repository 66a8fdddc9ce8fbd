"""Data-parallel pods: the router scoring each rank against the router seeing only the pod.

    .venv/bin/python -m benchmarks.data_parallel [--groups 2] [--ranks 2] [--rounds 2]

The simulated PD cluster of `benchmarks.sched_policies` (prefill engines with a small KV
cache, so where a prompt goes decides whether it hits), each pod running `--ranks` engine
cores (vLLM's `--data-parallel-size`: one API server, a prefix cache a rank, the rank
picked by vLLM's balancer from the ranks' queues unless `X-data-parallel-rank` names one),
and the router in process. Every policy runs the same shared-prefix workload in two
setups, the router switched between them by rewriting the ModelServer:

- `rank-aware`: `pdgate.io/data-parallel-size` set; each rank a target of its own, scored
  on its own cache and load, its KV events read on port + rank, the pick pinned.
- `pod-level`: the router is not told; it scores the pod and vLLM's balancer picks the
  rank. Under the precise index it reads the events on the base port only (rank 0's), as
  from any data-parallel pod it does not know about.

Setups alternate by round (the order rotated), each run with its own cache salt, so no run
finds KV an earlier one left. Reported per setup and policy, pooled over rounds: the
prefix hit rate at the prefill engines (all ranks) against the best possible, TTFT p50 and
p90 of the client's streams, and errors.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.sched_policies import (
    DECODE_FLAGS,
    PolicyCluster,
    RunResult,
    add_workload_args,
    prefill_flags,
    workload_prompts,
)

SETUPS = ("rank-aware", "pod-level")
POLICIES = ("prefix-cache", "precise-prefix-cache")


@dataclass(slots=True)
class Pooled:
    """The runs of one setup and policy, over rounds."""

    runs: list[RunResult] = field(default_factory=list)

    def hit_rate(self) -> float:
        queries = sum(run.query_tokens for run in self.runs)
        return sum(run.hit_tokens for run in self.runs) / queries if queries else 0.0

    def best_hit_rate(self) -> float:
        queries = sum(run.best_query_tokens for run in self.runs)
        return sum(run.best_hit_tokens for run in self.runs) / queries if queries else 0.0

    def ttft(self, q: float) -> float:
        values = sorted(t for run in self.runs for t in run.ttfts())
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    def errors(self) -> int:
        return sum(run.errors for run in self.runs)


async def bench(args: argparse.Namespace) -> dict[tuple[str, str], Pooled]:
    prompts = workload_prompts(args)
    pooled = {(setup, policy): Pooled() for setup in SETUPS for policy in POLICIES}
    workdir = Path(tempfile.mkdtemp(prefix="pdgate-bench-dp-"))
    async with PolicyCluster(workdir, groups=args.groups, data_parallel=args.ranks,
                             prefill_flags=prefill_flags(args.kv_capacity_blocks),
                             decode_flags=DECODE_FLAGS) as cluster:
        await cluster.run(prompts[: 2 * args.groups], salt="warm-up", concurrency=2)
        for round_ in range(args.rounds):
            order = SETUPS if round_ % 2 == 0 else SETUPS[::-1]
            for setup in order:
                await cluster.set_rank_aware(setup == "rank-aware")
                for policy in POLICIES:
                    await cluster.use(policy)
                    run = await cluster.run(prompts, salt=f"{round_}-{setup}-{policy}",
                                            concurrency=args.concurrency, policy=policy)
                    pooled[setup, policy].runs.append(run)
                    print(f"  round {round_ + 1} {setup} {policy}: {run.hit_rate:.1%} hits "
                          f"(best {run.best_hit_rate:.1%}), TTFT p90 "
                          f"{1e3 * run.ttft_quantile(0.9):.0f} ms", flush=True)
                    if cluster.inflight_total():
                        raise RuntimeError(f"{setup} {policy}: requests still in flight")
    return pooled


def table(pooled: dict[tuple[str, str], Pooled]) -> str:
    lines = ["| setup | policy | prefix hit rate | best possible | TTFT p50 (ms) "
             "| TTFT p90 (ms) | errors |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for (setup, policy), runs in pooled.items():
        lines.append(f"| {setup} | {policy} | {runs.hit_rate():.1%} | {runs.best_hit_rate():.1%}"
                     f" | {1e3 * runs.ttft(0.5):.0f} | {1e3 * runs.ttft(0.9):.0f}"
                     f" | {runs.errors()} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=2, help="PD groups (1 prefill + 1 decode)")
    parser.add_argument("--ranks", type=int, default=2, help="data-parallel ranks a pod")
    parser.add_argument("--rounds", type=int, default=2)
    add_workload_args(parser)  # --kv-capacity-blocks: each prefill rank's cache
    args = parser.parse_args()
    pooled = asyncio.run(bench(args))
    print(f"\nShared prefix: {args.prompts} system prompts (~{args.system_tokens} tokens) x "
          f"{args.questions} questions, shuffled; {args.groups} PD groups of pods with "
          f"{args.ranks} ranks each; concurrency {args.concurrency}; {args.rounds} rounds; "
          f"prefill ranks {' '.join(prefill_flags(args.kv_capacity_blocks))}\n")
    print(table(pooled))


if __name__ == "__main__":
    main()
