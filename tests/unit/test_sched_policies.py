"""Baseline policies and the mean prefill estimate: round-robin turns, estimator hygiene."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from prometheus_client import CollectorRegistry

from router.load import InFlight
from router.resources import ModelServer, ObjectMeta, PDGroup
from router.scheduling import ScheduleRequest
from router.scheduling.config import SchedulerConfig, parse_scheduler_config
from router.scheduling.context import CostModel, LoadEstimator
from router.scheduling.runtime import SchedulerRuntime
from router.view import ClusterView, Endpoint, PDGroupPods, ServerPods

CHAT = "/v1/chat/completions"
SYSTEM = "You are a careful assistant. " * 60


def _server(pd: bool) -> ModelServer:
    return ModelServer(
        meta=ObjectMeta(name="srv"), model="m", inference_engine="vLLM",
        match_labels={"app": "srv"},
        pd_group=PDGroup("group", {"role": "prefill"}, {"role": "decode"}) if pd else None,
        port=8000,
    )


def _pod(name: str, role: str = "both", group: str | None = None) -> Endpoint:
    return Endpoint("default", name, "10.0.0.1", 8000, role, group)  # type: ignore[arg-type]


def _request(i: int, system: str = SYSTEM) -> ScheduleRequest:
    body: dict[str, Any] = {"model": "m", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}]}
    return ScheduleRequest("m", CHAT, body, {})


def _runtime(config: SchedulerConfig) -> SchedulerRuntime:
    registry = CollectorRegistry()
    return SchedulerRuntime(config, InFlight(registry), ClusterView(), registry,
                            rng=random.Random(3))


def _round_robin(roles: tuple[str, ...]) -> SchedulerConfig:
    return parse_scheduler_config({"profiles": {
        role: {"scorers": [{"type": "round-robin"}]} for role in roles
    }})


def test_round_robin_takes_turns_in_pod_order() -> None:
    rt = _runtime(_round_robin(("aggregated",)))
    server = ServerPods(server=_server(False), aggregated=tuple(_pod(n) for n in "abc"))
    picks = [rt.scheduler.pick(server, _request(i), frozenset()) for i in range(7)]
    assert [p.decode.pod_name for p in picks if p] == list("abcabca")


def test_round_robin_pd_pairs_go_round_the_groups() -> None:
    rt = _runtime(_round_robin(("prefill", "decode")))
    groups = tuple(
        PDGroupPods(group=g, prefill=(_pod(f"{g}-p", "prefill", g),),
                    decode=(_pod(f"{g}-d", "decode", g),))
        for g in ("g0", "g1", "g2")
    )
    server = ServerPods(server=_server(True), groups=groups)
    pairs = []
    for i in range(6):
        pick = rt.scheduler.pick(server, _request(i), frozenset())
        assert pick is not None and pick.prefill is not None
        pairs.append((pick.prefill.pod_name, pick.decode.pod_name))
    assert pairs == [(f"{g}-p", f"{g}-d") for g in ("g0", "g1", "g2") * 2]


def test_round_robin_skips_a_pod_in_avoid_and_keeps_going() -> None:
    rt = _runtime(_round_robin(("aggregated",)))
    server = ServerPods(server=_server(False), aggregated=tuple(_pod(n) for n in "abc"))
    chosen: Counter[str] = Counter()
    for i in range(30):
        pick = rt.scheduler.pick(server, _request(i), frozenset({"default/b"}))
        assert pick is not None
        chosen[pick.decode.pod_name] += 1
    assert chosen == {"a": 15, "c": 15}


def test_mean_prefill_counts_the_fixed_overhead() -> None:
    cost = CostModel(prefill_s_per_token=1e-4, prefill_overhead_s=0.005,
                     min_request_prefill_s=0.002)
    estimator = LoadEstimator(initial_tokens=40)
    assert estimator.mean_prefill_s(cost) == 0.005 + 40 * 1e-4
    estimator.mean_uncached_tokens = 0
    assert estimator.mean_prefill_s(CostModel(prefill_overhead_s=0.0)) == 0.005  # the floor


def test_profiles_without_a_prefix_scorer_leave_the_estimate_alone() -> None:
    """A random baseline must not teach a later prefix-aware profile that every prompt is
    uncached (it would then spread away from its cache hits)."""
    rt = _runtime(parse_scheduler_config({"profiles": {
        "aggregated": {"scorers": [{"type": "random"}]}}}))
    server = ServerPods(server=_server(False), aggregated=(_pod("a"), _pod("b")))
    before = rt.deps.estimator.mean_uncached_tokens
    for i in range(20):
        rt.scheduler.pick(server, _request(i), frozenset())
    assert rt.deps.estimator.mean_uncached_tokens == before
    rt.apply_config(SchedulerConfig())  # prefix-cache: every request teaches it now
    for i in range(20):
        rt.scheduler.pick(server, _request(i), frozenset())
    assert rt.deps.estimator.mean_uncached_tokens < before  # hits after the first
