"""Running totals the event loop keeps without a lock: a counter and a histogram's counts.

prometheus-client's `Counter` and `Histogram` take a lock on every observation (1-2.5 µs,
see ENGINEERING.md); the data path observes several per request and the relay one per
streamed chunk. The router updates these from its event loop's thread only, so plain
numbers do, and a collector (`router.histogram`, `router.scheduling.metrics`) exports
them in the usual exposition. Compiled with mypyc (router/build.py): the scheduler's
compiled code then updates them with a C call, not an interpreted method.
"""

from __future__ import annotations

from bisect import bisect_left


class Tally:
    """One counter's value."""

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class BucketCounts:
    """One histogram child: `counts[i]` observations in bucket i (the last: +Inf) and
    their sum. `bounds`: the buckets' upper bounds, strictly increasing."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: the first bound >= value, i.e. Prometheus' `le` bucket.
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
