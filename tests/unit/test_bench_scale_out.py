"""`benchmarks.scale_out`: the open loop of its fixed-rate part (`send_at_rate`, against
two loopback SSE servers standing in for two router URLs), the count of prompts computed
on more than one prefill pod, the new-prompt placements read from the routers' metrics,
and its tables' ratios."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from benchmarks.scale_out import (
    Placement,
    Routers,
    Run,
    Splits,
    _PodsOnly,
    fast_table,
    fixed_table,
    placed_text,
    placement_counts,
    send,
    send_at_rate,
    split_prompts,
    tiny_prompts,
    workload_table,
)
from benchmarks.sched_policies import Prompt, RequestResult, policy_document
from router.scheduling.config import parse_scheduler_config
from router.sync.exposition import merge
from router.sync.metrics import SyncMetrics
from tests.local_http import serve

EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"pong"}}]}\n\ndata: [DONE]\n\n'


async def _start(counts: list[int], index: int) -> tuple[web.AppRunner, str]:
    async def chat(request: web.Request) -> web.StreamResponse:
        counts[index] += 1
        body = await request.json()
        # As pdgate names the pods it chose; here: router 0 computes group 1 on p0.
        pod = f"p{index}" if "Group 1" in body["messages"][0]["content"] else "p1"
        response = web.StreamResponse(headers={"content-type": "text/event-stream",
                                               "x-pdgate-prefill-pod": pod})
        await response.prepare(request)
        await response.write(EVENT)
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner, port = await serve(app)
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def two_urls() -> AsyncIterator[tuple[Routers, list[int]]]:
    counts = [0, 0]
    started = [await _start(counts, i) for i in range(2)]
    routers = Routers("2 routers, no sync", [url for _, url in started], [], 2)
    routers.pools = [aiohttp.ClientSession() for _ in started]
    yield routers, counts
    for pool in routers.pools:
        await pool.close()
    for runner, _ in started:
        await runner.cleanup()


async def test_requests_go_out_at_the_rate_alternating_between_urls(
    two_urls: tuple[Routers, list[int]],
) -> None:
    routers, counts = two_urls
    started = time.perf_counter()
    results, seconds, _ = await send_at_rate(routers, tiny_prompts(20), "s", 100.0, "m")
    # Paced: the 20th request leaves 0.19 s after the first.
    assert time.perf_counter() - started >= 0.185
    assert seconds >= 0.185
    assert [r.status for r in results] == [200] * 20
    assert all(r.completed and r.ttft is not None for r in results)
    assert counts == [10, 10]


def test_tables_give_each_setup_against_one_process() -> None:
    done = [RequestResult(0.002, 200, None, None, None, True)] * 100
    one = Run("one process", "fixed", done, cpu_s=0.05, seconds=1.0, idle_cpu_s=0.01)
    two = Run("--workers 2", "fixed", done, cpu_s=0.08, seconds=1.0, idle_cpu_s=0.02,
              wakeups=250)
    fixed = fixed_table({"--workers 2": two, "one process": one}).splitlines()
    assert fixed[2].startswith("| one process | 100 | 0.50 | 1.00x | 0.40 | 1.00x | 0.00 |")
    assert fixed[3].startswith("| --workers 2 | 100 | 0.80 | 1.60x | 0.60 | 1.50x | 2.50 |")
    fast = fast_table({"one process": one, "--workers 2": two}).splitlines()
    assert fast[3].startswith("| --workers 2 | 100 | 1.00x | 0.80 | 1.60x | 0.60 | 1.50x | 2.0% |")


def test_a_prompt_on_two_pods_is_split_and_apart_when_the_routers_disagreed_first() -> None:
    placements = [
        Placement(0, 0, "p1"), Placement(0, 1, "p1"), Placement(0, 0, "p1"),  # one pod
        Placement(1, 1, "p2"), Placement(1, 0, "p1"), Placement(1, 1, "p1"),  # apart
        Placement(2, 0, "p1"), Placement(2, 1, "p1"), Placement(2, 0, "p2"),  # moved later
        Placement(3, 0, "p1"), Placement(3, 1, None),  # a failed request is no placement
    ]
    assert split_prompts(placements, routers=2) == Splits(prompts=4, split=2, apart=1)
    assert split_prompts(placements, routers=1) == Splits(prompts=4, split=2, apart=None)
    assert Splits(8, 1, 1) + Splits(8, 2, 0) == Splits(16, 3, 1)
    assert Splits(8, 1, 1) + Splits(8, 2, None) == Splits(16, 3, None)


async def test_send_records_where_each_prompt_went(two_urls: tuple[Routers, list[int]]) -> None:
    routers, _ = two_urls
    prompts = [[Prompt(g, (("system", f"Group {g}."), ("user", f"q{n}")))]
               for n, g in enumerate([0, 1, 0, 1])]
    placements: list[Placement] = []
    results, _, _ = await send(routers, prompts, "s", 1, placements=placements)
    assert [r.status for r in results] == [200] * 4
    # One client: request n went to URL n mod 2; group 1 through router 1 reached p1,
    # through router 0 p0 (the servers above), so group 1 is split, apart from the start.
    assert placements == [Placement(0, 0, "p1"), Placement(1, 1, "p1"),
                          Placement(0, 0, "p1"), Placement(1, 1, "p1")]
    placements = []
    await send(routers, prompts[1:], "s", 1, placements=placements)
    assert placements[0] == Placement(1, 0, "p0")
    run = Run("2 replicas", "shared-prefix", results,
              splits=split_prompts([*placements, Placement(1, 1, "p1")], 2))
    table = workload_table({("2 replicas", "shared-prefix"): run}).splitlines()
    assert table[2].endswith("| 1 of 2 (1 apart) |")


def test_the_routers_scheduler_file_leaves_the_precise_index_to_the_policy(
    tmp_path: Path,
) -> None:
    """The routers' policy is fixed per run, so their precise index is pdgate's default:
    off for `prefix-cache`, whose scorers never read it (on, every router process applied
    every KV event for nothing, and two processes paid it twice); the in-process cluster
    of `sched_policies`, switched between policies, keeps it on."""
    pods = _PodsOnly(tmp_path)
    config = parse_scheduler_config(policy_document(pods.policy, precise=pods.precise))
    assert not config.precise_enabled
    precise = parse_scheduler_config(policy_document("precise-prefix-cache", precise=pods.precise))
    assert precise.precise_enabled
    assert parse_scheduler_config(policy_document("prefix-cache")).precise_enabled


def test_placements_are_read_from_every_workers_metrics() -> None:
    """The counts come from the router's own exposition (`SyncMetrics`), summed over the
    workers of a merged `--workers N` scrape; the line shows what the askers saw."""
    expositions = {}
    for worker, outcomes in enumerate((("served", "served", "served"),
                                       ("answered", "answered", "timeout"))):
        registry = CollectorRegistry()
        metrics = SyncMetrics(registry)
        for outcome in outcomes:
            metrics.placement[outcome].inc()
        expositions[worker] = generate_latest(registry).decode()
    counts = placement_counts(merge(expositions, missing=0).decode())
    assert counts == {"served": 3, "answered": 2, "timeout": 1, "none": 0}
    assert placed_text(counts) == "[placed 2 answered, 1 timeout] "
    assert placed_text(placement_counts(generate_latest(CollectorRegistry()).decode())) == ""
