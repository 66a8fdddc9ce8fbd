"""Prompts in flight to a pod, and cache pressure, under the precise index.

The precise index learns a pod's blocks from its KV events, which come only once the
prefill stored them; until then the scheduler counts the prompt as on its way into the
chosen pod (`router.scheduling.inflight_prefixes`). `cache-pressure` reads the precise
index's blocks and the engine's reported capacity when `precise-prefix-cache` ran.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import pytest

from router.scheduling.config import parse_scheduler_config
from router.scheduling.inflight_prefixes import (
    EVENT_GRACE_S,
    MAX_RECORDED_BLOCKS,
    MAX_RECORDS,
    PER_POD,
    InFlightPrefixes,
)
from router.scheduling.scorers import CachePressureScorer, PrecisePrefixCacheScorer
from tests.unit.test_sched_pipeline import (
    busy,
    candidates,
    computes_on,
    context,
    pd_server,
    request,
    runtime,
)

PRECISE_THEN_LOAD = parse_scheduler_config({"profiles": {"prefill": {"scorers": [
    {"type": "precise-prefix-cache", "weight": 1.0, "storeHitFactor": 0.0},
    {"type": "least-request", "weight": 1.0},
]}}})  # fmt: skip


def test_a_prompt_in_flight_counts_for_its_shared_leading_blocks_until_it_lapses() -> None:
    table = InFlightPrefixes()
    table.record("default/a", [1, 2, 3, 4], ready_at=10.0, now=9.0)
    table.record("default/b", [1, 2, 9], ready_at=10.0, now=9.0)
    assert table.depths(["default/a", "default/b", "default/c"], [1, 2, 3, 7], 9.5) == [3, 2, 0]
    assert table.depths(["default/a"], [5, 2, 3], 9.5) is None  # another first block
    # The engine's events have had EVENT_GRACE_S past the predicted end: they tell.
    assert table.depths(["default/a"], [1, 2, 3], 10.0 + EVENT_GRACE_S) is None
    table.record("default/c", [8], ready_at=20.0, now=10.0 + EVENT_GRACE_S)
    assert len(table) == 1  # the lapsed records went as the new one came


def test_the_table_is_bounded_in_all_and_per_pod() -> None:
    table = InFlightPrefixes()
    for i in range(MAX_RECORDS + 10):
        table.record(f"default/p{i}", [7, i], ready_at=100.0, now=0.0)
    assert len(table) == MAX_RECORDS
    # The oldest went first: p0 is gone, the newest is there.
    newest = f"default/p{MAX_RECORDS + 9}"
    assert table.depths(["default/p0", newest], [7, MAX_RECORDS + 9], 1.0) == [0, 2]
    assert table.depths(["default/p0"], [7, 0], 1.0) is None
    # One pod keeps its newest PER_POD records of one opening block.
    one = InFlightPrefixes()
    for i in range(PER_POD + 2):
        one.record("default/a", [7, i, i], ready_at=100.0, now=0.0)
    assert one.depths(["default/a"], [7, 0, 0], 1.0) == [1]  # the first two were dropped
    assert one.depths(["default/a"], [7, PER_POD + 1, PER_POD + 1], 1.0) == [3]


def test_the_table_is_bounded_in_the_hashes_it_holds() -> None:
    table = InFlightPrefixes()
    long_prompt = 4096  # the approximate index's maxPromptBlocks
    for i in range(MAX_RECORDS):
        table.record(f"default/p{i % 8}", [i, *range(long_prompt - 1)], ready_at=100.0, now=0.0)
    assert table.blocks <= MAX_RECORDED_BLOCKS
    assert len(table) == MAX_RECORDED_BLOCKS // long_prompt  # the newest, whole
    newest = MAX_RECORDS - 1
    assert table.depths([f"default/p{newest % 8}"], [newest, 0, 1], 1.0) == [3]
    assert table.depths(["default/p0"], [0, 0, 1], 1.0) is None  # the oldest went first


def test_a_second_prompt_follows_the_first_before_the_engine_reports_its_blocks() -> None:
    """Two requests with one system prompt, the second sent while the first is still
    prefilling on pod p1 (no KV event yet): it goes to p1, whose queue (one mean prefill)
    is cheaper than computing the whole prompt on p2. The index itself still says nothing
    is cached, and the prefix metrics count no hit it cannot see."""
    rt = runtime(PRECISE_THEN_LOAD)
    server = pd_server({"g1": (["p1"], ["d1"]), "g2": (["p2"], ["d2"])})
    first = computes_on(rt, server, request("What is the capital of France?"))
    pod = next(p for g in server.groups for p in g.prefill if p.pod_name == first)
    busy(rt, pod, 1)
    follow = request("And the capital of Spain?")
    assert computes_on(rt, server, follow) == first
    ctx = context(rt, server, follow)
    cands = candidates(rt, [g.prefill[0] for g in server.groups])
    PrecisePrefixCacheScorer(1.0, rt.deps, {"storeHitFactor": 0.0}).score(ctx, cands)
    assert ctx.precise_local == [0, 0]
    assert ctx.precise_held is not None and max(ctx.precise_held) > 32
    assert ctx.precise_held[[c.pod_name for c in cands.pods].index(first)] == max(
        ctx.precise_held
    )
    # Once the record lapses (the prefill's predicted end + the grace), only events count.
    later = context(rt, server, follow)
    later.now = time.monotonic() + 60.0
    PrecisePrefixCacheScorer(1.0, rt.deps, {"storeHitFactor": 0.0}).score(later, cands)
    assert later.precise_held == [0, 0]


def test_a_record_made_for_another_process_is_not_told_to_the_others() -> None:
    """The leader's pick for a peer's new prompt records it here; the asker tells everyone
    when it sends the request, so the leader's record is not shared (`share`)."""
    table = InFlightPrefixes()
    told: list[tuple[str, list[int], float]] = []
    table.listener = lambda pod, hashes, ready_in_s: told.append((pod, hashes, ready_in_s))
    table.record("default/a", [1, 2], ready_at=10.5, now=10.0)
    table.record("default/b", [3], ready_at=10.5, now=10.0, share=False)
    assert told == [("default/a", [1, 2], 0.5)]
    assert table.depths(["default/a", "default/b"], [3], 10.2) == [0, 1]


