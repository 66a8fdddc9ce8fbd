"""Scorer formulas, filters, and the pipeline: ties, anti-herding, PD pair scoring."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from router.kvhash.vllm import VllmBlockHasher, VllmHashConfig
from router.load import InFlight
from router.resources import ModelServer, ObjectMeta, PDGroup, Pod
from router.scheduling import Pick, ScheduleRequest
from router.scheduling.config import SchedulerConfig, parse_scheduler_config
from router.scheduling.context import Candidates, CostModel, PickContext, PromptInfo
from router.scheduling.filters import NotEjectedFilter, NotSaturatedFilter, ReadyFilter
from router.scheduling.metrics_scraper import EngineLoad
from router.scheduling.runtime import SchedulerRuntime
from router.scheduling.scorers import (
    CachePressureScorer,
    KVCacheUsageScorer,
    LeastRequestScorer,
    PrecisePrefixCacheScorer,
    PrefixCacheScorer,
    QueueScorer,
    RandomScorer,
    SessionAffinityScorer,
)
from router.scheduling.ties import draw_below
from router.view import ClusterView, Endpoint, PDGroupPods, ServerPods
from tests.sim_tokens import sim_tokenizer

CHAT = "/v1/chat/completions"
SYSTEM = "You are a meticulous assistant who answers in full sentences. " * 80  # ~5 KB


def model_server(name: str = "srv", pd: bool = False) -> ModelServer:
    return ModelServer(
        meta=ObjectMeta(name=name),
        model="m",
        inference_engine="vLLM",
        match_labels={"app": name},
        pd_group=PDGroup("group", {"role": "prefill"}, {"role": "decode"}) if pd else None,
        port=8000,
    )


def pod(name: str, role: str = "both", group: str | None = None) -> Endpoint:
    return Endpoint("default", name, "10.0.0.1", 8000, role, group)  # type: ignore[arg-type]


def aggregated(*names: str) -> ServerPods:
    return ServerPods(server=model_server(), aggregated=tuple(pod(n) for n in names))


def pd_server(groups: dict[str, tuple[list[str], list[str]]]) -> ServerPods:
    return ServerPods(
        server=model_server("pd", pd=True),
        groups=tuple(
            PDGroupPods(
                group=g,
                prefill=tuple(pod(n, "prefill", g) for n in pre),
                decode=tuple(pod(n, "decode", g) for n in dec),
            )
            for g, (pre, dec) in groups.items()
        ),
    )


def request(question: str = "What is the capital of France?", system: str = SYSTEM,
            headers: dict[str, str] | None = None) -> ScheduleRequest:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "system", "content": system},
                     {"role": "user", "content": question}],
    }
    return ScheduleRequest("m", CHAT, body, headers or {})


def sim_tokens(path: str, body: Mapping[str, Any]) -> list[int]:
    """The simulator's real tokenizer, injected (what `pdgate.io/tokenizer` would load)."""
    endpoint = "chat" if path == CHAT else "completion"
    return list(sim_tokenizer().request_ids(endpoint, body)[0])


def runtime(config: SchedulerConfig | None = None, seed: int = 0) -> SchedulerRuntime:
    registry = CollectorRegistry()
    return SchedulerRuntime(config or SchedulerConfig(), InFlight(registry), ClusterView(),
                            registry, rng=random.Random(seed), tokenize=sim_tokens)


def context(rt: SchedulerRuntime, server: ServerPods, req: ScheduleRequest) -> PickContext:
    a = rt.config.approximate_index
    prompt = PromptInfo(req, rt.deps.hasher, a.block_bytes, a.max_prompt_blocks,
                        a.chars_per_token)
    return PickContext(req, server, prompt, rt.deps, rt.config.cost_model, time.monotonic(),
                       rt.metrics.decisions)


def candidates(rt: SchedulerRuntime, pods: list[Endpoint]) -> Candidates:
    return Candidates.read(pods, [p.key for p in pods], rt.deps, time.monotonic())


#: One request's predicted prefill in `busy` (a short prompt at the seed cost).
QUEUED_PREFILL_S = 0.05


def busy(rt: SchedulerRuntime, endpoint: Endpoint, count: int) -> None:
    """`count` requests in flight on `endpoint`, as the router's own dispatches leave
    them: counted, and on a prefill pod their prefills queued in the router's backlog."""
    for _ in range(count):
        rt.deps.inflight.acquire(endpoint)
        if endpoint.role == "prefill":
            rt.deps.backlog.dispatch(endpoint.key, QUEUED_PREFILL_S, rt.clock(), idle=False)


def bound(rt: SchedulerRuntime, key: str, blocks: int) -> None:
    """Size a pod's approximate index to `blocks` (as its engine's KV capacity would)."""
    index = rt.approx
    index.set_capacity_tokens(key, math.ceil(blocks * index.block_bytes / index.chars_per_token))
    assert index.capacity_of(key) == blocks


def engine(rt: SchedulerRuntime, endpoint: Endpoint, **fields: Any) -> None:
    rt.engines.put(endpoint.key, EngineLoad(at=time.monotonic() + 3600, **fields))


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def name_of(rt: SchedulerRuntime, server: ServerPods, req: ScheduleRequest) -> str:
    pick = rt.scheduler.pick(server, req, frozenset())
    assert pick is not None
    return pick.decode.pod_name


def computes_on(rt: SchedulerRuntime, server: ServerPods, req: ScheduleRequest) -> str:
    """The pod that computes the prompt: the prefill pod of a PD pick, else the pod."""
    pick = rt.scheduler.pick(server, req, frozenset())
    assert pick is not None
    return (pick.prefill or pick.decode).pod_name


# -- scorer formulas ---------------------------------------------------------------------------


