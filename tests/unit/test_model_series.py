"""Per-model and per-ModelServer series last as long as what they describe is served.

A cluster whose routes or LoRA adapters come and go must not keep a series for every
model it ever served: the exposition would grow with every configuration change.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from router.config_watch import ConfigWatch
from router.resources import ModelRoute, ModelServer, ObjectMeta, Pod, Rule, TargetModel
from router.state import AppState, RouterConfig
from router.view import ClusterView

PER_MODEL = (
    "pdgate_requests_total", "pdgate_retries_total", "pdgate_request_duration_seconds_count",
    "pdgate_ttft_seconds_count", "pdgate_inter_token_latency_seconds_count",
    "pdgate_output_tokens_per_second_count",
)


def route(name: str, model: str, adapters: tuple[str, ...] = ()) -> ModelRoute:
    return ModelRoute(
        meta=ObjectMeta(name=name, creation_timestamp="2024-01-01T00:00:00Z"),
        model_name=model,
        lora_adapters=adapters,
        rules=(Rule(name="r", target_models=(TargetModel("ms"),)),),
    )


def models_with_series(registry: CollectorRegistry) -> dict[str, set[str]]:
    """For each per-model metric, the model labels it exposes."""
    found: dict[str, set[str]] = {name: set() for name in PER_MODEL}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name in found:
                found[sample.name].add(sample.labels["model"])
    return found


def serve(state: AppState, model: str) -> None:
    """What the data path records for a streamed request that was retried once."""
    metrics = state.metrics
    metrics.retry(model, "prefill")
    metrics.request_done(model, 200, 0.5)
    metrics.first_token(model, 0.1, [("prefill", 0.1)])
    metrics.inter_token(model).observe(0.01)
    metrics.output_rate(model, 50.0)


def test_a_model_no_route_serves_any_more_loses_its_series() -> None:
    state = AppState(RouterConfig())
    state.view.apply(route("base", "llama", adapters=("sql-lora",)))
    state.view.apply(route("other", "qwen"))
    for model in ("llama", "sql-lora", "qwen", ""):  # "": a request for no known model
        serve(state, model)
    assert all(models == {"llama", "sql-lora", "qwen", ""}
               for models in models_with_series(state.registry).values())

    state.view.apply(route("base", "llama"))  # the adapter is dropped from the route
    state.view.delete("ModelRoute", "default", "other")
    assert all(models == {"llama", ""}
               for models in models_with_series(state.registry).values())

    # The model comes back: its counters start again, and count.
    state.view.apply(route("other", "qwen"))
    serve(state, "qwen")
    assert state.registry.get_sample_value(
        "pdgate_requests_total", {"model": "qwen", "status": "200"}) == 1
    assert state.registry.get_sample_value(
        "pdgate_retries_total", {"model": "qwen", "phase": "prefill"}) == 1


def test_a_request_ending_after_its_model_left_is_counted_without_its_series() -> None:
    """A stream still running when its route is deleted ends after the snapshot that
    dropped the model's series: it is counted under `model=""`, not as a series of a model
    no route serves (which would stay until some later snapshot)."""
    state = AppState(RouterConfig())
    state.view.apply(route("base", "llama"))
    state.view.apply(route("other", "qwen"))
    serve(state, "qwen")
    state.view.delete("ModelRoute", "default", "other")  # the request below was running
    serve(state, "qwen")
    assert all(models == {""} for models in models_with_series(state.registry).values())
    assert state.registry.get_sample_value(
        "pdgate_requests_total", {"model": "", "status": "200"}) == 1


def test_a_deleted_model_server_loses_its_transition_counts() -> None:
    view, registry = ClusterView(), CollectorRegistry()
    ConfigWatch(view, registry, lambda: True)
    server = ModelServer(
        meta=ObjectMeta(name="ms"), model=None, inference_engine="vLLM",
        match_labels={"app": "x"}, pd_group=None, port=8000,
    )
    with view.batch():
        view.apply(server)
        view.apply(Pod(meta=ObjectMeta(name="p", labels={"app": "x"}), ip="10.0.0.1",
                       ready=True))
    view.delete("Pod", "default", "p")  # serving -> empty: one transition
    labels = {"namespace": "default", "name": "ms", "to": "empty"}
    assert registry.get_sample_value("pdgate_model_server_transitions_total", labels) == 1

    view.delete("ModelServer", "default", "ms")
    assert registry.get_sample_value("pdgate_model_server_transitions_total", labels) is None
