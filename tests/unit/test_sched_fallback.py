"""The precise scorer's per-ModelServer fallback, and one tokenization per request."""

from __future__ import annotations

import asyncio
import random

from prometheus_client import CollectorRegistry

from router.load import InFlight
from router.resources import ModelServer
from router.scheduling import ScheduleRequest
from router.scheduling.config import parse_scheduler_config
from router.scheduling.runtime import SchedulerRuntime
from router.tokenization.parity import first_difference
from router.view import ClusterView, Endpoint, ServerPods, Snapshot
from tests.sim_tokens import sim_server, sim_tokenizer

CHAT = "/v1/chat/completions"
PRECISE = parse_scheduler_config({"profiles": {"aggregated": {"scorers": [
    {"type": "precise-prefix-cache", "weight": 1.0}]}}, "preciseIndex": {"enabled": False}})


def _pods(server: ModelServer) -> ServerPods:
    return ServerPods(server, aggregated=tuple(
        Endpoint("default", f"{server.meta.name}-{i}", f"10.0.0.{i}", 8000, "both")
        for i in range(2)))  # fmt: skip


def _runtime(*servers: ServerPods) -> tuple[SchedulerRuntime, CollectorRegistry]:
    registry = CollectorRegistry()
    rt = SchedulerRuntime(PRECISE, InFlight(registry), ClusterView(), registry,
                          rng=random.Random(0))
    rt.tokenizers._loader = lambda _spec: sim_tokenizer()  # loaded once per test process
    rt._on_snapshot(Snapshot(servers={s.server.meta.key: s for s in servers}))
    return rt, registry


def _request(n: int) -> ScheduleRequest:
    body = {"messages": [{"role": "system", "content": "Shared system prompt. " * 30},
                         {"role": "user", "content": f"question {n}"}]}
    return ScheduleRequest("m", CHAT, body, {})


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_fallback_is_per_server_and_uses_the_approximate_index() -> None:
    good, bare = _pods(sim_server(name="good")), _pods(sim_server(None, None, name="bare"))
    rt, registry = _runtime(good, bare)
    assert rt.fallback.reason(good.server) is None
    assert rt.fallback.reason(bare.server) == "no-tokenizer"
    rt.parity._mismatched.add(good.server.meta.key)  # as a failed probe leaves it
    assert rt.fallback.reason(good.server) == "parity-mismatch"
    rt.parity._mismatched.clear()
    for n in range(3):
        rt.scheduler.pick(good, _request(n), frozenset())
        rt.scheduler.pick(bare, _request(n), frozenset())
    value = registry.get_sample_value
    assert value("pdgate_precise_fallback", {"namespace": "default", "server": "bare",
                                             "reason": "no-tokenizer"}) == 1.0
    assert value("pdgate_precise_fallback", {"namespace": "default", "server": "good",
                                             "reason": "no-tokenizer"}) == 0.0
    # bare: approximate queries (and hits from the shared system prompt); good: precise.
    assert (value("pdgate_prefix_cache_hits_total", {"index": "approximate"}) or 0) > 0
    assert (value("pdgate_prefix_cache_queries_total", {"index": "precise"}) or 0) > 0
    assert sum(rt.approx.blocks_of(p.key) for p in bare.aggregated) > 0
    assert sum(rt.approx.blocks_of(p.key) for p in good.aggregated) == 0


def test_tokens_computed_once_are_reused_by_the_scheduler() -> None:
    good = _pods(sim_server(name="good"))
    rt, _ = _runtime(good)
    tokenizer = rt.tokenizers.get(good.server)
    assert tokenizer is not None
    request = _request(99)
    prompts = asyncio.run(rt.scheduler.prompt_ids(good, CHAT, request.body))
    assert prompts is not None and len(prompts) == 1
    request.tokens = prompts[0]  # what the proxy hands over after the rate limiter
    before = tokenizer.memo_stats
    rt.scheduler.pick(good, request, frozenset())
    assert tokenizer.memo_stats == before  # not tokenized again
    fresh = _request(100)
    rt.scheduler.pick(good, fresh, frozenset())
    assert tokenizer.memo_stats != before
    tokenized = tokenizer.memo_stats
    rt.scheduler.pick(good, fresh, frozenset())  # a retry of the same request
    assert tokenizer.memo_stats == tokenized  # not tokenized again
