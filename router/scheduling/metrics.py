"""The scheduler's Prometheus metrics, in the registry the app passes in (no globals).

Label sets are small and fixed (index kind, role, reason): no per-pod labels, so the
exposition stays cheap at hundreds of pods. Labelled children used on the per-request
path are resolved once here.

The four observations every decision makes (its time, its predicted TTFT, the prefix
blocks looked up and hit) are plain numbers exported by a collector (`router.tally`'s
`BucketCounts`, `Tally`): a prometheus-client child takes a lock and a few calls per
observation, 1-2.5 µs, a large share of a ~20 µs decision. The scheduler runs on the
event loop only, so nothing else writes them; an exposition reads each number once.

Everything a decision adds is in one `DecisionCounts`. The exported one belongs to
`SchedulerMetrics`; a pick the leader makes for a peer's request (`router.sync`) is the
peer's decision, counted there, so it goes to a set nobody exports, chosen once per pick.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from itertools import accumulate
from typing import Final, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from router.scheduling.ttft_model import PrefillFit
from router.tally import BucketCounts, Tally

DECISION_BUCKETS: Final = (
    5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2,
)  # fmt: skip
TTFT_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
INDEX_KINDS: Final = ("approximate", "precise")
GUARD_ROLES: Final = ("prefill", "decode", "aggregated")
SLO_OUTCOMES: Final = ("admitted", "rejected", "queued")


class CounterSource(Protocol):
    """Anything with a running total to export as a counter (a `Tally`, or one kept by
    another component)."""

    @property
    def value(self) -> float: ...


class Increment(Protocol):
    """A counter a decision bumps (a `Tally`, or a prometheus-client child)."""

    def inc(self, amount: float = 1.0) -> None: ...


class DecisionCounts:
    """What decisions add to the metrics: their time, their predicted TTFT, the prefix
    blocks looked up and hit, the load guard's overrides and the SLO gate's outcomes.
    Built bare (plain tallies that nothing exports) for the picks that must not count;
    `SchedulerMetrics` builds the exported set with its own guard and SLO children."""

    __slots__ = (
        "decision_aggregated", "decision_pd", "guard", "hits", "predicted_aggregated",
        "predicted_pd", "queries", "slo",
    )

    def __init__(
        self,
        guard: Mapping[str, Increment] | None = None,
        slo: Mapping[str, Increment] | None = None,
    ) -> None:
        self.queries = {kind: Tally() for kind in INDEX_KINDS}
        self.hits = {kind: Tally() for kind in INDEX_KINDS}
        self.decision_pd = BucketCounts(DECISION_BUCKETS)
        self.decision_aggregated = BucketCounts(DECISION_BUCKETS)
        self.predicted_pd = BucketCounts(TTFT_BUCKETS)
        self.predicted_aggregated = BucketCounts(TTFT_BUCKETS)
        self.guard: Mapping[str, Increment] = (
            guard if guard is not None else {role: Tally() for role in GUARD_ROLES}
        )
        self.slo: Mapping[str, Increment] = (
            slo if slo is not None else {outcome: Tally() for outcome in SLO_OUTCOMES}
        )


class _LocalCollector(Collector):
    """Exports `router.tally` children as ordinary Prometheus histograms and counters."""

    def __init__(self) -> None:
        self.histograms: list[tuple[str, str, str, dict[str, BucketCounts]]] = []
        self.counters: list[tuple[str, str, str, Mapping[str, CounterSource]]] = []

    def collect(self) -> Iterator[Metric]:
        for name, doc, label, children in self.histograms:
            family = HistogramMetricFamily(name, doc, labels=[label])
            for value, child in children.items():
                counts = list(accumulate(child.counts))
                edges = [*map(floatToGoString, child.bounds), "+Inf"]
                family.add_metric([value], list(zip(edges, counts, strict=True)), child.sum)
            yield family
        for name, doc, label, counters in self.counters:
            counter = CounterMetricFamily(name, doc, labels=[label])
            for value, c in counters.items():
                counter.add_metric([value], c.value)
            yield counter


class SchedulerMetrics:
    def __init__(
        self, registry: CollectorRegistry, tokenize_cpu: CounterSource | None = None
    ) -> None:
        self.registry = registry
        local = _LocalCollector()
        self.guard_overrides = Counter(
            "pdgate_scheduler_guard_overrides",
            "Picks where the load guard overrode the best-scored (cache-affine) pod.",
            ["role"], registry=registry,
        )
        self.slo_admission = Counter(
            "pdgate_scheduler_slo_admission",
            "TTFT-SLO gate decisions: admitted, rejected (429), queued (waited first).",
            ["outcome"], registry=registry,
        )
        #: What this router's own decisions add (exported).
        self.decisions = decisions = DecisionCounts(
            guard={role: self.guard_overrides.labels(role=role) for role in GUARD_ROLES},
            slo={o: self.slo_admission.labels(outcome=o) for o in SLO_OUTCOMES},
        )
        #: Thread CPU seconds of work done beside the requests' own handling, measured
        #: where it runs: what the precise index costs. `kv_events` is counted on the
        #: event loop (`kv_events.PodEventStream`); `tokenize` is the tokenize threads'
        #: own tally (`offload.TokenizePool.cpu`), read at each exposition.
        self.kv_events_cpu = Tally()
        self.background_cpu: dict[str, CounterSource] = {
            "kv_events": self.kv_events_cpu,
            "tokenize": tokenize_cpu if tokenize_cpu is not None else Tally(),
        }
        local.counters += [
            ("pdgate_prefix_cache_queries",
             "Prompt blocks looked up for the pod each request was sent to (prefill or "
             "aggregated), by index.", "index", decisions.queries),
            ("pdgate_prefix_cache_hits",
             "Prompt blocks the chosen pod held according to the index, by index.",
             "index", decisions.hits),
            ("pdgate_background_cpu_seconds",
             "Thread CPU seconds spent beside request handling: applying KV events to the "
             "precise index (kv_events), tokenizing prompts off the event loop (tokenize).",
             "work", self.background_cpu),
        ]  # fmt: skip
        self.index_blocks = Gauge(
            "pdgate_prefix_index_blocks", "Block entries held by a prefix index.",
            ["index"], registry=registry,
        )
        self.index_memory = Gauge(
            "pdgate_prefix_index_memory_bytes", "Estimated memory of a prefix index.",
            ["index"], registry=registry,
        )
        self.index_evictions = Gauge(
            "pdgate_prefix_index_evictions",
            "Entries a prefix index dropped to stay within its bounds (since start).",
            ["index"], registry=registry,
        )
        local.histograms += [
            ("pdgate_scheduler_decision_seconds",
             "Time the scheduler took to pick the pods of one request.", "kind",
             {"pd": decisions.decision_pd, "aggregated": decisions.decision_aggregated}),
            ("pdgate_scheduler_predicted_ttft_seconds",
             "Predicted time to first token of the chosen pods (ttft-unit profiles): queue "
             "wait + uncached prefill + transfer. Compare with pdgate_ttft_seconds.", "kind",
             {"pd": decisions.predicted_pd, "aggregated": decisions.predicted_aggregated}),
        ]  # fmt: skip
        registry.register(local)
        self.filter_fallbacks = Counter(
            "pdgate_scheduler_filter_fallbacks",
            "Times a filter would have removed every candidate and was skipped.",
            ["filter"], registry=registry,
        )
        self.scrapes = Counter(
            "pdgate_engine_scrapes", "Engine /metrics scrapes that succeeded.",
            registry=registry,
        )
        self.scrape_errors = Counter(
            "pdgate_engine_scrape_errors", "Engine /metrics scrapes that failed, by reason.",
            ["reason"], registry=registry,
        )
        self.kv_event_batches = Counter(
            "pdgate_kv_event_batches", "KV event batches applied to the precise index.",
            registry=registry,
        )
        self.kv_event_errors = Counter(
            "pdgate_kv_event_errors", "KV event messages that could not be used.",
            registry=registry,
        )
        self.kv_event_gaps = Counter(
            "pdgate_kv_event_gaps", "Sequence gaps seen on KV event streams.",
            registry=registry,
        )
        self.kv_event_resyncs = Counter(
            "pdgate_kv_event_resyncs",
            "Precise index resyncs of one pod: replay, clear (replay failed), restart.",
            ["how"], registry=registry,
        )
        self.prefill_error = Histogram(
            "pdgate_scheduler_prefill_prediction_error_seconds",
            "|predicted - measured| prefill phase time (queue + prefill + pool pull) of "
            "sequential PD requests.",
            buckets=TTFT_BUCKETS, registry=registry,
        )
        self.prefill_fit = Gauge(
            "pdgate_scheduler_prefill_fit",
            "Per ModelServer prefill curve a + b*x + c*x^2 (x: uncached tokens), its "
            "samples, running mean prediction error (error_seconds) and that over the "
            "running mean duration (error_ratio).",
            ["server", "term"], registry=registry,
        )
        self.config_reloads = Counter(
            "pdgate_scheduler_config_reloads", "Scheduler config reloads, by result.",
            ["result"], registry=registry,
        )

    def observe_prefill(self, predicted: float, measured: float) -> None:
        self.prefill_error.observe(abs(predicted - measured))

    def track_fit(self, server: str, fit: PrefillFit) -> None:
        """Export one server's fit at exposition time."""
        gauge = self.prefill_fit
        gauge.labels(server, "a").set_function(lambda: fit.coefficients.a)
        gauge.labels(server, "b").set_function(lambda: fit.coefficients.b)
        gauge.labels(server, "c").set_function(lambda: fit.coefficients.c)
        gauge.labels(server, "samples").set_function(lambda: fit.samples)
        gauge.labels(server, "error_ratio").set_function(lambda: fit.error_rel)
        gauge.labels(server, "error_seconds").set_function(lambda: fit.error_abs_s)

    def untrack_fit(self, server: str) -> None:
        for term in ("a", "b", "c", "samples", "error_ratio", "error_seconds"):
            try:
                self.prefill_fit.remove(server, term)
            except KeyError:
                pass

    def track_index(
        self,
        kind: str,
        blocks: Callable[[], float],
        memory: Callable[[], float],
        evictions: Callable[[], float],
    ) -> None:
        """Report an index's size at exposition time (no work on the request path)."""
        self.index_blocks.labels(index=kind).set_function(blocks)
        self.index_memory.labels(index=kind).set_function(memory)
        self.index_evictions.labels(index=kind).set_function(evictions)