async def test_the_leader_places_a_new_prompt_under_the_precise_index_too() -> None:
    """With other router processes (`router.sync`), a prompt no candidate or pool holds by
    the precise index, and that no prompt on its way into a cache shares, is the leader's
    to place, as under the approximate index; the next prompt of its group, while the
    first is prefilling, is placed here (it follows the first)."""
    rt = runtime(PRECISE_THEN_LOAD)
    server = pd_server({f"g{i}": ([f"p{i}"], [f"d{i}"]) for i in range(3)})
    asked: list[str] = []

    async def place(key: str, model: str, path: str, flow: str,
                    body: Mapping[str, Any]) -> tuple[str, ...] | None:
        asked.append(key)
        return ("default/p2", "default/d2")

    rt.deps.place = place
    system = "Tenant 7 system prompt. " * 90
    new = request(system=system)
    await rt.scheduler.prepare(server, new)
    assert new.placed == ("default/p2", "default/d2") and asked == ["default/pd"]
    assert computes_on(rt, server, new) == "p2"
    follow = request("And the capital of Spain?", system=system)
    await rt.scheduler.prepare(server, follow)
    assert follow.placed is None and len(asked) == 1
    assert computes_on(rt, server, follow) == "p2"
    other = request(system="Tenant 8 system prompt. " * 90)
    await rt.scheduler.prepare(server, other)
    assert other.placed is not None and len(asked) == 2


def test_cache_pressure_reads_the_precise_index_and_the_engines_capacity() -> None:
    """Pod a holds the prompt and is full, b is full of another prompt, c has room: with
    the precise index only b would evict to take it (the whole prompt's worth), priced at
    the prefill curve's cost per token. Until an engine reports its capacity, neutral."""
    rt = runtime(PRECISE_THEN_LOAD)
    server = pd_server({"g": (["a", "b", "c"], ["d"])})
    a, b, c = server.groups[0].prefill
    req = request()
    hashes = context(rt, server, req).prompt.precise_hashes()
    total = len(hashes)
    cap = 3 * total
    filler = iter(range(10**6, 2 * 10**6))
    rt.precise.stored(a.key, "default/pd", [next(filler) for _ in range(cap - total)], "GPU")
    rt.precise.stored(a.key, "default/pd", hashes, "GPU")
    rt.precise.stored(b.key, "default/pd", [next(filler) for _ in range(cap)], "GPU")
    rt.precise.stored(c.key, "default/pd", [next(filler) for _ in range(cap - total)], "GPU")
    precise = PrecisePrefixCacheScorer(1.0, rt.deps, {"storeHitFactor": 0.0})
    pressure = CachePressureScorer(1.0, rt.deps, {})
    cands = candidates(rt, [a, b, c])

    def scores() -> tuple[list[float], float]:
        ctx = context(rt, server, req)
        precise.score(ctx, cands)
        assert ctx.precise_held is not None
        return pressure.score(ctx, cands), pressure.scale_s(ctx, cands)

    assert scores() == ([1.0, 1.0, 1.0], 0.0)  # no capacity reported yet
    for key in (a.key, b.key, c.key):
        rt.approx.set_capacity_tokens(key, cap * 16)  # num_gpu_blocks x block_size
    got, scale = scores()
    assert got == [1.0, 0.0, 1.0]
    tokens_evicted = total * 16
    assert scale == pytest.approx(tokens_evicted * context(rt, server, req).fit.coefficients.b)