def test_prefix_cache_score_is_the_matched_fraction() -> None:
    rt = runtime()
    server = aggregated("a", "b")
    req = request()
    ctx = context(rt, server, req)
    hashes = ctx.prompt.approx_hashes()
    total = len(hashes)
    assert total >= 10
    rt.approx.record("default/a", hashes[:5])
    scorer = PrefixCacheScorer(1.0, rt.deps, {})
    cands = candidates(rt, list(server.aggregated))
    # A block covers block_bytes of the rendered prompt: its share of the prompt's tokens.
    rendered = ctx.prompt.rendered()
    assert rendered is not None
    block = rt.config.approximate_index.block_bytes / len(rendered)
    assert scorer.score(ctx, cands) == pytest.approx([5 * block, 0.0])
    tokens = ctx.prompt.token_count()
    assert scorer.scale_s(ctx, cands) == pytest.approx(tokens * CostModel().prefill_s_per_token)
    scorer.picked(ctx, cands, 1)  # dispatch records the whole prompt for the chosen pod
    assert scorer.score(ctx, cands) == pytest.approx([5 * block, total * block])
    # Even a full match leaves the tail after the last full block (the question) to
    # compute: a hit is never free, so the mean prefill and the fit see what pods compute.
    assert ctx.compute_tokens is not None
    assert ctx.compute_tokens[1] == pytest.approx(tokens * (1 - total * block))
    assert ctx.compute_tokens[1] > 0


def test_cache_pressure_charges_a_move_what_it_evicts() -> None:
    rt = runtime()
    server = aggregated("a", "b", "c")
    ctx = context(rt, server, request())
    hashes = ctx.prompt.approx_hashes()
    total = len(hashes)
    for key in ("default/a", "default/b", "default/c"):
        rt.approx.set_capacity_tokens(key, 1)  # the smallest bound: MIN_BLOCKS_PER_POD
    cap = rt.approx.capacity_of("default/a")
    filler = iter(range(10**6, 2 * 10**6))
    rt.approx.record("default/a", [next(filler) for _ in range(cap - total)] + hashes)
    rt.approx.record("default/b", [next(filler) for _ in range(cap)])  # full, of others
    rt.approx.record("default/c", [next(filler) for _ in range(cap - total)])  # has room
    assert rt.approx.blocks_of("default/a") == rt.approx.blocks_of("default/b") == cap
    scorer = CachePressureScorer(1.0, rt.deps, {})
    cands = candidates(rt, list(server.aggregated))
    # a holds the prompt, c has room for it: neither evicts; b evicts the whole prompt.
    assert scorer.score(ctx, cands) == [1.0, 0.0, 1.0]
    rendered = ctx.prompt.rendered()
    assert rendered is not None
    per_block = ctx.prompt.token_count() * ctx.prompt.approx_block_bytes / len(rendered)
    expected = total * per_block * CostModel().prefill_s_per_token
    assert scorer.scale_s(ctx, cands) == pytest.approx(expected)
    # A prompt nobody holds, on pods that are all full: every pod evicts as much.
    rt.approx.record("default/c", [next(filler) for _ in range(total)])
    cold = context(rt, server, request(system="Another long system prompt. " * 200))
    assert scorer.score(cold, cands) == [1.0, 1.0, 1.0]
    assert scorer.scale_s(cold, cands) == 0.0


def test_a_warm_prompt_stays_on_its_busy_full_pod_rather_than_evict_another_prompt() -> None:
    """Without `cache-pressure` a few requests in flight on the warm pod send the prompt to
    an idle pod, whose full cache then evicts another prompt; the default stays."""
    without = parse_scheduler_config({"profiles": {"aggregated": {"scorers": [
        {"type": "prefix-cache"}, {"type": "least-request"},
        {"type": "queue", "weight": 0.5}, {"type": "kv-cache-usage"}]}}})
    for config, expected in ((SchedulerConfig(), "a"), (without, "b")):
        rt = runtime(config)
        server = aggregated("a", "b")
        a, b = server.aggregated
        req = request()
        hashes = context(rt, server, req).prompt.approx_hashes()
        filler = iter(range(10**6, 2 * 10**6))
        for key in (a.key, b.key):
            rt.approx.set_capacity_tokens(key, 1)  # the smallest bound: MIN_BLOCKS_PER_POD
        cap = rt.approx.capacity_of(a.key)
        rt.approx.record(a.key, [next(filler) for _ in range(cap - len(hashes))] + hashes)
        rt.approx.record(b.key, [next(filler) for _ in range(cap)])  # another prompt's
        busy(rt, a, 6)
        assert name_of(rt, server, request(question="And of Spain?")) == expected


