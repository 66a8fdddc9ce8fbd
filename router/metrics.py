"""The router's own Prometheus metrics, in a registry owned by the app (no globals).

Labelled children are cached: a prometheus-client `labels()` lookup costs about as
much as the observation itself, and the data path observes several per request. The
histograms are `LoopHistogram`s (router/histogram.py): an observation is a bisect and two
additions, no locks, since the relay observes one per streamed chunk.

Token timing follows vLLM's metrics (`time_to_first_token_seconds`,
`inter_token_latency_seconds`) as a client sees them through the router; see
`router/timing.py` for what TTFT and its phases cover. The `model` label carries only
names a route serves: a request for no known model (unparsable, unknown name) is counted
with `model=""`, which Prometheus treats as no model label, so per-model panels leave it
out and the dashboard shows it apart. When a model leaves every route, its series go with
it (`retain_models`): a cluster whose routes or LoRA adapters come and go keeps only the
series of what it serves, and a model that comes back starts its counters again (a
reset `rate()` handles). A request still running when its model left ends under
`model=""` (with its phase and status as ever): counted, not a series of a model no
route serves brought back until the next snapshot. An engine's 4xx refusal of the
client's own input (other than 408/429) is a client error (`pdgate_client_errors_total`),
not an upstream one.
"""

from __future__ import annotations

from collections.abc import Collection

from prometheus_client import CollectorRegistry, Counter, Gauge

from router.histogram import LoopHistogram
from router.tally import BucketCounts

LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)
#: vLLM's TTFT buckets, with finer steps below 100 ms where a router's phases live.
TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.125, 0.15,
    0.175, 0.2, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)
#: vLLM's inter-token latency buckets, plus the sub-10 ms steps of fast engines.
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
TOKENS_PER_SECOND_BUCKETS = (
    1.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0,
)
#: Phases of `pdgate_ttft_phase_seconds` (see router/timing.py).
TTFT_PHASES = ("admission", "schedule", "retry", "prefill", "kv_handoff", "first_token")


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "pdgate_requests", "Requests answered, by model and HTTP status.",
            ["model", "status"], registry=registry,
        )
        self.duration = LoopHistogram(
            "pdgate_request_duration_seconds", "End-to-end request latency at the router.",
            "model", LATENCY_BUCKETS, registry=registry,
        )
        self.ttft = LoopHistogram(
            "pdgate_ttft_seconds",
            "Streams only: time from the request's arrival to the first chunk carrying "
            "generated content sent to the client.",
            "model", TTFT_BUCKETS, registry=registry,
        )
        self.ttft_phase = LoopHistogram(
            "pdgate_ttft_phase_seconds",
            "Streams only: the parts of pdgate_ttft_seconds (admission, schedule, retry, "
            "prefill, kv_handoff, first_token); they add up to it.",
            "phase", TTFT_BUCKETS, registry=registry,
        )
        self.itl = LoopHistogram(
            "pdgate_inter_token_latency_seconds",
            "Streams only: time between consecutive content events, as relayed (0 within a write).",
            "model", ITL_BUCKETS, registry=registry,
        )
        self.tokens_per_second = LoopHistogram(
            "pdgate_output_tokens_per_second",
            "Streams with usage: (completion tokens - 1) / (last content - first content), "
            "one observation per request.",
            "model", TOKENS_PER_SECOND_BUCKETS, registry=registry,
        )
        self.phase = LoopHistogram(
            "pdgate_phase_duration_seconds",
            "Time spent in each upstream phase (prefill, decode, aggregated).",
            "phase", LATENCY_BUCKETS, registry=registry,
        )
        self.retries = Counter(
            "pdgate_retries", "Attempts retried on a new pod pair, by model and failed phase.",
            ["model", "phase"], registry=registry,
        )
        self.upstream_errors = Counter(
            "pdgate_upstream_errors", "Upstream failures, by reason and phase.",
            ["reason", "phase"], registry=registry,
        )
        self.client_errors = Counter(
            "pdgate_client_errors",
            "Requests an engine refused as the client's own error (4xx other than 408 and "
            "429), by status and phase: not an upstream failure.",
            ["status", "phase"], registry=registry,
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
        #: The models the last snapshot serves (None before the first: any name is).
        self._served: Collection[str] | None = None

    def _label(self, model: str) -> str:
        """`model`, or "" once no route serves it (see the module docstring)."""
        served = self._served
        return model if served is None or model in served else ""

    def request_done(self, model: str, status: int, seconds: float) -> None:
        model = self._label(model)
        key = ("r", model, str(status))
        counter = self._children.get(key)
        if counter is None:
            counter = self._children[key] = self.requests.labels(model=model, status=str(status))
        counter.inc()  # type: ignore[attr-defined]
        self.duration.labels(model).observe(seconds)

    def first_token(self, model: str, seconds: float, laps: list[tuple[str, float]]) -> None:
        """A stream's TTFT and its phases (laps of one clock: they add up to it)."""
        self.ttft.labels(self._label(model)).observe(seconds)
        for phase, lap in laps:
            self.ttft_phase.labels(phase).observe(lap)

    def inter_token(self, model: str) -> BucketCounts:
        """The ITL child of `model`, fetched once per stream (a child its model's removal
        drops takes the rest of that stream's observations out of sight)."""
        return self.itl.labels(self._label(model))

    def output_rate(self, model: str, tokens_per_second: float) -> None:
        self.tokens_per_second.labels(self._label(model)).observe(tokens_per_second)

    def phase_done(self, phase: str, seconds: float) -> None:
        self.phase.labels(phase).observe(seconds)

    def retry(self, model: str, phase: str) -> None:
        model = self._label(model)
        key = ("t", model, phase)
        counter = self._children.get(key)
        if counter is None:
            counter = self._children[key] = self.retries.labels(model=model, phase=phase)
        counter.inc()  # type: ignore[attr-defined]

    def retain_models(self, served: Collection[str]) -> None:
        """Drop every per-model series of a model no route serves any more (`model=""`,
        requests for no known model, stays). Called with each new view snapshot; until the
        next, a model `served` lacks is counted as `model=""`."""
        self._served = served
        stale = [key for key in self._children if key[1] and key[1] not in served]
        for key in stale:
            del self._children[key]
            (self.requests if key[0] == "r" else self.retries).remove(*key[1:])
        for histogram in (self.duration, self.ttft, self.itl, self.tokens_per_second):
            histogram.retain(lambda model: not model or model in served)

    def upstream_error(self, reason: str, phase: str) -> None:
        self.upstream_errors.labels(reason=reason, phase=phase).inc()

    def client_error(self, status: int, phase: str) -> None:
        self.client_errors.labels(status=str(status), phase=phase).inc()
