"""The calibrated prefill curve, the dispatch-fed KV pool view and the TTFT-SLO gate."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import replace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from router.errors import APIError
from router.load import InFlight
from router.resources import ModelServer, ObjectMeta, PDGroup
from router.scheduling import ScheduleRequest
from router.scheduling.config import (
    DEFAULT_PROFILES,
    SchedulerConfig,
    SchedulerConfigError,
    parse_scheduler_config,
)
from router.scheduling.pool_view import (
    MAX_PENDING,
    MAX_PENDING_BLOCKS,
    MAX_POOL_BLOCKS,
    POOL_ANNOTATION,
    POOL_CAPACITY_ANNOTATION,
    PendingWrites,
    PoolSettings,
    PoolView,
    pool_settings,
)
from router.scheduling.precise_index import PrecisePrefixIndex
from router.scheduling.runtime import SchedulerRuntime
from router.scheduling.ttft_model import Coefficients, FitSettings, PrefillFit, robust_fit
from router.view import ClusterView, Endpoint, PDGroupPods, ServerPods

CHAT = "/v1/chat/completions"


# -- the fit -----------------------------------------------------------------------------------


def _curve_samples(
    n: int, truth: Coefficients, noise: float, outliers: float, seed: int = 1
) -> tuple[list[float], list[float]]:
    rng = random.Random(seed)
    xs, ys = [], []
    for _ in range(n):
        x = rng.uniform(0, 20_000)
        y = truth(x) * (1 + rng.gauss(0, noise))
        if rng.random() < outliers:
            y *= rng.uniform(3, 8)  # a stalled request: far slower than its prefill
        xs.append(x)
        ys.append(y)
    return xs, ys


def test_robust_fit_recovers_a_quadratic_despite_outliers() -> None:
    truth = Coefficients(0.02, 1e-4, 2e-9)
    xs, ys = _curve_samples(256, truth, noise=0.03, outliers=0.1)
    fit = robust_fit(xs, ys)
    assert fit is not None
    for x in (1_000, 8_000, 20_000):
        assert fit(x) == pytest.approx(truth(x), rel=0.08)
    plain = robust_fit(xs, ys, huber_k=1e9)  # no clipping: the outliers drag the curve up
    assert plain is not None and plain(8_000) > 1.2 * truth(8_000)


def test_robust_fit_keeps_coefficients_non_negative() -> None:
    # Concave data (a saturating curve) would give c < 0: the fit drops that term.
    xs = [float(x) for x in range(0, 10_000, 250)]
    ys = [0.01 + 2e-4 * x - 1e-8 * x * x for x in xs]
    fit = robust_fit(xs, ys)
    assert fit is not None and fit.a >= 0 and fit.b >= 0 and fit.c == 0
    assert robust_fit([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) is None  # one x: no curve at all


def test_two_prompt_lengths_calibrate_a_line() -> None:
    """Hits and misses of one prompt length (say, a shared system prompt behind short
    questions) are only two distinct x: enough for the overhead and the per-token cost."""
    rng = random.Random(3)
    truth = Coefficients(0.02, 2e-4)
    xs = [rng.choice((50.0, 1_100.0)) for _ in range(48)]
    ys = [truth(x) * (1 + rng.gauss(0, 0.05)) for x in xs]
    fit = robust_fit(xs, ys)
    assert fit is not None and fit.c == 0
    assert fit.a == pytest.approx(truth.a, rel=0.15)
    assert fit.b == pytest.approx(truth.b, rel=0.1)


def test_prefill_fit_keeps_the_seed_until_enough_samples_then_calibrates() -> None:
    seed = Coefficients(0.005, 1e-4)
    fit = PrefillFit(seed, FitSettings(window=64, min_samples=16, refit_every=4))
    truth = Coefficients(0.05, 3e-4, 0.0)  # the engines are 3x slower than configured
    xs, ys = _curve_samples(64, truth, noise=0.02, outliers=0.0, seed=2)
    for x, y in zip(xs[:10], ys[:10], strict=True):
        fit.add_sample(x, y)
    assert fit.coefficients == seed
    for x, y in zip(xs[10:], ys[10:], strict=True):
        fit.add_sample(x, y)
    assert fit.refits > 0
    assert fit.predict(10_000) == pytest.approx(truth(10_000), rel=0.05)
    # A window of absurd measurements (x1000) is beyond maxRatio of the seed: ignored.
    broken = PrefillFit(seed, FitSettings(window=64, min_samples=16, refit_every=4))
    for x in xs:
        broken.add_sample(x, truth(x) * 1000)
    assert broken.coefficients == seed and broken.refits == 0


def test_prefill_fit_tracks_its_prediction_error() -> None:
    fit = PrefillFit(Coefficients(0.0, 1e-3), FitSettings(error_alpha=0.5))
    fit.observe_error(1.0, 2.0)
    assert fit.error_abs_s == pytest.approx(1.0) and fit.error_rel == pytest.approx(0.5)
    fit.observe_error(2.0, 2.0)
    assert fit.error_abs_s == pytest.approx(0.5) and fit.error_rel == pytest.approx(0.25)


def test_prefill_error_ratio_is_not_ruled_by_a_short_prefill() -> None:
    """A queue predicted and not met before a 50 ms prefill: its own ratio is 19, the
    ratio of the means stays near what the prefills around it say (a WAPE)."""
    fit = PrefillFit(Coefficients(0.0, 1e-3), FitSettings(error_alpha=0.05))
    for _ in range(40):
        fit.observe_error(0.55, 0.5)  # 10% off
    assert fit.error_rel == pytest.approx(0.1)
    fit.observe_error(1.0, 0.05)
    assert fit.error_rel < 0.25  # a running mean of each prefill's ratio: 1.05
    for _ in range(20):
        fit.observe_error(0.55, 0.5)
    assert fit.error_rel < 0.15  # the same: 0.44


# -- the pool view -----------------------------------------------------------------------------


def test_pool_settings_from_annotations() -> None:
    assert not pool_settings({}).enabled
    on = pool_settings({POOL_ANNOTATION: "mooncake-store", POOL_CAPACITY_ANNOTATION: "4096"})
    assert on.enabled and on.capacity_tokens == 4096
    assert on.capacity_blocks(16) == 256
    assert pool_settings({POOL_ANNOTATION: "none"}, enabled_default=True).enabled is False
    assert pool_settings({POOL_CAPACITY_ANNOTATION: "lots"}).capacity_tokens > 0
    huge = pool_settings({POOL_ANNOTATION: "mooncake-store",
                          POOL_CAPACITY_ANNOTATION: str(10**15)})
    assert huge.capacity_blocks(1) == MAX_POOL_BLOCKS


def test_pool_view_is_a_bounded_lru_of_leading_blocks() -> None:
    view = PoolView()
    view.record("ns/a", [1, 2, 3], capacity_blocks=4)
    assert view.depth("ns/a", [1, 2, 3, 4]) == 3
    assert view.depth("ns/a", [2, 3]) == 2 and view.depth("ns/b", [1]) == 0
    view.record("ns/a", [1], capacity_blocks=4)  # 1 is young again
    view.record("ns/a", [7, 8], capacity_blocks=4)  # evicts 2 then 3 (oldest)
    assert view.total_blocks == 4 and view.evictions == 1
    assert view.depth("ns/a", [1, 2]) == 1 and view.depth("ns/a", [7, 8]) == 2
    view.retain_scopes({"ns/b"})
    assert view.total_blocks == 0


def test_precise_pool_is_fed_by_its_writers_and_refined_by_store_events() -> None:
    index = PrecisePrefixIndex(max_store_blocks=100)
    pool = PoolSettings(True, capacity_tokens=3 * 16)  # 3 blocks of 16 tokens
    index.set_pool_writers({"ns/p": ("ns/s", pool)})
    index.stored("ns/p", "ns/s", [10, 11, 12], "GPU")  # p's connector wrote them too
    assert index.match(["ns/q"], "ns/s", [10, 11, 12]) == ([0], [3])
    index.stored("ns/q", "ns/s", [13], "GPU")  # q is no writer (a decode pod, say)
    assert index.store_blocks("ns/s") == {10, 11, 12}
    index.stored("ns/p", "ns/s", [20], "GPU")  # bound 3: the oldest (10) goes
    assert index.store_blocks("ns/s") == {11, 12, 20}
    index.removed("ns/p", "ns/s", [11], "cpu")  # the store said block 11 left
    assert index.match(["ns/q"], "ns/s", [11, 12]) == ([0], [0])
    index.stored("ns/p", "ns/s", [11], "cpu")  # the engines speak for the store now
    index.stored("ns/p", "ns/s", [30], "GPU")
    assert index.store_blocks("ns/s") == {11, 12, 20}


# -- through the pipeline -------------------------------------------------------------------


def _server(annotations: dict[str, str]) -> ServerPods:
    server = ModelServer(
        meta=ObjectMeta(name="pd", annotations=annotations), model="m",
        inference_engine="vLLM", match_labels={"app": "pd"},
        pd_group=PDGroup("group", {"role": "prefill"}, {"role": "decode"}), port=8000,
    )  # fmt: skip

    def pod(name: str, role: str, group: str) -> Endpoint:
        return Endpoint("default", name, "10.0.0.1", 8000, role, group)  # type: ignore[arg-type]

    return ServerPods(server=server, groups=tuple(
        PDGroupPods(group=g, prefill=(pod(f"{g}-p", "prefill", g),),
                    decode=(pod(f"{g}-d", "decode", g),))
        for g in ("g1", "g2")
    ))  # fmt: skip


def _request(words: int = 2000, seed: int = 0) -> ScheduleRequest:
    rng = random.Random(seed)
    text = " ".join(rng.choice(("alpha", "beta", "gamma", "delta")) for _ in range(words))
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": text}]}
    return ScheduleRequest("m", CHAT, body, {})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _runtime(
    config: SchedulerConfig | None = None, clock: Clock | None = None
) -> tuple[SchedulerRuntime, CollectorRegistry]:
    registry = CollectorRegistry()
    rt = SchedulerRuntime(config or SchedulerConfig(), InFlight(registry), ClusterView(),
                          registry, rng=random.Random(0), clock=clock or Clock())
    return rt, registry


def test_pending_writes_apply_when_due_and_stay_bounded() -> None:
    pending = PendingWrites()
    done: list[int] = []
    pending.defer(2.0, lambda: done.append(2), 10)
    pending.defer(1.0, lambda: done.append(1), 10)  # out of order: due first
    pending.flush(0.5)
    assert done == [] and len(pending) == 2
    pending.flush(1.5)
    assert done == [1]
    pending.flush(2.5)
    assert done == [1, 2] and len(pending) == 0
    assert pending.blocks == 0
    for i in range(MAX_PENDING + 1):
        pending.defer(99.0, lambda i=i: done.append(100 + i), 1)  # type: ignore[misc]
    assert len(pending) == MAX_PENDING and done[-1] == 100  # the oldest applied at once
    pending.flush(100.0)
    long_prompt = 4096  # blocks of a prompt at the approximate index's maxPromptBlocks
    for i in range(MAX_PENDING):
        pending.defer(199.0, lambda i=i: done.append(10_000 + i), long_prompt)  # type: ignore[misc]
    assert pending.blocks <= MAX_PENDING_BLOCKS
    assert len(pending) == MAX_PENDING_BLOCKS // long_prompt
    assert done[-1] == 10_000 + MAX_PENDING - 1 - len(pending)  # the oldest applied early


def test_a_declared_pool_is_known_from_dispatches_without_store_events() -> None:
    clock = Clock()
    rt, _ = _runtime(clock=clock)
    server = _server({POOL_ANNOTATION: "mooncake-store"})
    req = _request()
    first = rt.scheduler.pick(server, req, frozenset())
    assert first is not None and first.prefill is not None
    # Not in the pool before its prefill is predicted to end (the store has nothing yet).
    rt.scheduler.pick(_server({}), _request(seed=9), frozenset())
    assert rt.pools.total_blocks == 0
    clock.now += 5.0
    rt.deps.pending.flush(clock.now)
    assert rt.pools.total_blocks > 0  # the prompt is in the pool now
    # The warm pod is busy: the other one can pull the prompt from the pool instead of
    # recomputing it, so it wins, and the cost model says it computes nothing.
    _queue_on(rt, first.prefill, 3)
    second = rt.scheduler.pick(server, _request(), frozenset())
    assert second is not None and second.prefill is not None
    assert second.prefill.key != first.prefill.key
    # Without the annotation the other pod would recompute everything, so the queue wins.
    rt2, _ = _runtime()
    plain = _server({})
    again = rt2.scheduler.pick(plain, req, frozenset())
    assert again is not None and again.prefill is not None and rt2.pools.total_blocks == 0


def test_measured_prefills_calibrate_the_servers_fit_and_are_exported() -> None:
    config = parse_scheduler_config({"ttftModel": {"minSamples": 4, "refitEvery": 1}})
    rt, registry = _runtime(config)
    server = _server({})
    truth = Coefficients(0.05, 3e-4)
    for i in range(12):
        pick = rt.scheduler.pick(server, _request(words=200 + 150 * i, seed=i), frozenset())
        assert pick is not None and pick.on_prefill is not None
        pick.on_prefill(truth(200 + 150 * i))
    labels = {"server": "default/pd"}
    samples = registry.get_sample_value("pdgate_scheduler_prefill_fit", {**labels,
                                                                        "term": "samples"})
    assert samples == 12
    b = registry.get_sample_value("pdgate_scheduler_prefill_fit", {**labels, "term": "b"})
    assert b is not None and b > 1.5e-4  # moved from the seed (1e-4) towards 3e-4
    assert registry.get_sample_value(
        "pdgate_scheduler_prefill_prediction_error_seconds_count") == 12


def _work_weight(weight: float) -> SchedulerConfig:
    prefill = DEFAULT_PROFILES["prefill"]
    profiles = {**DEFAULT_PROFILES, "prefill": replace(
        prefill, picker=replace(prefill.picker, work_weight=weight))}
    return SchedulerConfig(profiles=profiles)


@pytest.mark.parametrize(("weight", "stays"), [(0.25, True), (0.0, False)])
def test_a_warm_pod_queued_about_as_long_as_a_cold_prefill_keeps_its_prompt(
    weight: float, stays: bool
) -> None:
    """The prompt's pod is queued a little longer than computing the prompt cold on the
    idle pod takes: by predicted TTFT alone the idle pod wins; counting the compute the
    choice spends (`workWeight`, 0.25 by default) keeps the prompt where it is cached.
    Either way the predicted TTFT is the chosen pod's own."""
    rt, _ = _runtime(_work_weight(weight))
    server, req = _server({}), _request()
    first = rt.scheduler.pick(server, req, frozenset())
    assert first is not None and first.prefill is not None and first.on_prefill is not None
    cold = first.prefill_cost  # computing the whole prompt on an idle pod
    first.on_prefill(cold)
    warm = first.prefill
    rt.deps.inflight.acquire(warm)
    rt.deps.backlog.dispatch(warm.key, 1.15 * cold, rt.clock(), idle=False)
    again = rt.scheduler.pick(server, req, frozenset())
    assert again is not None and again.prefill is not None
    assert (again.prefill.key == warm.key) is stays
    expected = 1.15 * cold if stays else cold
    assert again.prefill_cost == pytest.approx(expected, rel=0.05)


