"""Percentiles and per-run summaries of client-side measurements."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from benchmarks.specs import RequestResult


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation, as numpy's default; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float | None:
    return percentile(values, 50.0)


@dataclass(frozen=True, slots=True)
class Summary:
    requests: int
    ok: int
    errors: dict[str, int]
    wall: float
    throughput: float  # successful requests per second of wall time
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    e2e_p50: float | None
    e2e_p90: float | None
    e2e_p99: float | None
    itl_p50: float | None
    itl_p99: float | None

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def summarize(results: Iterable[RequestResult], wall: float) -> Summary:
    items = list(results)
    good = [r for r in items if r.ok]
    ttft = [r.ttft for r in good if r.ttft is not None]
    e2e = [r.e2e for r in good]
    itl = [gap for r in good for gap in r.itl]
    errors = Counter(r.error for r in items if r.error is not None)
    return Summary(
        requests=len(items),
        ok=len(good),
        errors=dict(sorted(errors.items())),
        wall=wall,
        throughput=len(good) / wall if wall > 0 else 0.0,
        ttft_p50=percentile(ttft, 50),
        ttft_p90=percentile(ttft, 90),
        ttft_p99=percentile(ttft, 99),
        e2e_p50=percentile(e2e, 50),
        e2e_p90=percentile(e2e, 90),
        e2e_p99=percentile(e2e, 99),
        itl_p50=percentile(itl, 50),
        itl_p99=percentile(itl, 99),
    )


def minus(a: float | None, b: float | None) -> float | None:
    """a - b, or None when either is missing."""
    return None if a is None or b is None else a - b


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or not positive (a ratio of a negative added
    latency, i.e. noise below the floor, means nothing)."""
    if a is None or b is None or a <= 0 or b <= 0:
        return None
    return a / b
