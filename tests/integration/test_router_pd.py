"""The PD request path end to end: real Mooncake master, simulated pods, router, openai SDK.

Two PD groups of one ModelServer (nixl connector): g0 = (p0, d0), g1 = (p1, d1). Decode's
answer is a deterministic function of the prompt and of the KV it read from the store,
so comparing it with `expected_text(kv_from_store=True)` proves the handle travelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import psutil
import pytest

from engine_sim.generation import expected_text
from engine_sim.mooncake_master import MooncakeMaster
from tests.integration.harness import (
    POD_ADDRESS_PREFIX,
    SimCluster,
    SimPodSpec,
    free_port,
    loopback_net,
    metric_values,
    pd_server_manifests,
    pod_manifest,
    wait_http,
    write_yaml,
)
from tests.sim_tokens import chat_ids, prompt_ids

MODEL = "sim-pd-model"
NET = loopback_net()
GROUPS = {"g0": (f"{NET}.31", f"{NET}.32"), "g1": (f"{NET}.41", f"{NET}.42")}
#: The fragile cluster's pods (one test kills one): their own addresses.
FRAGILE_NET = loopback_net()
QUESTION = [{"role": "user", "content": "Where is the capital of China?"}]
LONG_PROMPT = "Tell me a story about rivers and mountains. " * 12  # several full KV blocks


def _specs() -> list[SimPodSpec]:
    specs = []
    for group, (prefill_ip, decode_ip) in GROUPS.items():
        for role, ip in (("prefill", prefill_ip), ("decode", decode_ip)):
            specs.append(SimPodSpec(
                name=f"{group}-{role}", ip=ip, role=role, group=group,
                labels={"app": "sim-pd", "group": group, "role": role},
            ))
    return specs


@pytest.fixture(scope="module")
def cluster(mooncake_master: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
    tuple[SimCluster, int]
]:
    sim = SimCluster(mooncake_master, tmp_path_factory.mktemp("pd-path"))
    specs = _specs()
    port = free_port([spec.ip for spec in specs])
    try:
        for spec in specs:
            sim.start_pod(spec, port, MODEL, ["--itl-ms", "2", "--prefill-overhead-ms", "2"])
        sim.wait_pods(port, specs)
        write_yaml(sim.config_dir / "server.yaml", pd_server_manifests("sim-pd", MODEL, port=port))
        write_yaml(sim.config_dir / "pods.yaml", [pod_manifest(s) for s in specs])
        sim.start_router()
        yield sim, port
    finally:
        sim.stop()


@pytest.fixture
def client(cluster: tuple[SimCluster, int]) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{cluster[0].router_url}/v1", api_key="unused",
                              max_retries=0)


def _group_of(pod_name: str | None) -> str:
    assert pod_name is not None
    return pod_name.split("-")[0]


async def test_chat_non_streaming_decode_uses_prefill_kv(client: openai.AsyncOpenAI) -> None:
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=QUESTION, max_tokens=12  # type: ignore[arg-type]
    )
    completion = raw.parse()
    prompt = chat_ids(QUESTION)
    assert completion.choices[0].message.content == expected_text(
        prompt, 12, kv_from_store=True, model=MODEL
    )
    assert completion.choices[0].message.content != expected_text(
        prompt, 12, kv_from_store=False, model=MODEL
    )
    assert completion.usage is not None and completion.usage.completion_tokens == 12
    prefill, decode = raw.headers["x-pdgate-prefill-pod"], raw.headers["x-pdgate-decode-pod"]
    assert prefill.endswith("-prefill") and decode.endswith("-decode")
    assert _group_of(prefill) == _group_of(decode)
    assert raw.headers["x-request-id"]


async def test_chat_streaming_passes_chunks_and_usage(client: openai.AsyncOpenAI) -> None:
    messages = [{"role": "user", "content": LONG_PROMPT}]
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )
    pieces: list[str] = []
    usage = None
    chunks = 0
    async for chunk in stream:
        chunks += 1
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == expected_text(
        chat_ids(messages), 20, kv_from_store=True, model=MODEL
    )
    assert chunks >= 20  # passed through chunk by chunk, not as one buffered answer
    assert usage is not None and usage.completion_tokens == 20


async def test_completions_streaming_and_not(client: openai.AsyncOpenAI) -> None:
    expected = expected_text(prompt_ids(LONG_PROMPT), 8, kv_from_store=True, model=MODEL)
    completion = await client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=8)
    assert completion.choices[0].text == expected
    stream = await client.completions.create(
        model=MODEL, prompt=LONG_PROMPT, max_tokens=8, stream=True
    )
    text = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
    assert text == expected


async def test_echo_through_the_pd_path(client: openai.AsyncOpenAI) -> None:
    """`echo` reaches decode and comes back as vLLM answers it: a completion's prompt
    before its text, the prompt alone with `max_tokens: 0` (the one request that generates
    nothing; vLLM still computes one token, counted in the usage), a chat's last assistant
    message before the rest, streamed or not."""
    generated = expected_text(prompt_ids(LONG_PROMPT), 8, kv_from_store=True, model=MODEL)
    completion = await client.completions.create(
        model=MODEL, prompt=LONG_PROMPT, max_tokens=8, echo=True)
    assert completion.choices[0].text == LONG_PROMPT + generated
    stream = await client.completions.create(
        model=MODEL, prompt=LONG_PROMPT, max_tokens=8, echo=True, stream=True)
    text = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
    assert text == LONG_PROMPT + generated

    only = await client.completions.create(
        model=MODEL, prompt=LONG_PROMPT, max_tokens=0, echo=True)
    assert only.choices[0].text == LONG_PROMPT
    assert only.usage is not None and only.usage.completion_tokens == 1
    streamed = await client.completions.create(
        model=MODEL, prompt=LONG_PROMPT, max_tokens=0, echo=True, stream=True,
        stream_options={"include_usage": True})
    chunks = [chunk async for chunk in streamed]
    assert [c.choices[0].text for c in chunks if c.choices] == [LONG_PROMPT]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 1

    messages: list[Any] = [*QUESTION, {"role": "assistant", "content": "It is in"}]
    answer = expected_text(chat_ids(messages), 4, kv_from_store=True, model=MODEL)
    chat = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, extra_body={"echo": True})
    assert chat.choices[0].message.content == "It is in" + answer
    chunks = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, stream=True, extra_body={"echo": True})
    content = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
    assert content == "It is in" + answer


async def test_busy_poll_answers_the_same_and_idles_quietly(
    cluster: tuple[SimCluster, int],
) -> None:
    """`--busy-poll`: a second router on the same pods, its loop polling while it serves
    (router/busy_poll.py), gives the same answers; once idle it only looks now and then,
    far from the core a polling loop takes."""
    sim, _ = cluster
    port = free_port()
    router = sim.serve_router("router-busy-poll", ["--busy-poll", "2"], port)
    try:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                                    max_retries=0)
        completion = await client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=12  # type: ignore[arg-type]
        )
        assert completion.choices[0].message.content == expected_text(
            chat_ids(QUESTION), 12, kv_from_store=True, model=MODEL
        )
        stream = await client.completions.create(
            model=MODEL, prompt=LONG_PROMPT, max_tokens=8, stream=True
        )
        text = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
        assert text == expected_text(prompt_ids(LONG_PROMPT), 8, kv_from_store=True,
                                     model=MODEL)
        assert router.popen is not None
        process = psutil.Process(router.popen.pid)
        await asyncio.sleep(0.5)  # well past the 2 ms linger
        before = process.cpu_times()
        await asyncio.sleep(2.0)
        after = process.cpu_times()
        idle = (after.user + after.system) - (before.user + before.system)
        assert idle < 0.5, f"{idle:.2f} s of CPU in 2 s idle: still polling"
    finally:
        assert router.stop() == 0, router.log()


async def test_pairs_never_cross_groups_and_load_spreads(client: openai.AsyncOpenAI) -> None:
    async def one(i: int) -> tuple[str, str]:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": f"question {i}"}], max_tokens=4
        )
        return raw.headers["x-pdgate-prefill-pod"], raw.headers["x-pdgate-decode-pod"]

    pairs = await asyncio.gather(*(one(i) for i in range(24)))
    assert all(_group_of(p) == _group_of(d) for p, d in pairs)
    assert {_group_of(p) for p, _ in pairs} == set(GROUPS)


async def test_models_lists_route(client: openai.AsyncOpenAI) -> None:
    models = await client.models.list()
    assert MODEL in [m.id for m in models.data]


async def test_unknown_model_is_404_with_openai_error(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await client.chat.completions.create(model="no-such-model", messages=QUESTION)
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "model_not_found"
    assert set(error) >= {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b'["a list"]', None),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', "model"),
        (b'{"model": "sim-pd-model"}', "messages"),
        (b'{"model": "sim-pd-model", "messages": [], "stream": false}', "messages"),
        (b'{"model": "sim-pd-model", "messages": [{"role": "user", "content": "x"}],'
         b' "max_tokens": -3}', "max_tokens"),
    ],
)
async def test_malformed_body_is_400(
    cluster: tuple[SimCluster, int], body: bytes, param: str | None
) -> None:
    async with aiohttp.ClientSession() as session, session.post(
        f"{cluster[0].router_url}/v1/chat/completions", data=body,
        headers={"content-type": "application/json"},
    ) as response:
        assert response.status == 400
        error = (await response.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert POD_ADDRESS_PREFIX not in error["message"]


async def test_no_ready_pods_is_503(cluster: tuple[SimCluster, int]) -> None:
    sim, port = cluster
    write_yaml(sim.config_dir / "empty.yaml",
               pd_server_manifests("empty-pd", "empty-model", port=port))
    client = openai.AsyncOpenAI(base_url=f"{sim.router_url}/v1", api_key="x", max_retries=0)
    try:
        for _ in range(50):  # the file source polls; wait until the route exists
            models = [m.id for m in (await client.models.list()).data]
            if "empty-model" in models:
                break
            await asyncio.sleep(0.1)
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(model="empty-model", messages=QUESTION)
        assert caught.value.status_code == 503
    finally:
        (sim.config_dir / "empty.yaml").unlink()


async def test_inflight_counters_return_to_zero(
    cluster: tuple[SimCluster, int], client: openai.AsyncOpenAI
) -> None:
    await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
    samples = metric_values(cluster[0].router_metrics(), "pdgate_inflight_requests")
    assert samples, "in-flight gauge missing"
    assert all(value == 0 for _, value in samples)


def _router_requests(metrics: str, status: str) -> float:
    return sum(v for labels, v in metric_values(metrics, "pdgate_requests_total")
               if f'status="{status}"' in labels)


async def test_yaml_edit_during_stream(cluster: tuple[SimCluster, int]) -> None:
    """A new ModelServer and a removed pod apply while a stream is in flight, unbroken."""
    sim, port = cluster
    client = openai.AsyncOpenAI(base_url=f"{sim.router_url}/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "a long answer please"}]
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=150, stream=True  # ~0.3 s at 2 ms a token
    )
    pieces: list[str] = []
    edited = False
    specs = _specs()
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if not edited and len(pieces) == 5:
            edited = True
            # Remove group g1's decode pod (maybe serving this stream: it must finish) and add
            # an aggregated ModelServer for a new model on the same pods' port.
            write_yaml(sim.config_dir / "pods.yaml",
                       [pod_manifest(s) for s in specs if s.name != "g1-decode"])
            write_yaml(sim.config_dir / "extra.yaml", pd_server_manifests(
                "extra-pd", "extra-model", port=port))
            await asyncio.sleep(1.0)  # let the file source apply the edit mid-stream
    assert "".join(pieces) == expected_text(
        chat_ids(messages), 150, kv_from_store=True, model=MODEL
    )
    try:
        # The edit took effect: g1 has no decode pod, so every pair is now in g0.
        for i in range(8):
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": f"after edit {i}"}],
                max_tokens=2,
            )
            assert raw.headers["x-pdgate-prefill-pod"] == "g0-prefill"
        assert "extra-model" in [m.id for m in (await client.models.list()).data]
    finally:
        (sim.config_dir / "extra.yaml").unlink()
        write_yaml(sim.config_dir / "pods.yaml", [pod_manifest(s) for s in specs])
        await asyncio.sleep(1.0)


@pytest.fixture
def fragile_cluster(tmp_path: Path) -> Iterator[tuple[SimCluster, int]]:
    """Its own pods and Mooncake master, so a test may kill a pod.

    A killed pod takes its share of the store's memory with it, and other pods' writes
    fail until the master notices: that must not leak into the shared session master.
    """
    master = MooncakeMaster(log_path=tmp_path / "mooncake-master.log").start()
    sim = SimCluster(master, tmp_path)
    specs = [
        SimPodSpec(name=f"{g}-{r}", ip=f"{FRAGILE_NET}.{base + i}", role=r, group=g,
                   labels={"app": "fragile", "group": g, "role": r})
        for g, base in (("g0", 51), ("g1", 61))
        for i, r in enumerate(("prefill", "decode"))
    ]
    port = free_port([s.ip for s in specs])
    try:
        for spec in specs:
            sim.start_pod(spec, port, MODEL, ["--fast"])
        sim.wait_pods(port, specs)
        write_yaml(sim.config_dir / "server.yaml",
                   pd_server_manifests("fragile", MODEL, port=port, retry_attempts=3))
        write_yaml(sim.config_dir / "pods.yaml", [pod_manifest(s) for s in specs])
        sim.start_router()
        yield sim, port
    finally:
        sim.stop()
        master.stop()


async def test_killed_prefill_pod_is_retried_on_other_group(
    fragile_cluster: tuple[SimCluster, int],
) -> None:
    sim, _ = fragile_cluster
    sim.pods["g0-prefill"].kill()  # still listed as Ready: the router finds out by failing
    client = openai.AsyncOpenAI(base_url=f"{sim.router_url}/v1", api_key="x", max_retries=0)
    # The two idle groups tie, and a tie is broken at random: a fixed six requests all
    # drew g1 one run in 64 (a fresh clone saw it) and the dead pod was never tried. Go on
    # until it has been (each request is a fresh coin toss: 40 misses, 1 in 10^12).
    sent, retried = 0, 0.0
    while retried < 1 and sent < 40:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": f"retry me {sent}"}], max_tokens=3
        )
        sent += 1
        assert raw.headers["x-pdgate-prefill-pod"] == "g1-prefill"
        assert raw.headers["x-pdgate-decode-pod"] == "g1-decode"
        metrics = sim.router_metrics()
        retried = sum(v for _, v in metric_values(metrics, "pdgate_retries_total"))
    assert retried >= 1
    assert _router_requests(metrics, "200") == sent
    assert all(v == 0 for _, v in metric_values(metrics, "pdgate_inflight_requests"))
    wait_http(f"{sim.router_url}/readyz")


async def test_dashboard_queries_only_metrics_a_live_router_exposes(
    cluster: tuple[SimCluster, int], client: openai.AsyncOpenAI
) -> None:
    """Every series the shipped Grafana dashboard plots has samples on this router."""
    from tests.unit.test_deploy_dashboard import queried_metrics

    stream = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=2, stream=True
    )
    async for _ in stream:
        pass
    metrics = cluster[0].router_metrics()
    sampled = {line.split("{")[0].split(" ")[0] for line in metrics.splitlines()
               if line and not line.startswith("#")}
    for name in queried_metrics():
        # A histogram is queried through its buckets. A labelled counter nobody incremented
        # yet (retries), or a histogram nobody observed yet (the output rate, when this
        # module's only stream came in one read), is still declared.
        assert name in sampled or f"{name}_bucket" in sampled or any(
            f"# TYPE {name} {kind}" in metrics for kind in ("counter", "histogram")
        ), f"{name} is on the dashboard but not on /metrics"
