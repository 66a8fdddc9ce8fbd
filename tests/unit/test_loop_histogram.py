"""`LoopHistogram` exposes exactly what prometheus-client's `Histogram` would."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from router.histogram import LoopHistogram
from router.metrics import ITL_BUCKETS


def _exposition(registry: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines()
            if "_created" not in line]  # the reference adds creation timestamps


def test_same_exposition_as_a_prometheus_histogram() -> None:
    reference, ours = CollectorRegistry(), CollectorRegistry()
    expected = Histogram("pdgate_x_seconds", "Doc.", ["model"], buckets=ITL_BUCKETS,
                         registry=reference)
    actual = LoopHistogram("pdgate_x_seconds", "Doc.", "model", ITL_BUCKETS, registry=ours)
    rng = random.Random(7)
    values = [*ITL_BUCKETS, 0.0, 1e3, *(rng.uniform(0, 100) for _ in range(500))]
    for value in values:
        model = rng.choice(["a", "b/c"])
        expected.labels(model).observe(value)
        actual.labels(model).observe(value)
    assert _exposition(ours) == _exposition(reference)


def test_buckets_must_increase() -> None:
    with pytest.raises(ValueError):
        LoopHistogram("x", "x", "model", (0.1, 0.1), registry=CollectorRegistry())
