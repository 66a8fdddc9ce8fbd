"""`router.sync` without sockets: frames between two nodes (counts, routes, ejections, new
prompts placed by the leader), expiry, parsing, worker counts."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from router.load import InFlight
from router.resilience.config import ResilienceConfig
from router.resilience.ejection import OutlierDetector
from router.scheduling.approx_index import ApproximatePrefixIndex
from router.scheduling.backlog import PrefillBacklog
from router.scheduling.inflight_prefixes import EVENT_GRACE_S, InFlightPrefixes
from router.scheduling.metrics import SchedulerMetrics
from router.scheduling.metrics_scraper import EngineLoad, EngineMetricsStore, MetricsScraper
from router.sync import SyncConfig, SyncNode
from router.sync import messages as m
from router.sync.exposition import merge
from router.sync.local import MAX_FRAME_BYTES, LocalChannel
from router.sync.peers import parse_peers, slice_addresses
from router.sync.workers import available_cpus, cgroup_cpus, parse_workers
from router.view import ClusterView, Endpoint


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def _endpoint(name: str) -> Endpoint:
    return Endpoint(namespace="default", pod_name=name, ip="127.0.0.1", port=8000,
                    role="decode", group="g0")


class Node:
    """A SyncNode with its own router state, frames captured instead of sent."""

    def __init__(self, worker: int, clock: Clock) -> None:
        self.registry = registry = CollectorRegistry()
        self.inflight = InFlight(registry)
        self.backlog = PrefillBacklog()
        self.outliers = OutlierDetector(ResilienceConfig(), clock=clock)
        self.approx = ApproximatePrefixIndex()
        self.prefilling = InFlightPrefixes()
        self.engines = EngineMetricsStore()
        scraper = MetricsScraper(self.engines, SchedulerMetrics(registry))
        self.node = SyncNode(
            SyncConfig(host_id="h", worker=worker, workers=2), inflight=self.inflight,
            backlog=self.backlog,
            outliers=self.outliers, approx=self.approx, engines=self.engines,
            scraper=scraper, view=ClusterView(), registry=registry, clock=clock,
            prefilling=self.prefilling,
        )
        self.node._endpoints = {e.key: e for e in (POD_A, POD_B)}
        self.frames: list[bytes] = []
        self.node._send_frame = (  # type: ignore[method-assign]
            lambda frame, count, host_only, urgent: self.frames.append(frame)
        )

    def deliver_to(self, other: Node) -> None:
        self.node.flush()
        for frame in self.frames:
            other.node.apply(frame)
        self.frames.clear()


POD_A, POD_B = _endpoint("a"), _endpoint("b")


@pytest.fixture
def pair() -> tuple[Node, Node, Clock]:
    clock = Clock()
    return Node(0, clock), Node(1, clock), clock


def test_inflight_counts_are_the_sum_of_every_process(pair: tuple[Node, Node, Clock]) -> None:
    one, two, _ = pair
    one.inflight.acquire(POD_A)
    one.inflight.acquire(POD_A)
    two.inflight.acquire(POD_A)
    one.deliver_to(two)
    two.deliver_to(one)
    assert one.inflight.get(POD_A) == two.inflight.get(POD_A) == 3
    one.inflight.release(POD_A)
    one.inflight.release(POD_A)
    one.deliver_to(two)
    assert two.inflight.get(POD_A) == 1 and one.inflight.get(POD_A) == 1


async def test_a_pod_turning_busy_reaches_the_peer_at_the_next_turn(
    pair: tuple[Node, Node, Clock],
) -> None:
    """Other count changes wait for the flush window; the one that makes a pod stop
    looking idle does not (the others' next pick would go there)."""
    one, two, _ = pair
    one.node._loop = asyncio.get_running_loop()
    # The window closes only where the test says so, however slow the machine is.
    one.node.config = replace(one.node.config, flush_interval_s=3600.0)

    async def next_turn() -> None:
        await asyncio.sleep(0)
        for frame in one.frames:
            two.node.apply(frame)
        one.frames.clear()

    one.inflight.acquire(POD_A)
    await next_turn()
    assert two.inflight.get(POD_A) == 1
    one.inflight.acquire(POD_A)
    one.inflight.acquire(POD_B)
    one.inflight.release(POD_A)
    await next_turn()  # B turned busy: its count goes, with what else is queued
    assert two.inflight.get(POD_B) == 1 and two.inflight.get(POD_A) == 1
    one.inflight.acquire(POD_A)
    one.inflight.release(POD_B)
    await next_turn()  # 1 -> 2 and 1 -> 0: within the window
    assert two.inflight.get(POD_A) == 1 and two.inflight.get(POD_B) == 1
    one.node.flush()  # the window closes
    await next_turn()
    assert two.inflight.get(POD_A) == 2 and two.inflight.get(POD_B) == 0
    one.inflight.acquire(POD_B)  # idle again, then busy: at once
    await next_turn()
    assert two.inflight.get(POD_B) == 1


async def test_a_pick_sends_what_waits_for_the_window(pair: tuple[Node, Node, Clock]) -> None:
    """A count that need not go at once waits for `flush_interval_s`, unless this process
    picks first: then it goes with the pick's own changes, in one frame (no wake-up of
    its own for it, and no frame of its own)."""
    one, two, _ = pair
    one.node._loop = asyncio.get_running_loop()
    one.node.config = replace(one.node.config, flush_interval_s=3600.0)
    one.inflight.acquire(POD_A)
    await asyncio.sleep(0)  # turning busy: sent at the next turn
    one.deliver_to(two)
    assert two.inflight.get(POD_A) == 1
    one.inflight.release(POD_A)  # falling: waits for the window
    await asyncio.sleep(0)
    assert not one.frames
    one.node.catch_up()  # as the scheduler does before a pick
    one.approx.record(POD_B.key, [7, 8])  # the pick: a routed prompt...
    one.inflight.acquire(POD_B)  # ...counted on its pod
    await asyncio.sleep(0)
    assert len(one.frames) == 1
    one.deliver_to(two)
    assert two.inflight.get(POD_A) == 0 and two.inflight.get(POD_B) == 1
    assert two.approx.match([POD_B.key], [7, 8]) == [2]


def test_prefill_backlogs_are_the_sum_of_every_process(pair: tuple[Node, Node, Clock]) -> None:
    """Each process reports the prefill seconds it sent to a pod and predicts are not done;
    a peer's part runs down with the clock, follows the sender's corrections, and stops
    weighing when the sender is lost."""
    one, two, clock = pair
    key = POD_A.key
    ticket = one.backlog.dispatch(key, 0.5, clock.now, idle=True)
    one.inflight.acquire(POD_A)
    one.deliver_to(two)
    assert two.backlog.wait_s(key, clock.now) == pytest.approx(0.5)
    assert two.backlog.own_wait_s(key, clock.now) == 0.0  # not reported back as its own
    two.backlog.dispatch(key, 0.25, clock.now, idle=False)
    two.deliver_to(one)
    assert one.backlog.wait_s(key, clock.now) == pytest.approx(0.75)
    clock.now += 0.1
    assert two.backlog.wait_s(key, clock.now) == pytest.approx(0.4 + 0.15)
    # One's prefill ended at once, far sooner than predicted: the peer hears its part is 0.
    one.backlog.finished(key, ticket, clock.now)
    one.inflight.release(POD_A)
    one.deliver_to(two)
    assert two.backlog.wait_s(key, clock.now) == pytest.approx(0.15)
    # A lost sender's backlog stops weighing at once.
    one.backlog.dispatch(key, 5.0, clock.now, idle=True)
    one.deliver_to(two)
    assert two.backlog.wait_s(key, clock.now) == pytest.approx(5.15)
    clock.now += two.node.config.ttl_s + 0.01
    two.node.expire()
    assert two.backlog.wait_s(key, clock.now) == 0.0


def test_a_lost_message_is_repaired_by_the_heartbeat(pair: tuple[Node, Node, Clock]) -> None:
    one, two, _ = pair
    one.node.heartbeat()
    one.deliver_to(two)
    one.inflight.acquire(POD_B)
    one.node.flush()
    one.frames.clear()  # the transport lost it
    one.node.heartbeat()
    one.deliver_to(two)
    assert two.inflight.get(POD_B) == 1
    assert two.node.metrics.messages.labels(direction="dropped")._value.get() == 1


def test_a_lost_backlog_is_repaired_by_the_heartbeat(pair: tuple[Node, Node, Clock]) -> None:
    one, two, clock = pair
    key = POD_A.key
    one.node.heartbeat()
    one.deliver_to(two)
    ticket = one.backlog.dispatch(key, 0.5, clock.now, idle=True)
    one.inflight.acquire(POD_A)
    one.node.flush()
    one.frames.clear()  # the transport lost the dispatch's report
    one.node.heartbeat()
    one.deliver_to(two)
    assert two.backlog.wait_s(key, clock.now) == pytest.approx(0.5)
    clock.now += 0.1
    one.backlog.finished(key, ticket, clock.now)  # done early
    one.node.flush()
    one.frames.clear()  # lost again
    assert two.backlog.wait_s(key, clock.now) == pytest.approx(0.4)
    one.node.heartbeat()  # the pod is still counted, with no backlog left
    one.deliver_to(two)
    assert two.backlog.wait_s(key, clock.now) == 0.0
    old_heartbeat = m.encode("h.0", "h", 99, [(m.HEARTBEAT, {key: 1})])  # an older router
    two.node.apply(old_heartbeat)
    assert two.inflight.get(POD_A) == 1


def test_a_silent_peer_expires_after_the_ttl(pair: tuple[Node, Node, Clock]) -> None:
    one, two, clock = pair
    one.inflight.acquire(POD_A)
    one.deliver_to(two)
    assert two.inflight.get(POD_A) == 1 and two.node.peers() == {"h.0": True}
    clock.now += two.node.config.ttl_s / 2
    two.node.expire()
    assert two.inflight.get(POD_A) == 1
    clock.now += two.node.config.ttl_s
    two.node.expire()
    assert two.inflight.get(POD_A) == 0 and two.node.peers() == {"h.0": False}
    one.node.heartbeat()
    one.deliver_to(two)  # back: its report counts again
    assert two.inflight.get(POD_A) == 1 and two.node.peers() == {"h.0": True}


def _seen_series(node: Node) -> dict[str, float]:
    families = text_string_to_metric_families(generate_latest(node.registry).decode())
    return {sample.labels["pod"]: sample.value for family in families
            if family.name == "pdgate_sync_seen_inflight_requests"
            for sample in family.samples}


def test_a_pod_that_left_the_view_leaves_the_seen_counts(pair: tuple[Node, Node, Clock]) -> None:
    one, two, _ = pair
    one.inflight.acquire(POD_A)
    one.inflight.acquire(POD_B)
    one.deliver_to(two)
    two.node.expire()
    assert _seen_series(two) == {POD_A.key: 1, POD_B.key: 1}
    one.inflight.release(POD_A)
    one.inflight.release(POD_B)
    one.deliver_to(two)
    two.node._endpoints = {POD_A.key: POD_A}  # b is gone from the view
    two.node.expire()
    assert _seen_series(two) == {POD_A.key: 0}  # a pod of the view at 0; b's series gone


def test_a_pod_back_in_the_view_gets_its_engine_capacity_again(
    pair: tuple[Node, Node, Clock],
) -> None:
    one, two, clock = pair  # one is worker 0: it scrapes the engines for the host
    load = EngineLoad(running=0, waiting=0, kv_usage=0.1, capacity_tokens=50_000, at=clock.now)
    one.node._on_engine(POD_A.key, load)
    one.deliver_to(two)
    assert two.approx.reported_tokens(POD_A.key) == 50_000
    two.approx.retain([POD_B.key])  # a left the view (the scheduler keeps the view's pods)
    assert two.approx.reported_tokens(POD_A.key) is None
    one.node._on_engine(POD_A.key, load)  # back, with the same capacity
    one.deliver_to(two)
    assert two.approx.reported_tokens(POD_A.key) == 50_000


def test_routes_and_ejections_reach_the_peer(pair: tuple[Node, Node, Clock]) -> None:
    one, two, _ = pair
    hashes = [11, 22, 33]
    one.approx.record(POD_A.key, hashes)
    one.outliers.eject(POD_B, "passive")
    one.deliver_to(two)
    assert two.approx.match([POD_A.key, POD_B.key], hashes) == [3, 0]
    assert two.outliers.is_ejected(POD_B.key)
    assert not two.frames  # applying is not re-publishing
    one.outliers.probe_result(POD_B, ok=True)
    one.deliver_to(two)
    assert not two.outliers.is_ejected(POD_B.key)


def test_a_prompt_prefilling_for_the_precise_index_reaches_the_peer(
    pair: tuple[Node, Node, Clock],
) -> None:
    """The precise index's record of a prompt on its way into a pod's cache (until the
    engine's KV events) holds in the other process too, for as long as in the sender: a
    sibling's next prompt of the group sees the prefix on that pod, not only its load."""
    one, two, clock = pair
    keys = [POD_A.key, POD_B.key]
    one.prefilling.record(POD_B.key, [5, 6, 7], ready_at=clock.now + 0.5, now=clock.now)
    one.deliver_to(two)
    assert two.prefilling.depths(keys, [5, 6, 9], clock.now) == [0, 2]
    assert not two.frames  # applying is not re-publishing
    lapse = clock.now + 0.5 + EVENT_GRACE_S
    assert one.prefilling.depths(keys, [5, 6], lapse - 0.01) == [0, 2]
    assert two.prefilling.depths(keys, [5, 6], lapse - 0.01) == [0, 2]
    assert two.prefilling.depths(keys, [5, 6], lapse + 0.01) is None
    # A pod the receiver does not serve is not recorded.
    one.prefilling.record("default/elsewhere", [8], ready_at=clock.now, now=clock.now)
    one.deliver_to(two)
    assert two.prefilling.depths(["default/elsewhere"], [8], clock.now) is None


def _know_each_other(one: Node, two: Node) -> None:
    for a, b in ((one, two), (two, one)):
        a.node.heartbeat()
        a.deliver_to(b)


def _placements(node: Node, outcome: str) -> float | None:
    return node.registry.get_sample_value("pdgate_sync_placements_total", {"outcome": outcome})


CHAT_BODY = {"model": "m", "messages": [{"role": "system", "content": "Tenant 7."}]}


async def test_the_leader_places_a_new_prompt_for_the_other_process(
    pair: tuple[Node, Node, Clock],
) -> None:
    """Where a new prompt starts is one process's decision (the lowest live origin): the
    other asks it, gets the pods it chose, and is counted on them at once."""
    one, two, _ = pair
    for node in (one, two):
        node.node._loop = asyncio.get_running_loop()  # as `run` sets it
    _know_each_other(one, two)
    assert one.node.leader() == two.node.leader() == one.node.origin
    asked: list[tuple[str, str, str]] = []

    def placer(asker: str, server: str, model: str, path: str, flow: str,
               body: Any) -> tuple[str, ...]:
        asked.append((asker, server, body["messages"][0]["content"]))
        one.inflight.add_remote(asker, POD_A.key)
        return (POD_A.key,)

    one.node.placer = placer
    answer = asyncio.create_task(two.node.place("default/pd", "m", "/v1/chat/completions",
                                                "pd", CHAT_BODY))
    await asyncio.sleep(0)
    assert len(two.frames) == 1  # asked at once, not at the loop's next turn
    two.deliver_to(one)
    assert len(one.frames) == 1  # answered at once
    one.deliver_to(two)
    assert await answer == (POD_A.key,)
    assert asked == [(two.node.origin, "default/pd", "Tenant 7.")]
    assert one.inflight.get(POD_A) == 1  # the asker's request, before it reports it
    two.inflight.acquire(POD_A)
    two.deliver_to(one)
    assert one.inflight.get(POD_A) == 1  # its report replaced the provisional count
    assert await one.node.place("default/pd", "m", "/v1/chat/completions", "pd",
                                CHAT_BODY) is None  # the leader places its own
    assert _placements(two, "answered") == 1 and _placements(one, "served") == 1


async def test_a_placement_that_fails_at_the_leader_is_answered_with_no_pods(
    pair: tuple[Node, Node, Clock],
) -> None:
    one, two, _ = pair
    for node in (one, two):
        node.node._loop = asyncio.get_running_loop()
    _know_each_other(one, two)

    def placer(*_: Any) -> tuple[str, ...]:
        raise RuntimeError("no view yet")

    one.node.placer = placer
    answer = asyncio.create_task(two.node.place("default/pd", "m", "/v1/chat/completions",
                                                "pd", CHAT_BODY))
    await asyncio.sleep(0)
    two.deliver_to(one)
    one.deliver_to(two)
    assert await answer is None  # at once, not after the timeout: the asker places it
    assert _placements(two, "none") == 1 and _placements(two, "timeout") == 0


async def test_a_leader_that_does_not_answer_leaves_the_prompt_to_the_asker(
    pair: tuple[Node, Node, Clock],
) -> None:
    one, two, _ = pair
    two.node._loop = asyncio.get_running_loop()
    _know_each_other(one, two)
    started = time.monotonic()
    assert await two.node.place("default/pd", "m", "/v1/chat/completions", "pd",
                                CHAT_BODY) is None  # nothing delivered: no answer
    assert time.monotonic() - started >= two.node.config.place_timeout_s
    assert _placements(two, "timeout") == 1
    huge = {"messages": [{"role": "user", "content": "x" * MAX_FRAME_BYTES}]}
    two.frames.clear()
    assert await two.node.place("default/pd", "m", "/v1/chat/completions", "pd", huge) is None
    assert two.frames == []  # too large for one frame: placed where it arrived, unasked


def test_a_batch_too_large_for_one_frame_goes_as_several(
    pair: tuple[Node, Node, Clock],
) -> None:
    one, two, _ = pair
    routes = [[(r << 32) + i for i in range(1000)] for r in range(12)]  # ~110 KB of hashes
    for r, hashes in enumerate(routes):
        one.approx.record((POD_A, POD_B)[r % 2].key, hashes)
    one.node.flush()
    assert len(one.frames) > 1 and all(len(f) <= MAX_FRAME_BYTES for f in one.frames)
    assert [m.decode(f)[2] for f in one.frames] == list(range(1, len(one.frames) + 1))
    one.deliver_to(two)
    for r, hashes in enumerate(routes):
        assert two.approx.match([POD_A.key, POD_B.key], hashes) == [[1000, 0], [0, 1000]][r % 2]
    dropped = two.registry.get_sample_value("pdgate_sync_messages_total",
                                            {"direction": "dropped"})
    assert dropped == 0  # consecutive sequence numbers: no gap seen


def test_a_heartbeat_over_many_pods_still_reaches_the_peer(
    pair: tuple[Node, Node, Clock],
) -> None:
    """A process with requests on 2,000 pods: its heartbeat, too large for one frame as
    one message, goes as several and the peer sees every count (it was dropped every
    time, so a lost count was never repaired)."""
    one, two, _ = pair
    pods = [_endpoint(f"deepseek-v3-pd-{i}-decode-7f9c8b6d5-x2k4q") for i in range(2000)]
    for pod in pods:
        one.inflight.acquire(pod)
    one.node.flush()
    one.frames.clear()  # the counts' own messages lost: only the heartbeat can tell
    one.node.heartbeat()
    one.deliver_to(two)
    assert all(two.inflight.get(pod) == 1 for pod in pods)
    for pod in pods[:1000]:
        one.inflight.release(pod)
    one.node.flush()
    one.frames.clear()  # lost again
    one.node.heartbeat()
    one.deliver_to(two)
    assert sum(two.inflight.get(pod) for pod in pods) == 1000
    assert not one.registry.get_sample_value(
        "pdgate_sync_messages_total", {"direction": "dropped"})


def test_a_restarted_origin_starts_from_nothing(pair: tuple[Node, Node, Clock]) -> None:
    one, two, clock = pair
    one.inflight.acquire(POD_A)
    one.deliver_to(two)
    fresh = Node(0, clock)  # same origin, sequence from 1 again
    fresh.node.heartbeat()
    fresh.deliver_to(two)
    assert two.inflight.get(POD_A) == 0


def test_a_frame_received_twice_is_applied_once(pair: tuple[Node, Node, Clock]) -> None:
    """Two paths to one peer (its address twice in the peer list) bring each frame twice:
    the second is not taken for the origin's restart (which dropped all its counts)."""
    one, two, _ = pair
    one.inflight.acquire(POD_A)
    one.inflight.acquire(POD_A)
    one.inflight.acquire(POD_B)
    one.node.heartbeat()
    sent: list[bytes] = []
    for _ in range(2):  # a heartbeat, then a frame with only B's change, each twice
        one.node.flush()
        for frame in one.frames:
            two.node.apply(frame)
            two.node.apply(frame)
        sent += one.frames
        one.frames.clear()
        one.inflight.release(POD_B)
    two.node.apply(sent[0])  # and the first once more, late: the slower path's copy
    assert two.inflight.get(POD_A) == 2 and two.inflight.get(POD_B) == 0
    assert two.registry.get_sample_value(
        "pdgate_sync_messages_total", {"direction": "duplicate"}) == len(sent) + 1


def test_a_placement_from_a_peer_received_twice_is_applied_once(
    pair: tuple[Node, Node, Clock],
) -> None:
    """Unsequenced frames from peer replicas (placements) that come by two paths are
    recognised too (the leader placed the prompt twice)."""
    _, two, _ = pair
    first = m.encode("p.0", "p", 1, [[m.INFLIGHT, POD_A.key, 1]])
    assert two.node.apply(first, from_peers=True)
    frame = m.encode("p.0", "p", 0, [[m.INFLIGHT, POD_B.key, 2]])  # unsequenced
    assert two.node.apply(frame, from_peers=True)
    assert not two.node.apply(frame, from_peers=True)
    assert two.registry.get_sample_value(
        "pdgate_sync_messages_total", {"direction": "duplicate"}) == 1


def test_a_message_of_an_unknown_shape_is_dropped_and_the_rest_applied(
    pair: tuple[Node, Node, Clock],
) -> None:
    """A peer of another version sends a message this one cannot read: it is counted and
    dropped, the frame's other messages apply (the exception ended the sync task)."""
    _, two, _ = pair
    frame = m.encode("p.0", "p", 1, [[m.INFLIGHT, "default/a"], [m.HEARTBEAT, ["x"]],
                                     [m.INFLIGHT, POD_B.key, 3]])
    assert two.node.apply(frame, from_peers=True)
    assert two.inflight.get(POD_B) == 3
    assert two.registry.get_sample_value(
        "pdgate_sync_messages_total", {"direction": "dropped"}) == 2
    assert two.registry.get_sample_value(
        "pdgate_sync_messages_total", {"direction": "received"}) == 1


def test_frames_that_are_not_ours_are_counted_and_ignored(pair: tuple[Node, Node, Clock]) -> None:
    _, two, _ = pair
    assert not two.node.apply(b"\x00garbage")
    assert not two.node.apply(m.encode("h.1", "h", 1, []))  # its own


def test_parse_peers_and_slices() -> None:
    assert parse_peers("a:1, [::1]:2,") == ("a:1", "::1:2")
    with pytest.raises(ValueError):
        parse_peers("nohost")
    slices = [{"ports": [{"name": "sync", "port": 9000}], "endpoints": [
        {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
        {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
        {"addresses": ["10.0.0.3"]},
    ]}]
    assert slice_addresses(slices, 8090, skip="10.0.0.3") == {"10.0.0.1:9000"}
    # A dual-stack Service: a slice per address family, each naming every pod; only this
    # pod's family is read (both made two connections to each peer, one to itself).
    dual = [
        {"addressType": family, "ports": [{"name": "sync", "port": 8090}],
         "endpoints": [{"addresses": [a]}, {"addresses": [b]}]}
        for family, a, b in (("IPv4", "10.0.0.2", "10.0.0.3"), ("IPv6", "fd00::2", "fd00::3"))
    ]
    assert slice_addresses(dual, 8090, skip="10.0.0.2") == {"10.0.0.3:8090"}
    assert slice_addresses(dual, 8090, skip="fd00::2") == {"fd00::3:8090"}
    assert len(slice_addresses(dual, 8090, skip=None)) == 4  # this pod's family unknown


async def test_discovery_without_a_kubernetes_client_keeps_the_static_peers_and_retries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No client can be made (no service-account token, a bad kubeconfig): discovery
    keeps the static peers and tries again, instead of ending the sync task with it."""
    import zmq

    from router.sources import kube_api
    from router.sync.peers import PeerDiscovery

    attempts: list[str | None] = []

    async def no_client(kubeconfig: str | None) -> object:
        attempts.append(kubeconfig)
        raise RuntimeError("no service-account token")

    monkeypatch.setattr(kube_api, "make_api_client", no_client)
    monkeypatch.setattr(kube_api, "default_namespace", lambda kubeconfig: "default")
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    try:
        config = SyncConfig(host_id="h", sync_port=18099, peers=("127.0.0.1:18098",),
                            peer_service="pdgate-peers", discovery_interval_s=0.01)
        discovery = PeerDiscovery(config, sub)
        task = asyncio.create_task(discovery.run())
        await asyncio.sleep(0.1)
        assert not task.done()  # still trying
        assert len(attempts) >= 2
        assert discovery.connected == {"127.0.0.1:18098"}
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        sub.close(0)
        context.term()


async def test_a_sync_task_that_fails_is_started_again() -> None:
    """The state sync's task is kept running: a failure is logged and it starts again
    (it ended for good, leaving peers live and their counts on the pods)."""
    from router.supervise import kept_running

    runs: list[int] = []

    async def run() -> None:
        runs.append(len(runs))
        if len(runs) < 3:
            raise RuntimeError("discovery failed")

    await asyncio.wait_for(kept_running("state sync", run, delay_s=0.001), 5)
    assert runs == [0, 1, 2]


def test_worker_counts(tmp_path: Path) -> None:
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("150000 100000\n")
    assert cgroup_cpus(cpu_max) == 1.5
    assert available_cpus(cpu_max) == min(2, available_cpus(tmp_path / "none"))
    cpu_max.write_text("max 100000\n")
    assert cgroup_cpus(cpu_max) is None
    assert parse_workers("3") == 3 and parse_workers("auto") >= 1
    for bad in ("0", "x", "1000"):
        with pytest.raises(ValueError):
            parse_workers(bad)


def _exposition(served: float) -> str:
    registry = CollectorRegistry()
    requests = Counter("pdgate_requests", "Requests.", ["status"], registry=registry)
    requests.labels(status="200").inc(served)
    Gauge("pdgate_ready", "Ready.", registry=registry).set(1)
    Histogram("pdgate_ttft_seconds", "TTFT.", buckets=(0.1,), registry=registry).observe(0.05)
    return generate_latest(registry).decode()


def test_merged_exposition_labels_every_sample_with_its_worker() -> None:
    text = merge({0: _exposition(3), 1: _exposition(4)}, missing=1).decode()
    families = {(f.name, f.type): f for f in text_string_to_metric_families(text)}
    requests = families[("pdgate_requests", "counter")]
    by_worker = {s.labels["worker"]: s.value for s in requests.samples
                 if s.name == "pdgate_requests_total"}
    assert by_worker == {"0": 3.0, "1": 4.0}
    assert all(s.labels["status"] == "200" for s in requests.samples)
    ready = families[("pdgate_ready", "gauge")]
    assert [(s.labels, s.value) for s in ready.samples] == [
        ({"worker": "0"}, 1.0), ({"worker": "1"}, 1.0)]
    buckets = [s for s in families[("pdgate_ttft_seconds", "histogram")].samples
               if s.name == "pdgate_ttft_seconds_bucket"]
    assert {(s.labels["worker"], s.labels["le"]) for s in buckets} == {
        ("0", "0.1"), ("0", "+Inf"), ("1", "0.1"), ("1", "+Inf")}
    assert text.count("# TYPE pdgate_requests_total counter") == 1
    workers = {s.labels["state"]: s.value
               for s in families[("pdgate_metrics_workers", "gauge")].samples}
    assert workers == {"answered": 2.0, "missing": 1.0}


class Worker:
    """A SyncNode over the real workers' channel (`run`), with a real clock."""

    def __init__(self, run_dir: Path, worker: int, catch_up_s: float,
                 flush_interval_s: float = 0.005) -> None:
        self.registry = registry = CollectorRegistry()
        self.inflight = InFlight(registry)
        self.approx = ApproximatePrefixIndex()
        engines = EngineMetricsStore()
        self.node = SyncNode(
            SyncConfig(host_id="h", worker=worker, workers=2, run_dir=str(run_dir),
                       catch_up_s=catch_up_s, heartbeat_s=36000.0, ttl_s=72000.0,
                       flush_interval_s=flush_interval_s),
            inflight=self.inflight, backlog=PrefillBacklog(),
            outliers=OutlierDetector(ResilienceConfig()),
            approx=self.approx, engines=engines,
            scraper=MetricsScraper(engines, SchedulerMetrics(registry)), view=ClusterView(),
            registry=registry,
        )
        self.node._endpoints = {e.key: e for e in (POD_A, POD_B)}
        self.task = asyncio.create_task(self.node.run())


async def _turns(count: int) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


async def test_workers_read_state_when_they_pick_and_placements_at_once(
    tmp_path: Path,
) -> None:
    """Over the real sockets: a sibling's counts and routes wait in the state lane until
    this worker catches up (before a pick, or every `catch_up_s`) instead of waking it;
    a new-prompt question wakes the leader, which catches up on the asker's routes
    before it places, and sends what it decided itself before its answer."""
    one, two = (Worker(tmp_path, w, catch_up_s=3600.0, flush_interval_s=3600.0)
                for w in (0, 1))
    try:
        await _turns(5)  # both bound; each caught up once at start
        two.inflight.acquire(POD_A)  # a pod turning busy goes out at the next turn
        await _turns(20)
        assert one.inflight.get(POD_A) == 0  # sent, not read: nothing woke worker 0
        one.node.catch_up()  # as its next pick does
        assert one.inflight.get(POD_A) == 1

        seen: list[list[int]] = []

        def placer(*_: Any) -> tuple[str, ...]:
            seen.append(one.approx.match([POD_B.key], [7, 8]))
            return (POD_B.key,)

        one.node.placer = placer
        _know_each_other_live(one, two)
        one.inflight.acquire(POD_B)
        await _turns(2)
        two.node.catch_up()
        assert two.inflight.get(POD_B) == 1
        one.inflight.release(POD_B)  # falling: waits for the (hour-long) window
        two.approx.record(POD_B.key, [7, 8])  # routed just before the question
        async with asyncio.timeout(5.0):
            pods = await two.node.place("default/pd", "m", "/v1/chat/completions", "pd",
                                        CHAT_BODY)
        assert pods == (POD_B.key,)
        assert seen == [[2]]  # the leader had read the route when it placed
        two.node.catch_up()  # as the pick that follows the answer does
        assert two.inflight.get(POD_B) == 0  # sent before the answer
    finally:
        for worker in (one, two):
            worker.task.cancel()
        await asyncio.gather(one.task, two.task, return_exceptions=True)
    assert not _socket_files(tmp_path)


def _socket_files(run_dir: Path) -> list[Path]:
    return list(run_dir.glob("*.sock"))


def _know_each_other_live(*workers: Worker) -> None:
    for worker in workers:
        worker.node.heartbeat()
        worker.node.flush()
    for worker in workers:
        worker.node.catch_up()


async def test_an_idle_worker_catches_up_by_itself(tmp_path: Path) -> None:
    """Nobody picks on worker 0: it reads its sibling's counts every `catch_up_s` (the
    sleeps below end after the backstop timers due before them, however slow the loop)."""
    one, two = Worker(tmp_path, 0, catch_up_s=0.01), Worker(tmp_path, 1, catch_up_s=0.01)
    try:
        await _turns(5)
        two.inflight.acquire(POD_A)
        await asyncio.sleep(0.05)
        assert one.inflight.get(POD_A) == 1
        two.inflight.release(POD_A)
        two.node.flush()  # a count falling waits for the flush window otherwise
        await asyncio.sleep(0.05)
        assert one.inflight.get(POD_A) == 0
    finally:
        for worker in (one, two):
            worker.task.cancel()
        await asyncio.gather(one.task, two.task, return_exceptions=True)


async def test_an_idle_worker_sleeps_on_its_socket_until_a_frame_comes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nobody picks on worker 0 and nothing arrives: its backstop stops reading the state
    lane after one read finds nothing (a timer every `catch_up_s` read it 50 times a second
    for nothing), and a sibling's frame is then read as it arrives."""
    reads = {0: 0, 1: 0}
    drain = LocalChannel.drain

    def counted(channel: LocalChannel) -> int:
        reads[channel.config.worker] += 1
        return drain(channel)

    monkeypatch.setattr(LocalChannel, "drain", counted)
    one, two = Worker(tmp_path, 0, catch_up_s=0.01), Worker(tmp_path, 1, catch_up_s=0.01)
    try:
        await asyncio.sleep(0.2)  # start-up frames read, the backstop gone quiet
        before = reads[0]
        await asyncio.sleep(0.3)  # thirty catch-up intervals
        assert reads[0] - before <= 1, reads
        two.inflight.acquire(POD_A)  # sent at the next turn
        await _turns(10)  # no timer between: the socket's reader callback read it
        assert one.inflight.get(POD_A) == 1
        await asyncio.sleep(0.2)
        before = reads[0]
        await asyncio.sleep(0.3)
        assert reads[0] - before <= 1, reads  # quiet again
    finally:
        for worker in (one, two):
            worker.task.cancel()
        await asyncio.gather(one.task, two.task, return_exceptions=True)
    assert not _socket_files(tmp_path)
