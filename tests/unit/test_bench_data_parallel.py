"""`benchmarks.data_parallel`: its runs pooled over rounds (tokens summed, TTFTs merged)
and the table it prints."""

from __future__ import annotations

from benchmarks.data_parallel import Pooled, table
from benchmarks.sched_policies import RequestResult, RunResult


def _run(hits: int, queries: int, ttfts: list[float | None]) -> RunResult:
    results = [RequestResult(ttft, 200 if ttft is not None else 502, "p", "d")
               for ttft in ttfts]
    return RunResult("prefix-cache", results, hits, queries, 90, 100, 1.0)


def test_rounds_pool_by_tokens_not_by_run() -> None:
    pooled = Pooled([_run(10, 100, [0.1, 0.2]), _run(290, 300, [0.3, None])])
    assert pooled.hit_rate() == 300 / 400  # not the mean of 10% and 97%
    assert pooled.best_hit_rate() == 0.9
    assert pooled.ttft(0.5) == 0.2 and pooled.ttft(0.9) == 0.3
    assert pooled.errors() == 1


def test_the_table_has_a_row_a_setup_and_policy() -> None:
    text = table({("rank-aware", "prefix-cache"): Pooled([_run(90, 100, [0.05])]),
                  ("pod-level", "prefix-cache"): Pooled([_run(45, 100, [0.25])])})
    rows = text.splitlines()[2:]
    assert rows == ["| rank-aware | prefix-cache | 90.0% | 90.0% | 50 | 50 | 0 |",
                    "| pod-level | prefix-cache | 45.0% | 90.0% | 250 | 250 | 0 |"]
