"""The prefill backlog (Conductor's queue time) and the `prefill-backlog` scorer."""

from __future__ import annotations

import pytest

from router.scheduling.backlog import MAX_TRACKED_PODS, PrefillBacklog
from router.scheduling.config import parse_scheduler_config
from tests.unit.test_sched_ttft import Clock, _request, _runtime, _server


def test_backlog_is_exact_for_a_one_at_a_time_pod() -> None:
    backlog = PrefillBacklog()
    assert backlog.wait_s("p", 0.0) == 0.0
    first = backlog.dispatch("p", 2.0, now=0.0, idle=True)
    second = backlog.dispatch("p", 1.0, now=0.5, idle=False)
    assert (first, second) == (2.0, 3.0)
    assert backlog.wait_s("p", 1.0) == pytest.approx(2.0)
    # The first prefill ended early (1.5 s instead of 2): what follows moves up by 0.5 s.
    backlog.finished("p", first, now=1.5)
    assert backlog.wait_s("p", 1.5) == pytest.approx(1.0)
    # It never predicts the past, and an idle pod starts from now (no phantom backlog
    # from a prefill that failed and never reported).
    assert backlog.wait_s("p", 10.0) == 0.0
    backlog.dispatch("q", 5.0, now=0.0, idle=True)
    assert backlog.dispatch("q", 1.0, now=1.0, idle=True) == 2.0


def test_a_late_prefill_delays_what_follows_once() -> None:
    """A runs 1 s late, so B (queued behind it) starts 1 s late and, taking its predicted
    second, ends exactly on its shifted end: the pod is then idle, not 1 s more behind."""
    backlog = PrefillBacklog()
    a = backlog.dispatch("p", 1.0, now=0.0, idle=True)
    b = backlog.dispatch("p", 1.0, now=0.0, idle=False)
    c = backlog.dispatch("p", 1.0, now=0.0, idle=False)
    backlog.finished("p", a, now=2.0)  # predicted 1.0
    assert backlog.wait_s("p", 2.0) == pytest.approx(2.0)  # B and C still to run
    backlog.finished("p", b, now=3.0)  # on time after A's delay
    assert backlog.wait_s("p", 3.0) == pytest.approx(1.0)  # only C left
    backlog.finished("p", c, now=4.0)
    assert backlog.wait_s("p", 4.0) == 0.0


def test_a_placement_for_another_process_waits_for_that_process_report() -> None:
    """`add_remote`: prefills placed for another router process queue behind what it last
    reported there (not behind this process's own), and its next report is the truth."""
    backlog = PrefillBacklog()
    backlog.dispatch("p", 1.0, now=0.0, idle=True)  # this process's own
    backlog.set_remote("peer", "p", 0.5, now=0.0)  # the peer's last report
    backlog.add_remote("peer", "p", 2.0, now=0.2)
    backlog.add_remote("peer", "p", 1.0, now=0.2)
    assert backlog.own_wait_s("p", 0.2) == pytest.approx(0.8)
    assert backlog.wait_s("p", 0.2) == pytest.approx(0.8 + 0.3 + 2.0 + 1.0)
    backlog.set_remote("peer", "p", 2.5, now=0.4)  # it dispatched them (one ran early)
    assert backlog.wait_s("p", 0.4) == pytest.approx(0.6 + 2.5)
    backlog.add_remote("other", "q", 1.0, now=5.0)  # nothing reported: from now
    assert backlog.wait_s("q", 5.5) == pytest.approx(0.5)


def test_backlog_forgets_pods_and_stays_bounded() -> None:
    backlog = PrefillBacklog()
    backlog.dispatch("a", 1.0, 0.0, True)
    backlog.dispatch("b", 1.0, 0.0, True)
    backlog.retain(["b"])
    assert backlog.wait_s("a", 0.0) == 0.0 and backlog.wait_s("b", 0.0) == 1.0
    for i in range(MAX_TRACKED_PODS + 5):
        backlog.dispatch(f"pod-{i}", 1.0, 0.0, True)
    assert len(backlog) == MAX_TRACKED_PODS


def test_a_pod_busy_with_one_long_prompt_loses_to_one_busy_with_a_short_one() -> None:
    """Both prefill pods have one request in flight, so `least-request` sees a tie; the
    backlog knows one of them holds a long prompt and sends the next request to the other."""
    config = parse_scheduler_config({"profiles": {"prefill": {"unit": "ttft", "scorers": [
        {"type": "prefill-backlog", "weight": 1.0},
        {"type": "least-request", "weight": 1.0},
    ]}}})
    clock = Clock()
    rt, _ = _runtime(config, clock)
    server = _server({})
    long = rt.scheduler.pick(server, _request(words=6000, seed=1), frozenset())
    assert long is not None and long.prefill is not None
    rt.deps.inflight.acquire(long.prefill)
    short = rt.scheduler.pick(server, _request(words=200, seed=2), frozenset())
    assert short is not None and short.prefill is not None
    assert short.prefill.key != long.prefill.key  # the idle pod
    rt.deps.inflight.acquire(short.prefill)
    for seed in range(3, 8):
        nxt = rt.scheduler.pick(server, _request(words=500, seed=seed), frozenset())
        assert nxt is not None and nxt.prefill is not None
        assert nxt.prefill.key == short.prefill.key
    # The long prefill reports it finished (far sooner than predicted): its pod's backlog
    # drops to what was sent after it, here nothing: the next request may go there.
    assert long.on_prefill is not None
    clock.now += 0.01
    long.on_prefill(0.01)
    assert rt.deps.backlog.wait_s(long.prefill.key, clock.now) == 0.0