# -- the SLO gate ------------------------------------------------------------------------------


def _slo_runtime(action: str = "reject") -> tuple[SchedulerRuntime, CollectorRegistry]:
    return _runtime(parse_scheduler_config({"sloAdmission": {
        "enabled": True, "ttftTarget": "1s", "action": action, "maxQueueWait": "2s",
        "queuePoll": "10ms",
    }}))


#: One queued request's predicted prefill in `_queue_on` (a short prompt at the seed cost).
QUEUED_PREFILL_S = 0.05

Held = list[tuple[Endpoint, float]]


def _queue_on(rt: SchedulerRuntime, pod: Endpoint, count: int) -> Held:
    """`count` requests in flight on `pod`, their prefills queued in the router's backlog,
    as the router's own dispatches leave them (in-flight count and backlog tickets)."""
    held: Held = []
    for _ in range(count):
        rt.deps.inflight.acquire(pod)
        held.append((pod, rt.deps.backlog.dispatch(pod.key, QUEUED_PREFILL_S, rt.clock(),
                                                   idle=False)))
    return held


def _busy(rt: SchedulerRuntime, server: ServerPods, count: int) -> Held:
    """`_queue_on` every prefill pod of `server`."""
    return [h for g in server.groups for p in g.prefill for h in _queue_on(rt, p, count)]


