"""Configuration faults on real processes: loud, bounded, never silent.

A router process reads its own config directory over simulated PD pods (two groups, on a
Mooncake master). Each test breaks the configuration the way an operator or a writer
would: a second ModelRoute for a served model, a pods file cut mid-write or deleted, a
ModelServer selector that matches nothing, retries asked for by the million, a pod that
fails every request, and request fields no engine takes.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.harness import (
    API_VERSION,
    Process,
    SimCluster,
    free_port,
    metric_values,
    wait_http,
    write_yaml,
)
from tests.integration.test_faults_kit import (
    FaultCluster,
    Router,
    metric_sum,
    pd_specs,
    server_manifests,
    wait_for,
)

pytestmark = pytest.mark.integration

MODEL = "sim-config-model"
APP = "cfgfaults"
_dirs = itertools.count()


@pytest.fixture(scope="module")
def cluster(mooncake_master: object, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[FaultCluster]:
    specs = pd_specs(APP)
    port = free_port([s.ip for s in specs])
    faults = FaultCluster(SimCluster(mooncake_master, tmp_path_factory.mktemp("cfgfaults")),
                          port, specs)
    try:
        faults.start_pods(MODEL, ["--fast"])
        yield faults
    finally:
        faults.stop()


@pytest.fixture(autouse=True)
def clear_faults(cluster: FaultCluster) -> Iterator[None]:
    yield
    cluster.clear_faults()


def start_router(
    cluster: FaultCluster, docs: list[dict[str, Any]], flags: tuple[str, ...] = ()
) -> tuple[Router, Path]:
    """A router over a config directory of its own: the cluster's pods plus `docs`."""
    config = cluster.sim.workdir / f"config-{next(_dirs)}"
    config.mkdir()
    shutil.copy(cluster.sim.config_dir / "pods.yaml", config / "pods.yaml")
    write_yaml(config / "servers.yaml", docs)
    port = free_port()
    process = Process(
        [sys.executable, "-m", "router", "serve", "--config", str(config),
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *flags],
        config / "router.log",
    )
    process.start()
    router = Router(process, port)
    cluster.routers.append(router)
    wait_http(f"{router.url}/readyz")
    return router, config


def of(router: Router, metric: str, labels: dict[str, str] | None = None) -> float:
    """The sum of a router metric's samples carrying every pair of `labels`."""
    wanted = [f'{k}="{v}"' for k, v in (labels or {}).items()]
    return sum(value for head, value in metric_values(router.metrics(), metric)
               if all(w in head for w in wanted))


def transitions(router: Router, to: str) -> float:
    return of(router, "pdgate_model_server_transitions_total", {"name": "cfg", "to": to})


def client(router: Router) -> openai.OpenAI:
    # max_retries=0: the SDK would retry a 5xx by itself and hide what the router did.
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0,
                         timeout=30)


def ask(router: Router, content: str, model: str = MODEL, **extra: Any) -> str:
    answer = client(router).chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=2, **extra
    )
    return answer.choices[0].message.content or ""


def route(name: str, model: str, server: str) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION, "kind": "ModelRoute",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"modelName": model,
                 "rules": [{"name": "default", "targetModels": [{"modelServerName": server}]}]},
    }


def servers(cluster: FaultCluster, name: str = "cfg", **kwargs: Any) -> list[dict[str, Any]]:
    return server_manifests(name, kwargs.pop("model", MODEL), app=APP, port=cluster.port,
                            upstream_model=MODEL, **kwargs)


# --- 7: a second ModelRoute for a served model ------------------------------------------------


def test_a_second_route_for_a_served_model_never_takes_its_traffic(
    cluster: FaultCluster,
) -> None:
    docs = servers(cluster)
    docs[0]["metadata"]["name"] = "zz-first"
    router, config = start_router(cluster, docs)
    assert ask(router, "before")

    # A younger route for the same model, whose name sorts first, pointing nowhere.
    write_yaml(config / "shadow.yaml", [route("aa-shadow", MODEL, "nowhere")])
    wait_for(lambda: of(router, "pdgate_routes_shadowed", {"name": "aa-shadow"}) == 1)
    for i in range(20):
        assert ask(router, f"after {i}")  # every one served by the older route
    log = router.process.log()
    assert ("ModelRoute default/aa-shadow is shadowed for model 'sim-config-model' by the "
            "older ModelRoute default/zz-first") in log

    # Gone: no longer shadowed.
    (config / "shadow.yaml").unlink()
    wait_for(lambda: "aa-shadow" not in router.metrics())
    assert "ModelRoute default/aa-shadow is no longer shadowed" in router.process.log()


# --- 8: pods files cut or deleted, selectors that match nothing -------------------------------


def test_a_cut_pods_file_keeps_serving_and_losing_every_pod_is_logged(
    cluster: FaultCluster,
) -> None:
    router, config = start_router(cluster, servers(cluster))
    pods = config / "pods.yaml"
    full = pods.read_text()
    assert ask(router, "before")

    # A writer caught half-way (no temp file + rename): cut inside the first pod's IP,
    # so the file is valid YAML with one invalid Pod and three Pods missing.
    first_ip = cluster.specs[0].ip
    pods.write_text(full[: full.index(first_ip) + len(first_ip) - 3])
    wait_for(lambda: of(router, "pdgate_config_file_errors_total", {"reason": "invalid"}))
    assert metric_sum(router.metrics(), "pdgate_config_files_held") == 1
    for i in range(10):
        assert ask(router, f"cut {i}")  # the last complete file is still served
    assert "keeping its 4 objects of the last good reading" in router.process.log()
    pods.write_text(full)
    wait_for(lambda: metric_sum(router.metrics(), "pdgate_config_files_held") == 0)

    # The ModelServer's selector stops matching: 503, and the router says why.
    broken = servers(cluster)
    broken[1]["spec"]["workloadSelector"]["matchLabels"] = {"app": "typo"}
    write_yaml(config / "servers.yaml", broken)
    wait_for(lambda: transitions(router, "empty") == 1)
    assert of(router, "pdgate_model_server_ready_pods", {"name": "cfg"}) == 0
    with pytest.raises(openai.APIStatusError) as info:
        ask(router, "no pods")
    assert info.value.status_code == 503
    assert "ModelServer default/cfg has no ready pods (had 4)" in router.process.log()

    write_yaml(config / "servers.yaml", servers(cluster))
    wait_for(lambda: transitions(router, "serving") == 1)
    assert "ModelServer default/cfg has 4 ready pods again" in router.process.log()
    assert ask(router, "back")

    # The pods file deleted: the same, and the file source names the file.
    pods.unlink()
    wait_for(lambda: transitions(router, "empty") == 2)
    assert f"{pods} is gone: its 4 objects are removed" in router.process.log()


