"""Prometheus metrics under vLLM's names, so the router's scraper reads the simulator as an engine.

Own `CollectorRegistry` (one per engine, none global). Labelled children are created once;
gauges read their value at scrape time, so requests pay nothing for them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
E2E_BUCKETS: Final = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

_LABELS: Final = ("model_name", "engine")


class MetricFamilies:
    """One `/metrics` page: vLLM's families, registered once. Every engine of the server
    (one per data-parallel rank) adds its own children, `engine="<rank>"`, as vLLM's API
    server exports the engines it serves on one page."""

    def __init__(self, block_size: int | None = None, num_gpu_blocks: int | None = None) -> None:
        self.registry = reg = CollectorRegistry(auto_describe=True)
        # vLLM's info gauge, one series an engine: routers size their prefix index from it
        # (blocks x size).
        self.cache_config: Gauge | None = None
        self.cache_config_labels = (str(block_size), str(num_gpu_blocks))
        if block_size is not None and num_gpu_blocks is not None:
            self.cache_config = Gauge(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig.",
                ("engine", "block_size", "num_gpu_blocks"),
                registry=reg,
            )
        self.running = Gauge("vllm:num_requests_running", "Requests running.", _LABELS,
                             registry=reg)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting.", _LABELS,
                             registry=reg)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = 100%.", _LABELS,
                              registry=reg)
        self.queries = Counter(
            "vllm:prefix_cache_queries", "Prefix-cache queries, in tokens.", _LABELS, registry=reg
        )
        self.hits = Counter(
            "vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.", _LABELS, registry=reg
        )
        self.external_queries = Counter(
            "vllm:external_prefix_cache_queries",
            "Prompt tokens looked up in the KV store past the local prefix cache.",
            _LABELS,
            registry=reg,
        )
        self.external_hits = Counter(
            "vllm:external_prefix_cache_hits",
            "Prompt tokens read from the KV store instead of computed.",
            _LABELS,
            registry=reg,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prefill tokens processed.", _LABELS, registry=reg
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated.", _LABELS, registry=reg
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            _LABELS,
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            _LABELS,
            buckets=E2E_BUCKETS,
            registry=reg,
        )
        self.success = Counter(
            "vllm:request_success",
            "Requests finished.",
            (*_LABELS, "finished_reason"),
            registry=reg,
        )

    def render(self) -> bytes:
        """The exposition text."""
        return generate_latest(self.registry)


class EngineMetrics:
    """The vLLM metrics one engine exposes (its children in `families`; a page of its own
    when none is given)."""

    def __init__(
        self,
        model_name: str,
        running: Callable[[], float],
        waiting: Callable[[], float],
        kv_usage: Callable[[], float],
        block_size: int | None = None,
        num_gpu_blocks: int | None = None,
        *,
        families: MetricFamilies | None = None,
        engine: int = 0,
    ) -> None:
        self.families = f = families or MetricFamilies(block_size, num_gpu_blocks)
        self.registry = f.registry
        labels = (model_name, str(engine))
        if f.cache_config is not None:
            f.cache_config.labels(str(engine), *f.cache_config_labels).set(1.0)
        for gauge, read in ((f.running, running), (f.waiting, waiting), (f.kv_usage, kv_usage)):
            gauge.labels(*labels).set_function(read)
        self._queries = f.queries.labels(*labels)
        self._hits = f.hits.labels(*labels)
        self._external_queries = f.external_queries.labels(*labels)
        self._external_hits = f.external_hits.labels(*labels)
        self._prompt_tokens = f.prompt_tokens.labels(*labels)
        self._generation_tokens = f.generation_tokens.labels(*labels)
        self._ttft = f.ttft.labels(*labels)
        self._e2e = f.e2e.labels(*labels)
        self._success_length = f.success.labels(*labels, "length")

    def observe_prefix_cache(self, queried_tokens: int, hit_tokens: int) -> None:
        self._queries.inc(queried_tokens)
        self._hits.inc(hit_tokens)

    def observe_external_prefix_cache(self, queried_tokens: int, hit_tokens: int) -> None:
        self._external_queries.inc(queried_tokens)
        self._external_hits.inc(hit_tokens)

    def observe_ttft(self, seconds: float, prompt_tokens: int) -> None:
        self._ttft.observe(seconds)
        self._prompt_tokens.inc(prompt_tokens)

    def observe_finished(self, seconds: float, generated_tokens: int) -> None:
        self._e2e.observe(seconds)
        self._generation_tokens.inc(generated_tokens)
        self._success_length.inc()

    def render(self) -> bytes:
        """The exposition text (of every engine on the page)."""
        return self.families.render()
