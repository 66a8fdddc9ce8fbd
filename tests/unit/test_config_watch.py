"""ConfigWatch: ModelServers losing their pods and shadowed ModelRoutes, logged and counted."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from prometheus_client import CollectorRegistry

from router.config_watch import ConfigWatch
from router.resources import ModelRoute, ModelServer, ObjectMeta, Pod, Rule, TargetModel
from router.view import ClusterView


def route(name: str, created: str) -> ModelRoute:
    return ModelRoute(
        meta=ObjectMeta(name=name, creation_timestamp=created),
        model_name="m",
        lora_adapters=(),
        rules=(Rule(name="r", target_models=(TargetModel("ms"),)),),
    )


def server(app: str = "x") -> ModelServer:
    return ModelServer(
        meta=ObjectMeta(name="ms"), model=None, inference_engine="vLLM",
        match_labels={"app": app}, pd_group=None, port=8000,
    )


def pod(name: str) -> Pod:
    return Pod(meta=ObjectMeta(name=name, labels={"app": "x"}), ip="10.0.0.1", ready=True)


class Synced:
    def __init__(self) -> None:
        self.value = False

    def __call__(self) -> bool:
        return self.value


@pytest.fixture
def watched() -> tuple[ClusterView, CollectorRegistry, Synced]:
    view, registry, synced = ClusterView(), CollectorRegistry(), Synced()
    ConfigWatch(view, registry, synced)
    return view, registry, synced


def sample(registry: CollectorRegistry, metric: str, **labels: str) -> float:
    return registry.get_sample_value(metric, {"namespace": "default", **labels}) or 0.0


def test_a_server_losing_its_pods_is_logged_counted_and_so_is_its_return(
    watched: tuple[ClusterView, CollectorRegistry, Synced], caplog: pytest.LogCaptureFixture
) -> None:
    view, registry, synced = watched
    caplog.set_level(logging.WARNING, "pdgate.config")
    # Before the sources synced, a server without pods yet is not a fault.
    view.apply(server())
    assert caplog.messages == []
    synced.value = True
    with view.batch():
        view.apply(pod("p1"))
        view.apply(pod("p2"))
    assert sample(registry, "pdgate_model_server_ready_pods", name="ms") == 2
    assert caplog.messages == []

    view.apply(server(app="typo"))  # the selector now matches nothing
    assert caplog.messages == [
        "ModelServer default/ms has no ready pods (had 2): its models answer 503"
    ]
    assert sample(registry, "pdgate_model_server_transitions_total", name="ms", to="empty") == 1
    assert sample(registry, "pdgate_model_server_ready_pods", name="ms") == 0
    view.delete("Pod", "default", "p2")  # still empty: no new transition
    assert len(caplog.messages) == 1

    view.apply(server())
    assert caplog.messages[-1] == "ModelServer default/ms has 1 ready pods again"
    assert sample(registry, "pdgate_model_server_transitions_total", name="ms",
                  to="serving") == 1
    view.delete("ModelServer", "default", "ms")
    assert registry.get_sample_value(
        "pdgate_model_server_ready_pods", {"namespace": "default", "name": "ms"}) is None


def test_the_first_synced_snapshot_reports_servers_that_select_nothing(
    watched: tuple[ClusterView, CollectorRegistry, Synced], caplog: pytest.LogCaptureFixture
) -> None:
    view, registry, synced = watched
    caplog.set_level(logging.WARNING, "pdgate.config")
    view.apply(server(app="nothing"))
    synced.value = True
    view.apply(route("r", ""))
    assert caplog.messages == [
        "ModelServer default/ms has no ready pods (its selector matches none): its models "
        "answer 503"
    ]
    assert sample(registry, "pdgate_model_server_transitions_total", name="ms", to="empty") == 1


def test_a_shadowed_route_is_logged_once_and_gauged(
    watched: tuple[ClusterView, CollectorRegistry, Synced], caplog: pytest.LogCaptureFixture
) -> None:
    view, registry, synced = watched
    synced.value = True
    caplog.set_level(logging.WARNING, "pdgate.config")
    view.apply(route("zz-old", "2024-01-01T00:00:00Z"))
    view.apply(route("aa-new", "2024-06-01T00:00:00Z"))
    assert view.snapshot.routes_by_model["m"].meta.name == "zz-old"
    assert caplog.messages == [
        "ModelRoute default/aa-new is shadowed for model 'm' by the older ModelRoute "
        "default/zz-old: it gets no traffic for it"
    ]
    assert sample(registry, "pdgate_routes_shadowed", name="aa-new") == 1
    view.apply(server())  # another change: no second report of the route
    assert sum(m.startswith("ModelRoute") for m in caplog.messages) == 1
    view.delete("ModelRoute", "default", "zz-old")
    assert caplog.messages[-1] == "ModelRoute default/aa-new is no longer shadowed"
    assert registry.get_sample_value(
        "pdgate_routes_shadowed", {"namespace": "default", "name": "aa-new"}) is None


def test_a_pod_with_data_parallel_ranks_counts_once(
    watched: tuple[ClusterView, CollectorRegistry, Synced]
) -> None:
    view, registry, synced = watched
    synced.value = True
    ranks = ObjectMeta(name="ms", annotations={"pdgate.io/data-parallel-size": "4"})
    with view.batch():
        view.apply(dataclasses.replace(server(), meta=ranks))
        view.apply(pod("p1"))
        view.apply(pod("p2"))
    assert len(view.snapshot.endpoints()) == 8  # four targets a pod
    assert sample(registry, "pdgate_model_server_ready_pods", name="ms") == 2