def test_cache_pressure_charges_a_new_prompt_the_room_it_uses_up() -> None:
    """G_p: on a pod holding more than the emptiest candidate, a new prompt's blocks use
    up room (at most its own blocks), weighted by how full the pod would be."""
    rt = runtime()
    server = aggregated("a", "b", "c")
    ctx = context(rt, server, request(system="A new system prompt. " * 200))
    total = len(ctx.prompt.approx_hashes())
    for key in ("default/a", "default/b", "default/c"):
        rt.approx.set_capacity_tokens(key, 1)  # the smallest bound: MIN_BLOCKS_PER_POD
    cap = rt.approx.capacity_of("default/a")
    assert cap >= 4 * total
    filler = iter(range(10**6, 2 * 10**6))
    rt.approx.record("default/a", [next(filler) for _ in range(2 * total)])
    rt.approx.record("default/b", [next(filler) for _ in range(total // 2)])
    scorer = CachePressureScorer(1.0, rt.deps, {})
    cands = candidates(rt, list(server.aggregated))
    # Nobody is at its bound, so nothing is evicted now. a: min(B, 2B - 0) x 3B / cap;
    # b: min(B, B/2) x (B + B/2) / cap; c: the emptiest, 0.
    room_a = total * 3 * total / cap
    room_b = (total // 2) * (total + total // 2) / cap
    assert scorer.score(ctx, cands) == pytest.approx([0.0, 1 - room_b / room_a, 1.0])
    per_token = ctx.fit.coefficients.b
    expected = room_a * ctx.prompt.tokens_per_approx_block() * per_token
    assert scorer.scale_s(ctx, cands) == pytest.approx(expected)


def test_a_new_prompt_starts_on_the_emptier_cache_once_caches_fill() -> None:
    """Two pods with room for six prompts each, holding five and four: a new prompt goes
    to the one holding four even with a request in flight there. Nothing is evicted either
    way yet (O = 0), but on the other it would fill the cache, and the next new prompt
    there evicts a warm one (the `shared-prefix` bench's 6 / 4 splits). While the caches
    are nearly empty, room is given away freely and load decides."""
    without = parse_scheduler_config({"profiles": {"aggregated": {"scorers": [
        {"type": "prefix-cache"}, {"type": "least-request"},
        {"type": "queue", "weight": 0.5}, {"type": "kv-cache-usage"}]}}})
    prompt = request(system="Group 10. " + "A new system prompt. " * 200)
    for config, nearly_full, expected in ((SchedulerConfig(), True, "b"),
                                          (without, True, "a"),
                                          (SchedulerConfig(), False, "a")):
        rt = runtime(config)
        server = aggregated("a", "b")
        a, b = server.aggregated
        total = len(context(rt, server, prompt).prompt.approx_hashes())
        filler = iter(range(10**6, 2 * 10**6))
        if nearly_full:  # room for six prompts of this size
            for key in (a.key, b.key):
                bound(rt, key, 6 * total)
        rt.approx.record(a.key, [next(filler) for _ in range(5 * total)])
        rt.approx.record(b.key, [next(filler) for _ in range(4 * total)])
        busy(rt, b, 1)
        assert name_of(rt, server, prompt) == expected


def test_a_new_prompt_goes_to_the_same_pod_whatever_the_routers_random_draws() -> None:
    """Workers and replicas hear of each other's picks a few ms late: among idle pods they
    must still agree where a prompt nobody holds goes, or it ends up cached twice."""
    servers = {"aggregated": aggregated("a", "b", "c", "d"),
               "pd": pd_server({f"g{i}": ([f"p{i}"], [f"d{i}"]) for i in range(4)})}
    for kind, server in servers.items():
        chosen = {name_of(runtime(seed=seed), server, request()) for seed in range(8)}
        assert len(chosen) == 1, kind
        # Different new prompts still spread over the pods.
        spread = {name_of(runtime(seed=0), server, request(system=f"System {i}. " * 90))
                  for i in range(16)}
        assert len(spread) >= 3, kind
    # A prompt some pod holds is not subject to it: equal holders are drawn at random.
    server = servers["aggregated"]
    holders = set()
    for seed in range(8):
        rt = runtime(seed=seed)
        hashes = context(rt, server, request()).prompt.approx_hashes()
        for key in ("default/a", "default/b"):
            rt.approx.record(key, hashes)
        holders.add(name_of(rt, server, request()))
    assert holders == {"a", "b"}


def test_routers_that_see_one_pod_busier_still_agree_where_a_new_prompt_goes() -> None:
    """Two routers before they hear of each other's picks: one has just sent a request to
    pod a (busy in its view only). For a new prompt whose first choice among all pods is
    not a, both must pick the same pod (rendezvous ranking); only where a is the first
    choice may they differ."""
    for kind, server in (
        ("aggregated", aggregated("a", "b", "c", "d")),
        ("pd", pd_server({f"g{i}": ([f"p{i}"], [f"d{i}"]) for i in range(4)})),
    ):
        busy_pod = server.aggregated[0] if kind == "aggregated" else server.groups[0].prefill[0]
        agreed = compared = 0
        for i in range(24):
            prompt = request(system=f"Tenant {i} system prompt. " * 90)
            idle, loaded = runtime(seed=1), runtime(seed=2)
            busy(loaded, busy_pod, 1)
            here, there = computes_on(idle, server, prompt), computes_on(loaded, server, prompt)
            assert there != busy_pod.pod_name, kind  # the busy pod is not among its ties
            if here != busy_pod.pod_name:
                compared += 1
                agreed += here == there
        assert compared >= 12, kind
        assert agreed == compared, kind


async def test_a_new_prompt_is_sent_where_the_leader_placed_it() -> None:
    """With other router processes (`router.sync`), `prepare` asks the leader where a
    prompt no pod holds should go, and `pick` keeps to its answer; a prompt some pod holds
    is placed here without asking; a retry that avoids the placed pod, or a placed pod
    ejected in this process's view, goes elsewhere."""
    rt = runtime()
    server = pd_server({f"g{i}": ([f"p{i}"], [f"d{i}"]) for i in range(3)})
    asked: list[tuple[str, str, str]] = []

    async def place(key: str, model: str, path: str, flow: str,
                    body: Mapping[str, Any]) -> tuple[str, ...] | None:
        asked.append((key, model, flow))
        return ("default/p2", "default/d2")

    rt.deps.place = place
    for i in range(6):
        new = request(system=f"Tenant {i} system prompt. " * 90)
        await rt.scheduler.prepare(server, new)
        assert new.placed == ("default/p2", "default/d2")
        assert computes_on(rt, server, new) == "p2"
    assert asked == [("default/pd", "m", "pd")] * 6
    held = request(system="Tenant 0 system prompt. " * 90)  # recorded on p2 by now
    await rt.scheduler.prepare(server, held)
    assert held.placed is None and len(asked) == 6
    retry = request(system="Tenant 9 system prompt. " * 90)
    await rt.scheduler.prepare(server, retry)
    pick = rt.scheduler.pick(server, retry, frozenset({"default/p2"}))
    assert pick is not None and pick.prefill is not None and pick.prefill.pod_name != "p2"
    rt.set_ejection_hook(lambda key: key == "default/p2")  # ejected here: not kept to
    ejected = request(system="Tenant 10 system prompt. " * 90)
    await rt.scheduler.prepare(server, ejected)
    assert ejected.placed == ("default/p2", "default/d2")
    assert computes_on(rt, server, ejected) != "p2"


def test_a_failed_prefill_leaves_no_backlog() -> None:
    """A prefill that ends without a KV handle (an error, a cancelled request) leaves the
    pod's predicted backlog at once: kept until its predicted end, it would price a pod
    that is idle as busy (and keep a failing pod from being tried often enough to be
    ejected)."""
    rt = runtime()
    server = pd_server({"g0": (["p0"], ["d0"]), "g1": (["p1"], ["d1"])})
    pick = rt.scheduler.pick(server, request(system="Tenant 5 prompt. " * 90), frozenset())
    assert pick is not None and pick.prefill is not None
    assert pick.on_prefill_failed is not None
    backlog, key = rt.deps.backlog, pick.prefill.key
    assert backlog.wait_s(key, rt.clock()) > 0
    pick.on_prefill_failed()
    assert backlog.wait_s(key, rt.clock()) == 0


def test_a_pick_made_for_a_peer_is_recorded_but_not_counted() -> None:
    """The leader's pick for another process's request (`asker` set) records the
    prompt in the index like any pick, so the next request for it goes to the same pod,
    but neither shares that record nor counts the pick: the asker's own pick does both
    (a sum over processes counts the request once, and the asker does not see its own new
    prompt as cached before it sends it), nor observes it in the mean prefill. Its prefill
    is queued as the asker's part of the pod's backlog, not this process's own (which is
    what this process reports)."""
    rt = runtime()
    server = pd_server({f"g{i}": ([f"p{i}"], [f"d{i}"]) for i in range(3)})
    registry = rt.metrics.registry
    names = ("pdgate_scheduler_decision_seconds_count", "pdgate_prefix_cache_queries_total",
             "pdgate_scheduler_predicted_ttft_seconds_count")
    labels = ({"kind": "pd"}, {"index": "approximate"}, {"kind": "pd"})

    def counted() -> list[float]:
        return [sample(registry, name, **label) for name, label in zip(names, labels,
                                                                       strict=True)]

    shared: list[str] = []
    rt.approx.listener = lambda key, hashes: shared.append(key)
    for_peer = request(system="Tenant 1 system prompt. " * 90)
    for_peer.asker = "peer"
    mean = rt.deps.estimator.mean_uncached_tokens
    placed = computes_on(rt, server, for_peer)
    assert counted() == [0.0, 0.0, 0.0]
    # Nor does it move this process's mean prefill (the asker's pick observes the request).
    assert rt.deps.estimator.mean_uncached_tokens == mean
    backlog = rt.deps.backlog
    assert backlog.own_wait_s(f"default/{placed}", rt.clock()) == 0.0
    assert backlog.wait_s(f"default/{placed}", rt.clock()) > 0.0  # the asker's, for now
    assert shared == []  # the asker shares its own record when it sends the request
    own = request(system="Tenant 1 system prompt. " * 90, question="And of Spain?")
    assert computes_on(rt, server, own) == placed  # the peer's pick is in the index
    assert backlog.own_wait_s(f"default/{placed}", rt.clock()) > 0.0
    after = counted()
    assert after[0] == 1 and after[1] > 0, after
    assert shared == [f"default/{placed}"]


def test_new_prompts_placed_for_a_peer_weigh_on_the_next_pick_as_ones_own() -> None:
    """Where the leader placed other processes' new prompts is busy for its own next pick
    until the askers report: four new prompts at once, three placed for a peer and one
    of the leader's own, start on four pods, as one process would place four of its own.
    (A placement that queued nothing left the pod looking idle, and a tie sent a second
    new prompt after the first: two replicas computed on one pod while another idled.)"""
    rt = runtime()
    server = pd_server({f"g{i}": ([f"p{i}"], [f"d{i}"]) for i in range(4)})
    started = []
    for tenant in range(3):
        for_peer = request(system=f"Tenant {tenant} system prompt. " * 90)
        for_peer.asker = "peer"
        started.append(computes_on(rt, server, for_peer))
    started.append(computes_on(rt, server, request(system="Tenant 3 system prompt. " * 90)))
    assert sorted(started) == ["p0", "p1", "p2", "p3"], started
    # The asker's report of its own backlog replaces what the leader queued for it.
    backlog, now = rt.deps.backlog, rt.clock()
    for name in started[:3]:
        backlog.set_remote("peer", f"default/{name}", 0.0, now)
        assert backlog.wait_s(f"default/{name}", now) == 0.0


def test_precise_prefix_cache_counts_store_hits_at_a_factor() -> None:
    rt = runtime()
    server = pd_server({"g": (["p1", "p2"], ["d1"])})
    req = request()
    ctx = context(rt, server, req)
    hashes = ctx.prompt.precise_hashes()
    total = len(hashes)
    assert total > 20
    rt.precise.stored("default/p1", "default/pd", hashes[:4], "GPU")
    rt.precise.stored("default/p1", "default/pd", hashes[:10], "cpu")
    scorer = PrecisePrefixCacheScorer(1.0, rt.deps, {"storeHitFactor": 0.5})
    cands = candidates(rt, list(server.groups[0].prefill))
    # Score unit: p1: 4 local + 6 more from the store at 0.5; p2: 10 from the store at 0.5.
    ctx.ttft_unit = False
    assert scorer.score(ctx, cands) == [pytest.approx((4 + 0.5 * 6) / total),
                                        pytest.approx(0.5 * 10 / total)]
    assert ctx.precise_local == [4, 0] and ctx.precise_reach == [10, 10]
    # ttft unit (Mooncake's Conductor): pulling a block beats recomputing it, so each pod
    # computes what the pool lacks and pulls the rest: cost = b x (T - 160) + pull x moved.
    ctx.ttft_unit = True
    cost = CostModel()
    pull = cost.kv_bytes_per_token / (cost.pool_gbytes_per_sec * 1e9)
    tokens = ctx.prompt.token_count()
    b = cost.prefill_s_per_token
    expected = [b * (tokens - 160) + pull * 96, b * (tokens - 160) + pull * 160]
    scores = scorer.score(ctx, cands)
    scale = scorer.scale_s(ctx, cands)
    assert scale == pytest.approx(b * tokens)
    assert [scale * (1 - s) for s in scores] == pytest.approx(expected)
    assert ctx.pull_tokens == [96, 160] and ctx.compute_tokens == [tokens - 160] * 2


def test_precise_scores_from_leading_blocks_equal_the_full_hash() -> None:
    """Scored lazily (keys only up to the first block no pod or pool holds), a prompt
    gets the same scores as from all its keys, in both units."""
    rt = runtime()
    server = pd_server({"g": (["p1", "p2"], ["d1"])})
    full = context(rt, server, request()).prompt.precise_hashes()
    rt.precise.stored("default/p1", "default/pd", full[:4], "GPU")
    rt.precise.stored("default/p2", "default/pd", full[:7], "GPU")
    rt.precise.stored("default/p1", "default/pd", full[:10], "cpu")
    scorer = PrecisePrefixCacheScorer(1.0, rt.deps, {"storeHitFactor": 0.5})
    cands = candidates(rt, list(server.groups[0].prefill))
    for ttft_unit in (False, True):
        exact = context(rt, server, request())
        exact.prompt.precise_hashes()  # every key first: the full path
        lazy = context(rt, server, request())
        exact.ttft_unit = lazy.ttft_unit = ttft_unit
        assert scorer.score(lazy, cands) == pytest.approx(scorer.score(exact, cands))
        assert lazy.precise_local == exact.precise_local == [4, 7]
        assert lazy.precise_reach == exact.precise_reach == [10, 10]
        assert lazy.precise_hashes == exact.precise_hashes == len(full)
        assert lazy.prompt.token_count() == exact.prompt.token_count()


def _pool_server_in_view(rt: SchedulerRuntime, view: ClusterView) -> ServerPods:
    """A PD server that declares a Mooncake Store pool, with two prefill pods and one decode
    pod, published through `view` (as a config directory or the API server would)."""
    view.apply(ModelServer(
        meta=ObjectMeta(name="pd", annotations={"pdgate.io/kv-pool": "mooncake-store"}),
        model="m", inference_engine="vLLM", match_labels={"app": "pd"},
        pd_group=PDGroup("group", {"role": "prefill"}, {"role": "decode"}), port=8000,
    ))  # fmt: skip
    for name, role in (("p1", "prefill"), ("p2", "prefill"), ("d1", "decode")):
        view.apply(Pod(meta=ObjectMeta(name=name, labels={"app": "pd", "role": role,
                                                          "group": "g"}),
                       ip="10.0.0.1", ready=True))
    return view.snapshot.servers[("default", "pd")]


#: Blocks keyed by the engines' own hashes (their seed known), so events need no token ids.
ENGINE_HASHES = {"preciseIndex": {"keys": "hashes", "hashSeed": "0"}}


def test_prefill_pods_stored_blocks_feed_the_precise_pool_without_store_events() -> None:
    registry = CollectorRegistry()
    view = ClusterView()
    config = parse_scheduler_config(ENGINE_HASHES)
    rt = SchedulerRuntime(config, InFlight(registry), view, registry,
                          rng=random.Random(0), tokenize=sim_tokens)
    server = _pool_server_in_view(rt, view)
    scorer = PrecisePrefixCacheScorer(1.0, rt.deps, {})
    cands = candidates(rt, list(server.groups[0].prefill))
    first = context(rt, server, request("first? " + "a long question " * 40))
    hashes = first.prompt.precise_hashes()
    # p1 computed the prompt: its connector wrote every block to the store, so p2 can pull
    # all of them although p2 holds none and no engine published a store event.
    rt.precise.stored("default/p1", "default/pd", hashes, "GPU")
    assert rt.precise.store_blocks("default/pd") == set(hashes)
    again = context(rt, server, request("first? " + "a long question " * 40))
    scorer.score(again, cands)
    assert again.precise_local == [len(hashes), 0]
    assert again.precise_reach == [len(hashes), len(hashes)]
    # Decode pods write nothing to the store (they read what prefill wrote).
    rt.precise.stored("default/d1", "default/pd", [7, 8], "GPU")
    assert not {7, 8} & rt.precise.store_blocks("default/pd")
    # With the pool view off in the config, a prefill pod's blocks stay its own.
    rt.apply_config(parse_scheduler_config({**ENGINE_HASHES, "poolView": {"enabled": False}}))
    rt.precise.stored("default/p1", "default/pd", [40, 41], "GPU")
    assert not {40, 41} & rt.precise.store_blocks("default/pd")
    rt.apply_config(config)
    rt.precise.stored("default/p1", "default/pd", [40, 41], "GPU")
    assert {40, 41} <= rt.precise.store_blocks("default/pd")
    # Once the engines publish store events themselves, they alone say what the pool holds.
    rt.precise.stored("default/p2", "default/pd", [50], "cpu")
    rt.precise.stored("default/p1", "default/pd", [60, 61], "GPU")
    assert rt.precise.store_blocks("default/pd") == {*hashes, 40, 41, 50}


def test_precise_picks_on_a_pool_server_record_nothing_in_the_pool_themselves() -> None:
    """Dispatches do not feed the precise pool (the prefill pod's events do): so a prompt
    is never encoded past the first block no pod and no pool holds just to record it."""
    registry = CollectorRegistry()
    view = ClusterView()
    config = parse_scheduler_config({**ENGINE_HASHES, "profiles": {"prefill": {"scorers": [
        {"type": "precise-prefix-cache", "weight": 1.0},
        {"type": "least-request", "weight": 1.0},
    ]}}})  # fmt: skip
    rt = SchedulerRuntime(config, InFlight(registry), view, registry,
                          rng=random.Random(0), tokenize=sim_tokens)
    server = _pool_server_in_view(rt, view)
    req = request("new? " + "a question nobody asked " * 80)
    asyncio.run(rt.scheduler.prepare(server, req))
    pick = rt.scheduler.pick(server, req, frozenset())
    assert pick is not None and pick.prefill is not None
    rt.deps.pending.flush(float("inf"))  # every deferred record is due
    assert rt.precise.store_blocks("default/pd") == set()
    # What the chosen prefill pod then stores is what the pool holds.
    hashes = context(rt, server, req).prompt.precise_hashes()
    rt.precise.stored(pick.prefill.key, "default/pd", hashes, "GPU")
    assert rt.precise.store_blocks("default/pd") == set(hashes)


def test_least_request_score_and_its_seconds() -> None:
    rt = runtime()
    server = aggregated("a", "b", "c")
    pods = list(server.aggregated)
    busy(rt, pods[1], 2)
    busy(rt, pods[2], 4)
    ctx = context(rt, server, request())
    scorer = LeastRequestScorer(1.0, rt.deps, {})
    cands = candidates(rt, pods)
    assert scorer.score(ctx, cands) == [1.0, 0.5, 0.0]
    ctx.role = "prefill"
    assert scorer.scale_s(ctx, cands) == pytest.approx(4 * ctx.mean_prefill_s)
    ctx.role = "decode"
    assert scorer.scale_s(ctx, cands) == pytest.approx(4 * CostModel().decode_admission_s)
    idle = candidates(rt, [pods[0]])
    assert scorer.score(ctx, idle) == [1.0]


def test_queue_score_with_unknown_metrics() -> None:
    rt = runtime()
    server = aggregated("a", "b", "c", "d")
    pods = list(server.aggregated)
    engine(rt, pods[0], waiting=0.0)
    engine(rt, pods[1], waiting=16.0)
    engine(rt, pods[2], waiting=40.0)
    rt.engines.put(pods[3].key, EngineLoad(waiting=0.0, at=time.monotonic() - 60))  # stale
    scorer = QueueScorer(1.0, rt.deps, {"threshold": 32.0})
    ctx = context(rt, server, request())
    assert scorer.score(ctx, candidates(rt, pods)) == [1.0, 0.5, 0.0, 0.5]
    assert scorer.score(ctx, candidates(rt, [pods[3]])) == [1.0]  # nothing known: neutral


def test_kv_cache_usage_score() -> None:
    rt = runtime()
    server = aggregated("a", "b", "c")
    pods = list(server.aggregated)
    engine(rt, pods[0], kv_usage=0.25)
    engine(rt, pods[1], kv_usage=1.0)
    scorer = KVCacheUsageScorer(1.0, rt.deps, {})
    ctx = context(rt, server, request())
    cands = candidates(rt, pods)
    assert scorer.score(ctx, cands) == [0.75, 0.0, 0.375]
    assert scorer.scale_s(ctx, cands) == CostModel().kv_full_penalty_s


def test_session_affinity_score() -> None:
    rt = runtime()
    server = aggregated("a", "b")
    pods = list(server.aggregated)
    scorer = SessionAffinityScorer(1.0, rt.deps, {})
    req = request(headers={"x-session-id": "s1"})
    ctx = context(rt, server, req)
    cands = candidates(rt, pods)
    assert scorer.score(ctx, cands) == [0.0, 0.0]
    scorer.picked(ctx, cands, 1)
    assert scorer.score(ctx, cands) == [0.0, 1.0]
    other = context(rt, server, request(headers={"x-session-id": "s2"}))
    assert scorer.score(other, cands) == [0.0, 0.0]
    ctx.role = "prefill"  # remembered per role
    assert scorer.score(ctx, cands) == [0.0, 0.0]


def test_random_score_is_seeded() -> None:
    server = aggregated("a", "b", "c")
    draws = []
    for _ in range(2):
        rt = runtime(seed=42)
        ctx = context(rt, server, request())
        draws.append(RandomScorer(1.0, rt.deps, {}).score(ctx, candidates(rt, list(
            server.aggregated))))
    assert draws[0] == draws[1]
    assert all(0.0 <= s < 1.0 for s in draws[0]) and len(set(draws[0])) == 3


def test_session_table_is_bounded() -> None:
    rt = runtime(parse_scheduler_config({"sessions": {"maxSessions": 3}}))
    for i in range(10):
        rt.deps.sessions.put("prefill", f"s{i}", "p")
    assert len(rt.deps.sessions) == 3
    assert rt.deps.sessions.get("prefill", "s9") == "p"
    assert rt.deps.sessions.get("prefill", "s0") is None


def test_long_session_ids_are_kept_by_their_digest() -> None:
    rt = runtime()
    sessions = rt.deps.sessions
    long_a, long_b = "a" * 30_000, "a" * 29_999 + "b"
    sessions.put("prefill", long_a, "p1")
    sessions.put("prefill", long_b, "p2")
    sessions.put("prefill", "short", "p3")
    assert sessions.get("prefill", long_a) == "p1" and sessions.get("prefill", long_b) == "p2"
    assert sessions.get("prefill", "short") == "p3"
    assert sessions.get("decode", long_a) is None
    held = sum(len(session) for _, session in sessions._table)
    assert held <= 2 * 16 + len("short")  # not the 60,000 characters the ids came in


# -- filters -----------------------------------------------------------------------------------


def test_filters() -> None:
    ejected = {"default/b"}
    rt = runtime()
    rt.set_ejection_hook(lambda key: key in ejected)
    server = aggregated("a", "b", "c")
    pods = list(server.aggregated)
    engine(rt, pods[2], waiting=33.0, kv_usage=0.5)
    ctx = context(rt, server, request())
    cands = candidates(rt, pods)
    assert ReadyFilter(rt.deps, {}).select(ctx, cands) is None
    assert NotEjectedFilter(rt.deps, {}).select(ctx, cands) == [0, 2]
    assert NotSaturatedFilter(rt.deps, {}).select(ctx, cands) == [0, 1]
    assert NotSaturatedFilter(rt.deps, {"maxWaiting": 40.0}).select(ctx, cands) is None
    assert NotSaturatedFilter(rt.deps, {"maxWaiting": 40.0, "maxKvUsage": 0.4}).select(
        ctx, cands) == [0, 1]
    busy(rt, pods[0], 3)
    assert NotSaturatedFilter(rt.deps, {"maxWaiting": 99.0, "maxInFlight": 2}).select(
        ctx, candidates(rt, pods)) == [1, 2]


def test_a_filter_that_removes_everyone_is_skipped() -> None:
    rt = runtime()
    rt.set_ejection_hook(lambda key: True)
    server = aggregated("a", "b")
    pick = rt.scheduler.pick(server, request(), frozenset())
    assert pick is not None
    assert sample(rt.metrics.registry, "pdgate_scheduler_filter_fallbacks_total",
                  filter="not-ejected") == 1


# -- the pipeline: ties, affinity, anti-herding ------------------------------------------------


def test_ties_are_broken_at_random_never_by_list_order() -> None:
    names = ["a", "b", "c", "d"]
    for order in (names, names[::-1]):
        rt = runtime(parse_scheduler_config({"profiles": {"aggregated": {
            "scorers": [{"type": "least-request"}]}}}), seed=5)
        server = aggregated(*order)
        chosen = Counter(name_of(rt, server, request(f"q{i}")) for i in range(400))
        assert set(chosen) == set(names)
        assert min(chosen.values()) > 60  # roughly uniform, first in the list not favoured


def test_same_seed_same_choices() -> None:
    server = aggregated("a", "b", "c", "d")
    runs = []
    for _ in range(2):
        rt = runtime(seed=9)
        runs.append([rt.scheduler.pick(server, request(f"q{i}", system="x"), frozenset())
                     for i in range(50)])
    assert runs[0] == runs[1]


def test_a_clearly_worse_pod_is_not_part_of_the_tie() -> None:
    rt = runtime()
    server = aggregated("a", "b", "c")
    busy(rt, server.aggregated[0], 3)
    chosen = {name_of(rt, server, request(f"q{i}", system="x")) for i in range(100)}
    assert chosen == {"b", "c"}


def test_warm_pod_wins_at_equal_load_and_the_pick_records_the_prompt() -> None:
    rt = runtime()
    server = aggregated("a", "b", "c", "d")
    first = rt.scheduler.pick(server, request("first question"), frozenset())
    assert first is not None
    for i in range(20):  # same system prompt, new questions: all go to the warm pod
        pick = rt.scheduler.pick(server, request(f"question {i}"), frozenset())
        assert pick == first
    registry = rt.metrics.registry
    queries = sample(registry, "pdgate_prefix_cache_queries_total", index="approximate")
    hits = sample(registry, "pdgate_prefix_cache_hits_total", index="approximate")
    assert 0.8 < hits / queries < 1.0
    assert sample(registry, "pdgate_scheduler_decision_seconds_count", kind="aggregated") == 21


def test_similar_cache_benefit_lets_load_decide() -> None:
    rt = runtime()
    server = aggregated("a", "b")
    a, b = server.aggregated
    req = request()
    hashes = context(rt, server, req).prompt.approx_hashes()
    rt.approx.record(a.key, hashes)  # a holds everything
    rt.approx.record(b.key, hashes[: len(hashes) - 1])  # b holds all but the last block
    busy(rt, a, 1)
    pick = rt.scheduler.pick(server, req, frozenset())
    assert pick is not None and pick.decode == b
    # Without the similarity band, a's one extra block outweighs its one request.
    strict = runtime(parse_scheduler_config({"profiles": {"aggregated": {
        "scorers": [{"type": "prefix-cache"}, {"type": "least-request"}],
        "picker": {"cacheSimilarity": 0.0, "tieTolerance": 0.0}}}}))
    strict.approx.record(a.key, hashes)
    strict.approx.record(b.key, hashes[: len(hashes) // 2])
    busy(strict, a, 1)
    assert strict.scheduler.pick(server, req, frozenset()) == Pick(decode=a)


def test_guard_overrides_affinity_when_the_warm_pod_is_far_busier() -> None:
    long_system = "Every word of this system prompt costs prefill time. " * 600  # ~32 KB
    req = request(system=long_system)
    server = aggregated("warm", "cold")
    warm, cold = server.aggregated
    unguarded = parse_scheduler_config({"profiles": {"aggregated": {
        "scorers": [{"type": "prefix-cache"}, {"type": "least-request"}],
        "picker": {"guard": {"absolute": 0}}}}})
    guarded = parse_scheduler_config({"profiles": {"aggregated": {
        "scorers": [{"type": "prefix-cache"}, {"type": "least-request"}]}}})
    for config, expected in ((unguarded, warm), (guarded, cold)):
        rt = runtime(config)
        rt.approx.record(warm.key, context(rt, server, req).prompt.approx_hashes())
        busy(rt, warm, 8)  # 8 requests x ~50 ms queue wait < ~0.8 s of prefill saved
        assert rt.scheduler.pick(server, req, frozenset()) == Pick(decode=expected)
    assert sample(rt.metrics.registry, "pdgate_scheduler_guard_overrides_total",
                  role="aggregated") == 1


def test_guard_is_relative_too() -> None:
    rt = runtime()
    server = aggregated("warm", "cold")
    warm, cold = server.aggregated
    req = request()
    rt.approx.record(warm.key, context(rt, server, req).prompt.approx_hashes())
    busy(rt, warm, 20)
    busy(rt, cold, 15)  # 5 apart and not twice as busy: affinity and cost decide
    costs_pick = rt.scheduler.pick(server, req, frozenset())
    assert costs_pick is not None
    assert sample(rt.metrics.registry, "pdgate_scheduler_guard_overrides_total",
                  role="aggregated") == 0


def test_a_hot_prefix_spreads_under_load() -> None:
    rt = runtime()
    server = aggregated("a", "b", "c", "d")
    chosen: Counter[str] = Counter()
    for i in range(40):  # nothing completes: in-flight keeps growing
        pick = rt.scheduler.pick(server, request(f"q{i}"), frozenset())
        assert pick is not None
        rt.deps.inflight.acquire(pick.decode)
        chosen[pick.decode.pod_name] += 1
    assert len(chosen) == 4
    assert max(chosen.values()) - min(chosen.values()) <= 10


def test_avoided_pods_are_used_only_when_nothing_else_is_left() -> None:
    rt = runtime()
    server = aggregated("a", "b")
    a, b = server.aggregated
    for i in range(20):
        assert rt.scheduler.pick(server, request(f"{i}"), frozenset({a.key})) == Pick(decode=b)
    assert rt.scheduler.pick(server, request(), frozenset({a.key, b.key})) is not None
    assert rt.scheduler.pick(aggregated(), request(), frozenset()) is None


# -- prefill/decode pairs ----------------------------------------------------------------------


def test_pairs_stay_inside_a_group() -> None:
    rt = runtime()
    server = pd_server({"g0": (["p0"], ["d0"]), "g1": (["p1", "p2"], ["d1"])})
    for i in range(50):
        pick = rt.scheduler.pick(server, request(f"{i}", system="x"), frozenset())
        assert pick is not None and pick.prefill is not None
        assert pick.prefill.group == pick.decode.group


def test_a_group_with_a_saturated_decode_is_not_chosen_for_its_warm_prefill() -> None:
    rt = runtime()
    server = pd_server({"g0": (["p0"], ["d0"]), "g1": (["p1"], ["d1"])})
    p0 = server.groups[0].prefill[0]
    d0 = server.groups[0].decode[0]
    req = request()
    rt.approx.record(p0.key, context(rt, server, req).prompt.approx_hashes())
    pick = rt.scheduler.pick(server, req, frozenset())
    assert pick is not None and pick.prefill == p0  # warm prefill, healthy decode
    engine(rt, d0, waiting=100.0, kv_usage=1.0, running=64.0)  # decode side saturated
    for _ in range(10):
        pick = rt.scheduler.pick(server, req, frozenset())
        assert pick is not None and pick.decode.group == "g1"


def test_pair_cost_includes_decode_load() -> None:
    config = parse_scheduler_config({"profiles": {"decode": {
        "filters": ["ready"], "scorers": [{"type": "kv-cache-usage"}]}}})
    rt = runtime(config)
    server = pd_server({"g0": (["p0"], ["d0"]), "g1": (["p1"], ["d1"])})
    engine(rt, server.groups[0].decode[0], kv_usage=0.95)
    engine(rt, server.groups[1].decode[0], kv_usage=0.10)
    for i in range(20):
        pick = rt.scheduler.pick(server, request(f"{i}", system="x"), frozenset())
        assert pick is not None and pick.decode.pod_name == "d1"


def test_pd_with_avoid_and_relaxation() -> None:
    rt = runtime()
    server = pd_server({"g0": (["p0"], ["d0"]), "g1": (["p1"], ["d1"])})
    p0, d1 = server.groups[0].prefill[0], server.groups[1].decode[0]
    # Avoiding p0 and d1 leaves no pair in either group without one of them: relaxed.
    pick = rt.scheduler.pick(server, request(), frozenset({p0.key, d1.key}))
    assert pick is not None and pick.prefill is not None
    assert pick.prefill.group == pick.decode.group
    pick = rt.scheduler.pick(server, request(), frozenset({p0.key}))
    assert pick is not None and pick.prefill is not None and pick.prefill.pod_name == "p1"
    assert rt.scheduler.pick(pd_server({}), request(), frozenset()) is None


def test_last_resort_prefers_the_pair_with_fewest_avoided_or_ejected_pods() -> None:
    # No group keeps a wanted pair: g0 has two unwanted pods, g1 and g2 one each.
    server = pd_server({"g0": (["p0"], ["d0"]), "g1": (["p1"], ["d1"]), "g2": (["p2"], ["d2"])})
    (p0, d0), (p1, d1), (p2, d2) = ((g.prefill[0], g.decode[0]) for g in server.groups)
    for seed in range(20):
        rt = runtime(seed=seed)
        for endpoint in (p1, d1, p2, d2):
            busy(rt, endpoint, 5)  # load alone would choose g0
        pick = rt.scheduler.pick(server, request(), frozenset({p0.key, d0.key, d1.key, p2.key}))
        assert pick is not None and pick.decode.group in ("g1", "g2")
        rt.set_ejection_hook(lambda key: key == p0.key)
        pick = rt.scheduler.pick(server, request(), frozenset({d0.key, d1.key, p2.key}))
        assert pick is not None and pick.decode.group in ("g1", "g2")


def test_score_unit_profiles() -> None:
    config = parse_scheduler_config({"profiles": {
        name: {"unit": "score", "scorers": [{"type": "least-request", "weight": 2.0},
                                            {"type": "kv-cache-usage", "weight": 1.0}]}
        for name in ("prefill", "decode")}})
    rt = runtime(config)
    server = pd_server({"g0": (["p0"], ["d0"]), "g1": (["p1"], ["d1"])})
    busy(rt, server.groups[0].prefill[0], 1)
    pick = rt.scheduler.pick(server, request(), frozenset())
    assert pick is not None and pick.prefill is not None and pick.prefill.pod_name == "p1"
    assert sample(rt.metrics.registry, "pdgate_scheduler_decision_seconds_count",
                  kind="pd") == 1


def test_lock_free_decision_metrics_expose_what_prometheus_client_would() -> None:
    """The scheduler's per-decision histograms and counters (`router.tally`'s
    `BucketCounts`, `Tally`) read the same as prometheus-client's own, bucket edges
    included."""
    from prometheus_client import Counter as PromCounter
    from prometheus_client import Histogram

    from router.scheduling.metrics import DECISION_BUCKETS, SchedulerMetrics

    ours = CollectorRegistry()
    metrics = SchedulerMetrics(ours)
    theirs = CollectorRegistry()
    histogram = Histogram("pdgate_scheduler_decision_seconds", "", ["kind"],
                          buckets=DECISION_BUCKETS, registry=theirs)
    counter = PromCounter("pdgate_prefix_cache_hits", "", ["index"], registry=theirs)
    values = [0.0, 5e-6, 5.0001e-6, 1e-5, 3e-5, 0.05, 0.0500001, 7.0, *DECISION_BUCKETS]
    for v in values:
        metrics.decisions.decision_pd.observe(v)
        histogram.labels(kind="pd").observe(v)
    metrics.decisions.hits["approximate"].inc(3)
    metrics.decisions.hits["approximate"].inc(4)
    counter.labels(index="approximate").inc(7)
    compared = 0
    for family in theirs.collect():
        for s in family.samples:
            if not s.name.endswith("_created"):
                assert ours.get_sample_value(s.name, s.labels) == s.value, s
                compared += 1
    assert compared == len(DECISION_BUCKETS) + 1 + 2 + 1  # buckets, +Inf, count, sum; hits


def test_draw_below_draws_what_randrange_draws() -> None:
    """Ties are drawn without `randrange`'s interpreted frames, from the same stream and
    with the same values, so a seeded scheduler picks what it picked before."""
    for seed in range(20):
        ours, theirs = random.Random(seed), random.Random(seed)
        below = draw_below(ours)
        sizes = [1 + (seed * 7 + i * 13) % 37 for i in range(200)] + [2**40 + 3, 1, 1]
        assert [below(n) for n in sizes] == [theirs.randrange(n) for n in sizes]
        assert ours.random() == theirs.random()  # left at the same point of the stream
    with pytest.raises(ValueError):
        draw_below(random.Random(0))(0)


def test_a_lora_requests_precise_keys_are_the_adapters_blocks() -> None:
    """vLLM puts the adapter's name in every block's hash (`_gen_lora_extra_hash_keys`):
    an adapter's prompt matches the blocks an engine stored for that adapter, never the
    base model's blocks of the same tokens, by the full keys and by the lazy leading walk."""
    registry = CollectorRegistry()
    rt = SchedulerRuntime(parse_scheduler_config(ENGINE_HASHES), InFlight(registry),
                          ClusterView(), registry, rng=random.Random(0), tokenize=sim_tokens)
    server = pd_server({"g": (["p1", "p2"], ["d1"])})
    engine = VllmBlockHasher(VllmHashConfig("sha256", "0", 16))
    tokens = sim_tokens(CHAT, request().body)
    adapter = engine.event_hashes(tokens, lora_name="sql-lora")
    base = engine.event_hashes(tokens)
    assert len(adapter) > 20 and not set(adapter) & set(base)
    rt.precise.stored("default/p1", "default/pd", adapter, "GPU")  # served the adapter
    rt.precise.stored("default/p2", "default/pd", base, "GPU")  # served the base model
    scorer = PrecisePrefixCacheScorer(1.0, rt.deps, {})
    cands = candidates(rt, list(server.groups[0].prefill))
    for lora, expected in (("sql-lora", [len(adapter), 0]), (None, [0, len(base)])):
        for lazy in (False, True):
            req = request()
            req.lora_name = lora
            ctx = context(rt, server, req)
            if not lazy:
                ctx.prompt.precise_hashes()  # every key first: the full path
            scorer.score(ctx, cands)
            assert ctx.precise_local == expected, (lora, lazy)
