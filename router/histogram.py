"""A labelled histogram for the event loop's hot path: one bisect and two additions.

prometheus-client's `Histogram` takes a lock for the sum and one for the bucket on every
observation (1-2.5 µs each time, see ENGINEERING.md); the relay observes the inter-token
latency once per streamed chunk and the request path about ten times per request. The
router's data path runs on one event loop, so plain integers do: `LoopHistogram` keeps
per-bucket counts and a sum per label value (`router.tally.BucketCounts`), and exports
them through a custom collector in the same exposition (`_bucket{le=...}`, `_count`,
`_sum`) as a `Histogram` would.
Observe only from the loop's thread; a scrape from it sees a consistent snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from router.tally import BucketCounts


class LoopHistogram:
    """A histogram with one label; `labels(value)` returns (and keeps) that value's child.

    The callers bound the label values (fixed phase names, or model names a route serves:
    `retain` drops those no route serves any more).
    """

    def __init__(self, name: str, documentation: str, label: str, buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        self._name = name
        self._documentation = documentation
        self._label = label
        self._bounds = tuple(float(b) for b in buckets)
        if list(self._bounds) != sorted(set(self._bounds)):
            raise ValueError("buckets must be strictly increasing")
        self._le = [str(floatToGoString(b)) for b in self._bounds]  # type: ignore[no-untyped-call]
        self._children: dict[str, BucketCounts] = {}
        registry.register(self)

    def labels(self, value: str) -> BucketCounts:
        child = self._children.get(value)
        if child is None:
            child = self._children[value] = BucketCounts(self._bounds)
        return child

    def retain(self, keep: Callable[[str], bool]) -> None:
        """Drop the children whose label value `keep` refuses (a model no route serves)."""
        for value in [value for value in self._children if not keep(value)]:
            del self._children[value]

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self._name, self._documentation, labels=[self._label])]

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=[self._label])
        for value, child in list(self._children.items()):
            buckets = []
            total = 0
            for le, count in zip(self._le, child.counts, strict=False):
                total += count
                buckets.append((le, float(total)))
            buckets.append(("+Inf", float(total + child.counts[-1])))
            family.add_metric([value], buckets, child.sum)
        yield family