def _drain(rt: SchedulerRuntime, held: Held) -> None:
    """The requests `_queue_on` sent are done: released, their prefills finished now."""
    for pod, ticket in held:
        rt.deps.inflight.release(pod)
        rt.deps.backlog.finished(pod.key, ticket, rt.clock())


def test_slo_gate_rejects_with_retry_after_and_dispatches_nothing() -> None:
    rt, registry = _slo_runtime()
    server = _server({})
    assert rt.scheduler.pick(server, _request(), frozenset()) is not None
    _busy(rt, server, 200)  # 200 requests ahead on every prefill pod: far beyond 1 s
    blocks = rt.approx.total_blocks
    with pytest.raises(APIError) as caught:
        rt.scheduler.pick(server, _request(seed=5), frozenset())
    error = caught.value
    assert error.status == 429 and error.code == "ttft_slo"
    assert int(error.headers["retry-after"]) >= 1
    assert rt.approx.total_blocks == blocks  # the refused request was not recorded
    assert registry.get_sample_value(
        "pdgate_scheduler_slo_admission_total", {"outcome": "rejected"}) == 1
    assert registry.get_sample_value(
        "pdgate_scheduler_slo_admission_total", {"outcome": "admitted"}) == 1
    # A per-server annotation overrides the default target.
    relaxed = _server({"pdgate.io/ttft-slo": "1h"})
    _busy(rt, relaxed, 0)
    assert rt.scheduler.pick(relaxed, _request(seed=5), frozenset()) is not None