# --- 9: retries bounded per request, per pod and per router -----------------------------------


def test_retry_attempts_past_the_cap_are_refused_loudly(cluster: FaultCluster) -> None:
    router, _ = start_router(cluster, servers(cluster, retry_attempts=1_000_000))
    with pytest.raises(openai.APIStatusError) as info:
        ask(router, "greedy")
    assert info.value.status_code == 503
    log = router.process.log()
    assert "invalid ModelServer default/cfg skipped" in log
    assert "spec.trafficPolicy.retry.attempts: must be between 0 and 5, got 1000000" in log


async def test_the_retry_budget_bounds_retries_across_the_router(
    cluster: FaultCluster,
) -> None:
    # Passive ejection off: only the budget stands between a failing cluster and
    # (1 + attempts) x its load.
    router, _ = start_router(cluster, servers(cluster, retry_attempts=2),
                             ("--outlier-failures", "0"))
    marker = "budget-marker"
    for name in ("g0-decode", "g1-decode"):
        cluster.set_faults(name, error_rate=1.0, slow_start_ms=300, match=marker)
    api = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0,
                             timeout=30)

    async def one(i: int) -> int:
        try:
            await api.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"{marker} {i}"}],
                max_tokens=2)
        except openai.APIStatusError as exc:
            return exc.status_code
        return 200

    requests = 16
    before = cluster.injected("error", ["g0-decode", "g1-decode"])  # counts outlive a test
    statuses = await asyncio.gather(*(one(i) for i in range(requests)))
    await api.close()
    assert statuses == [502] * requests
    attempts = cluster.injected("error", ["g0-decode", "g1-decode"]) - before
    # Without a budget: 16 x 3 = 48 decode attempts. With it, at most 3 retries in flight
    # (the floor; 20 % of 16 is 3) while the first attempts fail together: about 16 + 3 x 2.
    assert attempts < 2 * requests, attempts
    text = router.metrics()
    assert metric_sum(text, "pdgate_retries_refused_total", reason="budget") >= requests // 2
    assert metric_sum(text, "pdgate_retries_total") == attempts - requests
    wait_for(lambda: metric_sum(router.metrics(), "pdgate_inflight_requests") == 0)


def test_a_retry_never_goes_to_an_ejected_pod(cluster: FaultCluster) -> None:
    router, _ = start_router(cluster, servers(cluster, retry_attempts=1), (
        "--outlier-failures", "3", "--outlier-base-ejection", "60",
        "--outlier-max-ejection", "60", "--health-check-interval", "0",
    ))
    cluster.set_faults("g0-decode", error_rate=1.0)
    for i in range(40):  # retried on g1 each time g0 fails, until g0 is ejected
        assert ask(router, f"eject g0 {i}")
        if of(router, "pdgate_pod_ejected", {"pod": "default/g0-decode"}):
            break
    assert of(router, "pdgate_pod_ejected", {"pod": "default/g0-decode"}) == 1
    g0_before = cluster.injected("error", ["g0-decode"])
    g1_before = cluster.injected("error", ["g1-decode"])  # counts outlive a test

    # Now g1's decode fails this one request. Its retry may only go to g1 again (it failed
    # once, but it is not ejected), never to the ejected g0.
    cluster.set_faults("g1-decode", error_rate=1.0, match="only-this")
    with pytest.raises(openai.APIStatusError) as info:
        ask(router, "only-this request")
    assert info.value.status_code == 502
    assert cluster.injected("error", ["g1-decode"]) - g1_before == 2
    assert cluster.injected("error", ["g0-decode"]) == g0_before


# --- 10: request fields no engine accepts ------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "fields", "param"),
    [
        ("chat", {"n": 1000}, "n"),
        ("chat", {"n": -1}, "n"),
        ("completions", {"best_of": 1000}, "best_of"),
        ("chat", {"logprobs": True, "top_logprobs": 100000}, "top_logprobs"),
        ("completions", {"logprobs": 100}, "logprobs"),
        ("chat", {"top_p": 0}, "top_p"),
        ("chat", {"temperature": -1}, "temperature"),
    ],
)
def test_fields_no_engine_accepts_are_a_400_naming_them(
    cluster: FaultCluster, sampling_router: Router, endpoint: str, fields: dict[str, Any],
    param: str,
) -> None:
    api = client(sampling_router)
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "chat":
            api.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                extra_body=fields)
        else:
            api.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body=fields)
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == param
    assert error["type"] == "invalid_request_error"


@pytest.fixture(scope="module")
def sampling_router(cluster: FaultCluster) -> Router:
    router, _ = start_router(cluster, servers(cluster))
    assert ask(router, "in bounds", n=1, temperature=0.5, top_p=0.9)
    return router
