"""The source's small parts on their own: backoff schedule, pod selector, cross-object
checks, Event rate limits, and watch-line splitting."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from kube_testkit import wait_until
from prometheus_client import CollectorRegistry

from router.resources import ModelRoute, parse_object
from router.sources.kube_backoff import Backoff, BackoffPolicy
from router.sources.kube_checks import route_problems
from router.sources.kube_events import EventLimits, EventRecorder, ObjectRef
from router.sources.kube_informer import _line_batches
from router.sources.kube_metrics import KubeMetrics
from router.sources.kube_selector import MAX_SELECTOR_VALUES, pod_selector

pytestmark = pytest.mark.kubernetes


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_backoff_follows_client_go() -> None:
    clock = FakeClock()
    backoff = Backoff(BackoffPolicy(), random.Random(7), clock)
    delays = []
    for _ in range(9):
        delays.append(backoff.next_delay())
        clock.now += 1
    bases = [0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 30.0, 30.0, 30.0]
    for delay, base in zip(delays, bases, strict=True):
        assert base <= delay <= min(30.0, base * 1.2)
    assert len(set(delays[:6])) == 6
    clock.now += 118  # still within two minutes of the last failure: no reset
    assert backoff.next_delay() == 30.0
    clock.now += 120  # two minutes healthy: start again from 800 ms
    assert 0.8 <= backoff.next_delay() <= 0.96


def test_backoff_jitter_spreads_routers() -> None:
    first = {Backoff(BackoffPolicy(), random.Random(seed)).next_delay() for seed in range(20)}
    assert len(first) == 20 and min(first) >= 0.8 and max(first) <= 0.96


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        ([], None),
        ([{"app": "a"}, {"app": "b"}], "app in (a,b)"),
        ([{"app": "a", "tier": "x"}, {"tier": "y", "app": "a"}], "app in (a)"),
        ([{"app": "a"}, {"tier": "y"}], None),  # no shared key
        ([{"app": "a"}, {}], "app in (a)"),  # empty matchLabels selects nothing
        ([{"app": "a b"}], None),  # not a valid label value: watch everything
        ([{"example.com/app": "v1.2_x"}], "example.com/app in (v1.2_x)"),
    ],
)
def test_pod_selector(labels: list[dict[str, str]], expected: str | None) -> None:
    assert pod_selector(labels) == expected


def test_pod_selector_many_values_uses_exists() -> None:
    labels = [{"app": f"s{i}"} for i in range(MAX_SELECTOR_VALUES + 1)]
    assert pod_selector(labels) == "app"


def _route(name: str, model: str, targets: list[str], created: str) -> ModelRoute:
    raw: dict[str, Any] = {
        "apiVersion": "networking.serving.volcano.sh/v1alpha1",
        "kind": "ModelRoute",
        "metadata": {"name": name, "namespace": "ns", "creationTimestamp": created},
        "spec": {
            "modelName": model,
            "rules": [{"targetModels": [{"modelServerName": t} for t in targets]}],
        },
    }
    route = parse_object(raw)
    assert isinstance(route, ModelRoute)
    return route


def test_route_problems() -> None:
    old = _route("old", "m", ["s"], "2024-01-01T00:00:00Z")
    young = _route("young", "m", ["s", "gone"], "2025-01-01T00:00:00Z")
    problems = route_problems([young, old], {("ns", "s")})
    assert sorted((p.route.meta.name, p.code) for p in problems) == [
        ("young", "DuplicateModelName"),
        ("young", "MissingModelServer"),
    ]
    assert "default" not in problems[0].message and "gone" in " ".join(
        p.message for p in problems
    )
    assert route_problems([old], {("other-ns", "s")})[0].code == "MissingModelServer"


async def test_event_recorder_limits() -> None:
    clock = FakeClock()
    registry = CollectorRegistry()
    recorder = EventRecorder(
        KubeMetrics(registry),
        EventLimits(queue_size=3, per_object_interval_s=60, burst=3, per_second=1.0),
        clock,
    )
    ref = ObjectRef("ModelRoute", "g/v1", "ns", "r", "uid-1", "7")
    assert recorder.record(ref, "InvalidSpec", "x" * 5000)
    assert not recorder.record(ref, "InvalidSpec", "again")  # same object, same reason
    assert recorder.record(ref, "MissingModelServer", "other reason")
    assert recorder.record(ObjectRef("ModelRoute", "g/v1", "ns", "r2"), "InvalidSpec", "m")
    assert not recorder.record(ObjectRef("ModelRoute", "g/v1", "ns", "r3"), "InvalidSpec", "m")
    clock.now += 5  # tokens refill, but the queue (3) is full
    assert not recorder.record(ObjectRef("ModelRoute", "g/v1", "ns", "r4"), "InvalidSpec", "m")
    assert registry.get_sample_value("pdgate_kubernetes_events_total",
                                     {"result": "dropped"}) == 1
    posted: list[tuple[str, dict[str, Any]]] = []
    failures = 0

    async def post(namespace: str, body: dict[str, Any]) -> None:
        nonlocal failures
        if body["involvedObject"]["name"] == "r2":
            failures += 1
            raise RuntimeError("forbidden")
        posted.append((namespace, body))

    task = asyncio.create_task(recorder.run(post))
    await wait_until(lambda: len(posted) + failures == 3)
    task.cancel()
    namespace, body = posted[0]
    assert namespace == "ns" and len(body["message"]) == 1024
    assert body["involvedObject"] == {
        "apiVersion": "g/v1", "kind": "ModelRoute", "namespace": "ns", "name": "r",
        "uid": "uid-1", "resourceVersion": "7",
    }
    assert body["metadata"]["name"].startswith("r.") and body["type"] == "Warning"
    assert registry.get_sample_value("pdgate_kubernetes_events_total",
                                     {"result": "failed"}) == 1
    clock.now += 61  # the interval passed: the same complaint may be posted again
    assert recorder.record(ref, "InvalidSpec", "still broken")


class _Chunks:
    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = chunks

    async def iter_any(self) -> Any:
        for chunk in self._chunks:
            yield chunk


async def test_line_batches_split_and_join_chunks() -> None:
    stream = _Chunks([b'{"a":1}\n{"b"', b":2}\n\n", b'{"c":3}\n{"d":4}\n', b'{"tail":5}'])
    batches = [batch async for batch in _line_batches(stream)]  # type: ignore[arg-type]
    assert batches == [[b'{"a":1}'], [b'{"b":2}'], [b'{"c":3}', b'{"d":4}'], [b'{"tail":5}']]