def test_slo_gate_is_off_by_default() -> None:
    rt, _ = _runtime()
    server = _server({"pdgate.io/ttft-slo": "1ms"})
    _busy(rt, server, 200)
    assert rt.scheduler.pick(server, _request(), frozenset()) is not None


async def test_slo_queue_action_waits_until_the_prediction_fits() -> None:
    rt, registry = _slo_runtime("queue")
    server = _server({})
    held = _busy(rt, server, 200)
    req = _request()

    async def drain() -> None:
        await asyncio.sleep(0.1)
        _drain(rt, held)

    task = asyncio.create_task(drain())
    began = time.monotonic()
    await rt.scheduler.prepare(server, req)
    waited = time.monotonic() - began
    await task
    assert 0.05 < waited < 2.0
    assert rt.scheduler.pick(server, req, frozenset()) is not None
    assert registry.get_sample_value(
        "pdgate_scheduler_slo_admission_total", {"outcome": "queued"}) == 1


def test_slo_length_factor_holds_a_long_prompt_to_its_own_prefill() -> None:
    """A flat 1 s target refuses a prompt whose own prefill takes longer even on an idle
    cluster; `lengthFactor: 1` admits it there and still refuses it behind a queue, and a
    short prompt keeps the flat target."""
    long = _request(words=40_000)
    server = _server({})
    flat, _ = _slo_runtime()
    with pytest.raises(APIError) as caught:
        flat.scheduler.pick(server, long, frozenset())  # idle pods, still "too slow"
    assert caught.value.code == "ttft_slo"

    rt, registry = _runtime(parse_scheduler_config({"sloAdmission": {
        "enabled": True, "ttftTarget": "1s", "lengthFactor": 1.0}}))
    assert rt.scheduler.pick(server, long, frozenset()) is not None
    _busy(rt, server, 200)
    with pytest.raises(APIError) as caught:
        rt.scheduler.pick(server, _request(words=40_000, seed=3), frozenset())
    # The refusal names the long prompt's own target (its idle TTFT), not the flat 1 s.
    assert "target (1.00 s)" not in caught.value.message
    with pytest.raises(APIError) as caught:
        rt.scheduler.pick(server, _request(seed=4), frozenset())
    assert "target (1.00 s)" in caught.value.message
    assert registry.get_sample_value(
        "pdgate_scheduler_slo_admission_total", {"outcome": "rejected"}) == 2


def test_slo_length_factor_must_not_be_negative() -> None:
    with pytest.raises(SchedulerConfigError, match="lengthFactor"):
        parse_scheduler_config({"sloAdmission": {"lengthFactor": -1}})


async def test_slo_queue_action_does_not_hold_a_long_prompt_that_fits_its_own_target() -> None:
    rt, registry = _runtime(parse_scheduler_config({"sloAdmission": {
        "enabled": True, "ttftTarget": "1s", "lengthFactor": 1.0, "action": "queue",
        "maxQueueWait": "50ms", "queuePoll": "10ms"}}))
    server = _server({})
    await rt.scheduler.prepare(server, _request(words=40_000))  # idle pods: no wait
    assert registry.get_sample_value(
        "pdgate_scheduler_slo_admission_total", {"outcome": "queued"}) == 0
    _busy(rt, server, 200)
    await rt.scheduler.prepare(server, _request(words=40_000, seed=1))  # held, then let go
    assert registry.get_sample_value(
        "pdgate_scheduler_slo_admission_total", {"outcome": "queued"}) == 1
