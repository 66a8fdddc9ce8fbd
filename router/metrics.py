"""The router's own Prometheus metrics, in a registry owned by the app (no globals).

Labelled children are cached: a prometheus-client `labels()` lookup costs about as
much as the observation itself, and the data path observes several per request.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "pdgate_requests", "Requests answered, by model and HTTP status.",
            ["model", "status"], registry=registry,
        )
        self.duration = Histogram(
            "pdgate_request_duration_seconds", "End-to-end request latency at the router.",
            ["model"], buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.ttft = Histogram(
            "pdgate_ttft_seconds", "Time to the first streamed byte of the answer.",
            ["model"], buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.phase = Histogram(
            "pdgate_phase_duration_seconds",
            "Time spent in each upstream phase (prefill, decode, aggregated).",
            ["phase"], buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.retries = Counter(
            "pdgate_retries", "Attempts retried on a new pod pair, by model and failed phase.",
            ["model", "phase"], registry=registry,
        )
        self.upstream_errors = Counter(
            "pdgate_upstream_errors", "Upstream failures, by reason and phase.",
            ["reason", "phase"], registry=registry,
        )
        self.ambiguous_pods = Gauge(
            "pdgate_pods_left_out",
            "Pods matching a PD ModelServer left out: both role label sets, neither, "
            "or no group label.",
            registry=registry,
        )
        self.ready = Gauge(
            "pdgate_ready", "1 when the router is ready to serve.", registry=registry
        )
        self._children: dict[tuple[str, ...], object] = {}

    def request_done(self, model: str, status: int, seconds: float) -> None:
        key = ("r", model, str(status))
        counter = self._children.get(key)
        if counter is None:
            counter = self._children[key] = self.requests.labels(model=model, status=str(status))
        counter.inc()  # type: ignore[attr-defined]
        self._hist(self.duration, "d", model).observe(seconds)

    def first_byte(self, model: str, seconds: float) -> None:
        self._hist(self.ttft, "t", model).observe(seconds)

    def phase_done(self, phase: str, seconds: float) -> None:
        self._hist(self.phase, "p", phase).observe(seconds)

    def retry(self, model: str, phase: str) -> None:
        self.retries.labels(model=model, phase=phase).inc()

    def upstream_error(self, reason: str, phase: str) -> None:
        self.upstream_errors.labels(reason=reason, phase=phase).inc()

    def _hist(self, histogram: Histogram, tag: str, label: str) -> Histogram:
        key = (tag, label)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = histogram.labels(label)
        return child  # type: ignore[return-value]
