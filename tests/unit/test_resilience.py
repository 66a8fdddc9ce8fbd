"""Outlier ejection, health checks, admission control and drain, in-process."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from prometheus_client import CollectorRegistry

from engine_sim.faults import Faults, FaultSpec, spec_from_json
from router.errors import APIError
from router.resilience import Resilience
from router.resilience.admission import Admission
from router.resilience.config import ResilienceConfig
from router.resilience.drain import Drain
from router.resilience.ejection import OutlierDetector, without_ejected
from router.resilience.health import HealthChecker
from router.resilience.retry_budget import RetryBudget
from router.resources import ModelServer, ObjectMeta, PDGroup
from router.view import ClusterView, Endpoint, PDGroupPods, ServerPods


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pod(name: str, role: str = "decode") -> Endpoint:
    return Endpoint("default", name, "10.0.0.1", 8000, role)  # type: ignore[arg-type]


def gauge(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels or None)


# --- ejection -----------------------------------------------------------------------


def test_consecutive_failures_eject_and_a_success_resets_the_streak() -> None:
    clock, registry = Clock(), CollectorRegistry()
    detector = OutlierDetector(ResilienceConfig(consecutive_failures=3), registry, clock)
    a = pod("a")
    detector.record_failure(a)
    detector.record_failure(a)
    detector.record_success(a)
    detector.record_failure(a)
    detector.record_failure(a)
    assert not detector.is_ejected(a.key)
    detector.record_failure(a)
    assert detector.is_ejected(a.key)
    assert gauge(registry, "pdgate_pod_ejected", pod="default/a") == 1
    assert gauge(registry, "pdgate_pods_ejected") == 1
    assert gauge(registry, "pdgate_pod_ejections_total", source="passive") == 1


def test_backoff_grows_while_probes_fail_and_a_good_probe_readmits() -> None:
    clock, registry = Clock(), CollectorRegistry()
    config = ResilienceConfig(consecutive_failures=1, base_ejection_s=1.0, max_ejection_s=3.0)
    detector = OutlierDetector(config, registry, clock)
    a = pod("a")
    detector.record_failure(a)
    assert detector.due() == []  # backoff not over
    clock.now += 1.0
    assert detector.due() == [a]
    assert detector.due() == []  # being probed already
    detector.probe_result(a, ok=False)  # ejected for 2 s now
    clock.now += 1.5
    assert detector.due() == []
    clock.now += 0.5
    assert detector.due() == [a]
    detector.probe_result(a, ok=False)  # 4 s, capped at 3 s
    clock.now += 3.0
    assert detector.due() == [a]
    detector.probe_result(a, ok=True)
    assert not detector.is_ejected(a.key)
    assert gauge(registry, "pdgate_pod_readmissions_total") == 1
    assert gauge(registry, "pdgate_pod_ejected", pod="default/a") is None
    assert gauge(registry, "pdgate_pods_ejected") == 0
    # Failing again right away: the history still counts, the backoff stays long.
    detector.record_failure(a)
    clock.now += 2.9
    assert detector.due() == []


def test_history_is_forgotten_after_a_healthy_backoff() -> None:
    clock = Clock()
    config = ResilienceConfig(consecutive_failures=1, base_ejection_s=1.0, max_ejection_s=60)
    detector = OutlierDetector(config, None, clock)
    a = pod("a")
    detector.record_failure(a)
    clock.now += 1.0
    detector.due()
    detector.probe_result(a, ok=True)
    clock.now += 5.0
    detector.record_success(a)  # healthy longer than the last backoff: forgotten
    detector.record_failure(a)
    clock.now += 1.0
    assert detector.due() == [a]  # a first ejection again (1 s)


def test_disabled_detector_never_ejects_and_absent_pods_are_forgotten() -> None:
    registry = CollectorRegistry()
    off = OutlierDetector(ResilienceConfig(consecutive_failures=0))
    for _ in range(10):
        off.record_failure(pod("a"))
    assert not off.ejected
    on = OutlierDetector(ResilienceConfig(consecutive_failures=1), registry)
    on.record_failure(pod("a"))
    on.record_failure(pod("b"))
    on.forget_absent({"default/b"})
    assert on.ejected == {"default/b"}
    assert gauge(registry, "pdgate_pods_ejected") == 1


# --- health checks ------------------------------------------------------------------


async def test_sweep_ejects_after_the_threshold_and_probes_readmit() -> None:
    from router.resources import parse_object
    from router.view import ClusterView

    view = ClusterView()
    view.apply(parse_object({
        "apiVersion": "networking.serving.volcano.sh/v1alpha1", "kind": "ModelServer",
        "metadata": {"name": "s", "namespace": "default"},
        "spec": {"inferenceEngine": "vLLM", "workloadPort": {"port": 8000},
                 "workloadSelector": {"matchLabels": {"app": "x"}}},
    }))
    for name in ("p1", "p2"):
        view.apply(parse_object({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "labels": {"app": "x"}},
            "status": {"phase": "Running", "podIP": f"10.0.0.{name[-1]}",
                       "conditions": [{"type": "Ready", "status": "True"}]},
        }))
    healthy = {"http://10.0.0.1:8000/health": True, "http://10.0.0.2:8000/health": False}
    probed: list[str] = []

    async def probe(url: str, timeout_s: float) -> bool:
        probed.append(url)
        return healthy[url]

    config = ResilienceConfig(unhealthy_threshold=2, base_ejection_s=0.0, probe_tick_s=0.01)
    registry = CollectorRegistry()
    resilience = Resilience(config, view, probe, registry)
    checker = resilience.health
    assert isinstance(checker, HealthChecker)
    await checker.sweep()
    assert not resilience.outliers.ejected
    await checker.sweep()
    assert resilience.outliers.ejected == {"default/p2"}
    assert resilience.is_ejected("default/p2")
    assert gauge(registry, "pdgate_pod_ejections_total", source="active") == 1
    probed.clear()
    await checker.sweep()  # ejected pods are left to the readmission probes
    assert probed == ["http://10.0.0.1:8000/health"]
    healthy["http://10.0.0.2:8000/health"] = True
    task = asyncio.create_task(resilience.run())
    try:
        for _ in range(100):
            if not resilience.outliers.ejected:
                break
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert not resilience.outliers.ejected
    assert gauge(registry, "pdgate_health_checks_total", result="failed") == 2


async def test_the_readmission_loop_sleeps_until_a_pod_is_ejected() -> None:
    probed: list[str] = []

    async def probe(url: str, timeout_s: float) -> bool:
        probed.append(url)
        return True

    config = ResilienceConfig(consecutive_failures=1, base_ejection_s=0.0,
                              health_interval_s=0, probe_tick_s=0.01)
    detector = OutlierDetector(config)
    looks = 0
    due = detector.due

    def counted_due() -> list[Endpoint]:
        nonlocal looks
        looks += 1
        return due()

    detector.due = counted_due  # type: ignore[method-assign]
    checker = HealthChecker(config, ClusterView(), detector, probe)
    task = asyncio.create_task(checker.run())
    try:
        await asyncio.sleep(0.05)  # five probe ticks
        assert looks == 0  # asleep: not even a look at the empty set
        assert probed == [] and not detector.any_ejected.is_set()
        detector.record_failure(Endpoint("default", "p", "10.0.0.1", 8000, "both"))
        assert detector.any_ejected.is_set()
        async with asyncio.timeout(5):
            while detector.ejected:  # noqa: ASYNC110 (the loop wakes, probes, readmits)
                await asyncio.sleep(0.01)
        assert probed == ["http://10.0.0.1:8000/health"]
        assert not detector.any_ejected.is_set()  # asleep again
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_probe_that_raises_leaves_the_pod_to_be_probed_again() -> None:
    """A probe fails with an error it does not report (a bug, say): the round fails, the
    pod stays ejected and is probed again later, and readmitted when healthy (it was left
    marked as being probed, and never probed again)."""
    calls: list[str] = []

    async def probe(url: str, timeout_s: float) -> bool:
        calls.append(url)
        if len(calls) == 1:
            raise RuntimeError("the probe's client is closed")
        return True

    config = ResilienceConfig(base_ejection_s=0.0, health_interval_s=0)
    detector = OutlierDetector(config)
    checker = HealthChecker(config, ClusterView(), detector, probe)
    pod = Endpoint("default", "p", "10.0.0.1", 8000, "both")
    detector.eject(pod, "passive")
    with pytest.raises(RuntimeError):
        await checker.readmit()
    assert detector.is_ejected(pod.key)
    await checker.readmit()
    assert calls == ["http://10.0.0.1:8000/health"] * 2
    assert not detector.ejected


async def test_the_ranks_of_a_data_parallel_pod_share_one_probe() -> None:
    """A pod running two ranks behind one API server is two targets and one /health."""
    from router.resources import parse_object

    view = ClusterView()
    view.apply(parse_object({
        "apiVersion": "networking.serving.volcano.sh/v1alpha1", "kind": "ModelServer",
        "metadata": {"name": "s", "namespace": "default",
                     "annotations": {"pdgate.io/data-parallel-size": "2"}},
        "spec": {"inferenceEngine": "vLLM", "workloadPort": {"port": 8000},
                 "workloadSelector": {"matchLabels": {"app": "x"}}},
    }))
    view.apply(parse_object({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", "namespace": "default", "labels": {"app": "x"}},
        "status": {"phase": "Running", "podIP": "10.0.0.1",
                   "conditions": [{"type": "Ready", "status": "True"}]},
    }))
    probed: list[str] = []
    healthy = [False]

    async def probe(url: str, timeout_s: float) -> bool:
        probed.append(url)
        return healthy[0]

    config = ResilienceConfig(unhealthy_threshold=2, base_ejection_s=0.0)
    resilience = Resilience(config, view, probe, CollectorRegistry())
    checker = resilience.health
    assert isinstance(checker, HealthChecker)
    await checker.sweep()
    await checker.sweep()
    assert probed == ["http://10.0.0.1:8000/health"] * 2
    assert resilience.outliers.ejected == {"default/p/dp0", "default/p/dp1"}
    probed.clear()
    healthy[0] = True
    await checker.readmit()
    assert probed == ["http://10.0.0.1:8000/health"]
    assert not resilience.outliers.ejected


# --- admission ----------------------------------------------------------------------


async def test_admission_fast_path_queue_and_refusals() -> None:
    registry = CollectorRegistry()
    admission = Admission(ResilienceConfig(max_inflight=2, max_queue=1, queue_timeout_s=0.2),
                          registry)
    assert admission.try_enter("m") and admission.try_enter("m")
    assert not admission.try_enter("m")
    assert gauge(registry, "pdgate_admission_inflight") == 2
    assert gauge(registry, "pdgate_admission_limit") == 2
    waiter = asyncio.create_task(admission.wait("m"))
    await asyncio.sleep(0)
    assert admission.waiting == 1
    with pytest.raises(APIError) as full:
        await admission.wait("m")
    assert full.value.status == 503 and full.value.headers["retry-after"] == "1"
    admission.leave("m")  # hands the slot to the waiter
    await waiter
    assert admission.inflight == 2 and admission.waiting == 0
    with pytest.raises(APIError) as late:
        await admission.wait("m")  # nobody leaves: times out
    assert late.value.status == 503
    assert gauge(registry, "pdgate_admission_rejected_total", reason="queue_full") == 1
    assert gauge(registry, "pdgate_admission_rejected_total", reason="queue_timeout") == 1
    assert gauge(registry, "pdgate_admission_queue") == 0
    admission.leave("m")
    admission.leave("m")
    assert gauge(registry, "pdgate_admission_inflight") == 0  # back to zero


async def test_per_model_bound_does_not_block_other_models() -> None:
    admission = Admission(ResilienceConfig(max_inflight_per_model=1, max_queue=4,
                                           queue_timeout_s=1.0))
    assert admission.try_enter("a")
    waiting_a = asyncio.create_task(admission.wait("a"))
    await asyncio.sleep(0)
    # "b" has room, but someone is queued: it queues too and is woken at once by a leave.
    waiting_b = asyncio.create_task(admission.wait("b"))
    await asyncio.sleep(0)
    admission.leave("a")
    await asyncio.wait_for(asyncio.gather(waiting_a, waiting_b), 1.0)
    assert admission.per_model == {"a": 1, "b": 1}


async def test_a_waiter_admitted_as_its_deadline_fires_keeps_the_slot() -> None:
    """The slot is handed over (its future done) and the queue deadline cancels the task
    in the same loop turn: the request is admitted, and its slot is released once, by the
    caller, so the count returns to zero (it was refused 503 with the slot kept for good)."""
    admission = Admission(ResilienceConfig(max_inflight=1, max_queue=1, queue_timeout_s=0.05))
    assert admission.try_enter("m")
    waiting = asyncio.create_task(admission.wait("m"))
    await asyncio.sleep(0)  # queued, its deadline set
    asyncio.get_running_loop().call_soon(admission.leave, "m")  # the slot is freed in ...
    time.sleep(0.1)  # noqa: ASYNC251 (blocks on purpose: the deadline passes in that turn)
    await asyncio.wait_for(waiting, 1)  # admitted, not refused
    assert admission.inflight == 1
    admission.leave("m")
    assert admission.inflight == 0 and admission.try_enter("m")


async def test_a_cancelled_waiter_leaves_the_queue_and_passes_its_slot() -> None:
    admission = Admission(ResilienceConfig(max_inflight=1, max_queue=2, queue_timeout_s=5))
    assert admission.try_enter("m")
    first = asyncio.create_task(admission.wait("m"))
    second = asyncio.create_task(admission.wait("m"))
    await asyncio.sleep(0)
    first.cancel()
    await asyncio.sleep(0)
    assert admission.waiting == 1
    admission.leave("m")
    await asyncio.wait_for(second, 1)
    assert admission.inflight == 1
    admission.leave("m")
    assert admission.inflight == 0


def test_the_default_bound_is_sized_from_the_serving_pods() -> None:
    admission = Admission(ResilienceConfig(inflight_per_pod=3, max_queue=0,
                                           loop_lag_target_s=0))
    assert admission.enabled
    admission.size_for(2)  # two aggregated or decode pods
    assert admission.max_inflight == 6
    for _ in range(6):
        assert admission.try_enter("m")
    assert not admission.try_enter("m") and admission.saturated()
    assert admission.refuse_saturated().status == 503
    admission.size_for(3)  # a pod came up: room again
    assert not admission.saturated() and admission.try_enter("m")
    admission.size_for(0)  # no pods yet still bounds, at one pod's worth
    assert admission.max_inflight == 3
    off = Admission(ResilienceConfig(max_inflight=0))
    off.size_for(4)
    assert not off.enabled and off.max_inflight == 0 and not off.saturated()


def test_the_adaptive_limit_follows_the_loop_lag() -> None:
    admission = Admission(ResilienceConfig(inflight_per_pod=100, min_inflight=10,
                                           loop_lag_target_s=0.02, max_queue=0))
    admission.size_for(4)
    adaptive = admission.adaptive
    assert admission.max_inflight == 400
    for _ in range(200):
        admission.try_enter("m")
    for _ in range(4):
        adaptive.observe(0.2)  # the loop runs 10x behind its target: shed
    assert admission.max_inflight < 200
    assert admission.saturated() and not admission.try_enter("m")
    for _ in range(50):
        adaptive.observe(0.0)  # quiet again: the limit climbs back to the ceiling
    assert admission.max_inflight == 400
    assert admission.try_enter("m")
    idle = Admission(ResilienceConfig(inflight_per_pod=100, min_inflight=10,
                                      loop_lag_target_s=0.02))
    idle.size_for(1)
    for _ in range(10):
        idle.adaptive.observe(1.0)  # lag with nothing in flight: never below the floor
    assert idle.max_inflight == 10


async def test_the_lag_sampler_sleeps_while_the_router_is_idle() -> None:
    admission = Admission(ResilienceConfig(inflight_per_pod=100, min_inflight=10,
                                           loop_lag_target_s=0.02, max_queue=0))
    admission.size_for(4)
    adaptive = admission.adaptive
    sampler = asyncio.create_task(admission.run())
    try:
        await asyncio.sleep(0.01)
        assert not adaptive.sampling  # nothing in flight: no timer
        for _ in range(200):
            assert admission.try_enter("m")
        await asyncio.sleep(0)
        assert adaptive.sampling  # the first admission started it again
        loop = asyncio.get_running_loop()
        for _ in range(3):
            loop.call_soon(time.sleep, 0.2)  # the loop blocked 4x past the sampling period
            await asyncio.sleep(0.06)
        assert admission.max_inflight < 200  # the lag was seen and cut the limit
        for _ in range(200):
            admission.leave("m")
        # The limit climbs back (from the floor, 10, if the smoothed lag was still high
        # when the last request left: about 40 samples, 2 s), then the sampler parks;
        # a loop that lags again on a busy machine starts the climb over, hence the bound.
        async with asyncio.timeout(30):
            while adaptive.sampling:  # noqa: ASYNC110 (state the code under test keeps)
                await asyncio.sleep(0.05)
        assert admission.max_inflight == 400
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler


async def test_a_server_ticks_once_a_second_and_stops_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The main loop's tick refreshes the `date` header; `stop()` ends the serve without
    waiting for the next tick (here a minute away)."""
    import socket

    import uvicorn

    from router.resilience import runner

    monkeypatch.setattr(runner, "TICK_S", 60.0)

    async def app(scope: dict[str, object], receive: object, send: object) -> None:
        raise AssertionError("no request is sent")

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = runner._Server(uvicorn.Config(app, lifespan="off", log_level="warning"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(10):
            while not server.started:  # noqa: ASYNC110 (uvicorn's own flag)
                await asyncio.sleep(0.01)
        assert any(name == b"date" for name, _ in server.server_state.default_headers)
        server.stop()
        async with asyncio.timeout(10):
            await serving
    finally:
        serving.cancel()
        sock.close()


# --- drain --------------------------------------------------------------------------


async def test_drain_waits_for_requests_in_flight() -> None:
    drain = Drain()
    task = asyncio.current_task()
    assert task is not None
    drain.enter(task)
    drain.begin()
    assert drain.draining
    assert not await drain.wait_idle(0.05)
    asyncio.get_running_loop().call_later(0.05, drain.leave, task)
    assert await drain.wait_idle(1.0)
    idle = Drain()
    idle.begin()
    assert await idle.wait_idle(0.01)


async def test_drain_cut_cancels_the_requests_in_flight() -> None:
    drain = Drain()

    async def request() -> str:
        task = asyncio.current_task()
        assert task is not None
        drain.enter(task)
        try:
            await asyncio.sleep(60)
            return "finished"
        except asyncio.CancelledError:
            return "ended by the cut"  # as the app ends its response
        finally:
            drain.leave(task)

    requests = [asyncio.create_task(request()) for _ in range(3)]
    await asyncio.sleep(0)
    assert drain.active == 3 and not drain.draining
    assert drain.cut() == 3
    assert drain.draining
    assert await asyncio.gather(*requests) == ["ended by the cut"] * 3
    assert drain.active == 0 and drain.idle.is_set()


def test_resilience_follows_the_view() -> None:
    view = ClusterView()
    async def probe(url: str, timeout_s: float) -> bool:
        return True

    resilience = Resilience(ResilienceConfig(consecutive_failures=1), view, probe)
    resilience.outliers.record_failure(pod("gone"))
    assert resilience.is_ejected("default/gone")
    view.replace_all("Pod", [])
    view.replace_all("ModelServer", [])
    resilience._on_snapshot(view.snapshot)
    assert not resilience.is_ejected("default/gone")


@pytest.mark.parametrize("bad", [
    {"consecutive_failures": -1}, {"health_interval_s": -1}, {"probe_tick_s": 0},
    {"health_path": "health"},
])
def test_config_refuses_bad_values(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ResilienceConfig(**bad)  # type: ignore[arg-type]


# --- the simulator's fault plans ------------------------------------------------------


def test_fault_plans_are_seeded_and_targeted() -> None:
    spec = FaultSpec(error_rate=0.5, drop_rate=0.2, seed=3, match="MARK")
    first, second = Faults(spec), Faults(spec)
    bodies = [b"MARK %d" % i for i in range(50)]
    plans = [first.plan(b) for b in bodies]
    assert plans == [second.plan(b) for b in bodies]
    assert 10 < sum(p is not None and p.error_status == 500 for p in plans) < 40
    assert first.plan(b"unmarked") is None
    assert first.requests == 50
    crash = Faults(FaultSpec(crash_on_request=3))
    assert [bool(p and p.crash) for p in (crash.plan(b"") for _ in range(4))] == [
        False, False, True, False]
    assert not Faults().armed


@pytest.mark.parametrize("data", [
    {"error_rate": 1.5}, {"nope": 1}, {"error_status": 404}, {"match": 3},
    {"drop_after_chunks": 1.5}, {"hang_rate": True}, [],
])
def test_fault_specs_refuse_bad_fields(data: object) -> None:
    with pytest.raises(ValueError):
        spec_from_json(data)


def test_fault_spec_merges_onto_a_base() -> None:
    base = FaultSpec(error_rate=0.1, seed=4)
    assert spec_from_json({"drop_rate": 1}, base) == FaultSpec(error_rate=0.1, seed=4,
                                                               drop_rate=1.0)


# --- retries: ejected pods and the budget ------------------------------------------------


def _server(pd: bool) -> ServerPods:
    ms = ModelServer(
        meta=ObjectMeta(name="ms"), model=None, inference_engine="vLLM",
        match_labels={"app": "x"},
        pd_group=PDGroup("g", {"role": "p"}, {"role": "d"}) if pd else None, port=8000,
    )
    if not pd:
        return ServerPods(ms, aggregated=(pod("a", "both"), pod("b", "both")))
    groups = tuple(
        PDGroupPods(g, (pod(f"{g}-p", "prefill"),), (pod(f"{g}-d1"), pod(f"{g}-d2")))
        for g in ("g0", "g1")
    )
    return ServerPods(ms, groups=groups)


def test_without_ejected_leaves_retries_only_whole_pairs_of_healthy_pods() -> None:
    agg = _server(pd=False)
    assert without_ejected(agg, set()) is agg
    assert without_ejected(agg, {"default/zz"}) is agg
    left = without_ejected(agg, {"default/a"})
    assert left is not None and [p.pod_name for p in left.aggregated] == ["b"]
    assert without_ejected(agg, {"default/a", "default/b"}) is None

    pd = _server(pd=True)
    left = without_ejected(pd, {"default/g0-p", "default/g1-d1"})
    assert left is not None and left.server is pd.server
    assert [(g.group, [p.pod_name for p in g.decode]) for g in left.groups] == [
        ("g1", ["g1-d2"])
    ]
    assert without_ejected(pd, {"default/g0-p", "default/g1-p"}) is None


def test_retry_budget_is_a_share_of_requests_with_a_floor() -> None:
    registry = CollectorRegistry()
    budget = RetryBudget(budget_percent=20, min_retry_concurrency=2, registry=registry)
    assert budget.try_acquire() and budget.try_acquire()
    assert not budget.try_acquire()  # idle router: the floor, 2
    budget.requests = 20  # 20 % of 20 requests in flight: 4 retries
    assert budget.try_acquire() and budget.try_acquire()
    assert not budget.try_acquire()
    for _ in range(4):
        budget.release()
    assert budget.retries == 0 and budget.try_acquire()
    budget.refuse("ejected")
    assert registry.get_sample_value("pdgate_retries_refused_total", {"reason": "budget"}) == 2
    assert registry.get_sample_value("pdgate_retries_refused_total", {"reason": "ejected"}) == 1
    with pytest.raises(ValueError):
        RetryBudget(budget_percent=120)
    with pytest.raises(ValueError):
        ResilienceConfig(retry_min_concurrency=-1)
