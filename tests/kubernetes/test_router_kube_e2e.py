"""The router fed by the Kubernetes source, end to end: fake API server, real client,
simulated pods moving KV through a real Mooncake Store, and the openai SDK.

The router runs in-process (uvicorn in this event loop) so a test can see the exact
moment a watch event reached the router's view and assert on every request after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import uvicorn
from fake_apiserver import FakeApiServer
from kube_objects import model_route, model_server, pod
from kube_testkit import FAST_EVENTS, FAST_TIMING, wait_until
from prometheus_client import CollectorRegistry

from engine_sim.generation import expected_text
from router.app import PDGateApp
from router.sources.kubernetes import KubernetesSource
from router.state import AppState, RouterConfig
from tests.integration.harness import SimCluster, SimPodSpec, free_port, loopback_net
from tests.sim_tokens import chat_ids

MODEL = "deepseek_v4"
SERVER = "deepseekv4-pd"
ADAPTER = "deepseek-lora"
NET = loopback_net()
PODS = {  # name: (ip, role, group)
    "pd-g0-prefill": (f"{NET}.71", "prefill", "g0"),
    "pd-g0-decode": (f"{NET}.72", "decode", "g0"),
    "pd-g1-prefill": (f"{NET}.81", "prefill", "g1"),
    "pd-g1-decode": (f"{NET}.82", "decode", "g1"),
}


@dataclass
class KubeCluster:
    api: FakeApiServer
    state: AppState
    url: str
    port: int

    def pod_names_in_view(self) -> set[str]:
        names: set[str] = set()
        for server in self.state.view.snapshot.servers.values():
            for group in server.groups:
                names.update(ep.pod_name for ep in group.prefill + group.decode)
        return names

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def sim_pods(mooncake_master: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    sim = SimCluster(mooncake_master, tmp_path_factory.mktemp("kube-e2e"))
    port = free_port([ip for ip, _, _ in PODS.values()])
    specs = [SimPodSpec(name, ip, role, group) for name, (ip, role, group) in PODS.items()]
    try:
        for spec in specs:
            # The engines serve the LoRA adapter a test adds to the route (as vLLM would
            # have to: the router sends an adapter's requests by the adapter's name).
            sim.start_pod(spec, port, MODEL,
                          ["--itl-ms", "3", "--lora-modules", f"{ADAPTER}=/adapters/{ADAPTER}"])
        sim.wait_pods(port, specs)
        yield port
    finally:
        sim.stop()


@pytest.fixture
async def cluster(sim_pods: int, tmp_path: Path) -> AsyncIterator[KubeCluster]:
    api = FakeApiServer(bookmark_interval=0.5)
    await api.start()
    api.create(model_route("deepseek-v4", MODEL, [SERVER]))
    api.create(model_server(SERVER, port=sim_pods))
    for name, (ip, role, group) in PODS.items():
        api.create(pod(name, SERVER, role=role, group=group, ip=ip))
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    source = KubernetesSource(
        "default", str(kubeconfig), CollectorRegistry(), timing=FAST_TIMING,
        event_limits=FAST_EVENTS,
    )
    state = AppState(RouterConfig(extra_sources=[source]))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(
        PDGateApp(state), host="127.0.0.1", port=port, lifespan="on", log_level="warning",
    ))
    serving = asyncio.create_task(server.serve())
    try:
        await wait_until(lambda: server.started and state.ready, within_s=15)
        yield KubeCluster(api, state, f"http://127.0.0.1:{port}", port)
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        await api.stop()


async def test_kthena_objects_applied_then_traffic_flows(cluster: KubeCluster) -> None:
    assert cluster.pod_names_in_view() == set(PODS)
    raw = await cluster.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Where is the capital of China?"}],
        max_tokens=6,
    )
    answer = raw.parse().choices[0].message.content
    assert answer == expected_text(
        chat_ids([{"role": "user", "content": "Where is the capital of China?"}]), 6,
        kv_from_store=True, model=MODEL,
    )
    prefill = raw.headers["x-pdgate-prefill-pod"]
    assert PODS[prefill][2] == PODS[raw.headers["x-pdgate-decode-pod"]][2]


async def test_pod_churn_during_traffic(cluster: KubeCluster) -> None:
    """After the DELETE reaches the view, no new request goes to the deleted pod."""
    client = cluster.client()
    served: list[tuple[float, str]] = []  # (start time, prefill pod)
    stop = asyncio.Event()

    async def load(worker: int) -> None:
        i = 0
        while not stop.is_set():
            began = time.perf_counter()
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": f"w{worker} q{i}"}],
                max_tokens=3,
            )
            served.append((began, raw.headers["x-pdgate-prefill-pod"]))
            i += 1

    workers = [asyncio.create_task(load(w)) for w in range(4)]
    await asyncio.sleep(0.5)
    deleted_at = time.perf_counter()
    cluster.api.delete("Pod", "default", "pd-g0-prefill")
    await wait_until(lambda: "pd-g0-prefill" not in cluster.pod_names_in_view(), interval=0.0005)
    in_view_at = time.perf_counter()
    await asyncio.sleep(1.0)
    stop.set()
    await asyncio.gather(*workers)  # every request succeeded: gather would raise otherwise

    after = [name for began, name in served if began > in_view_at]
    assert len(after) >= 10
    assert "pd-g0-prefill" not in after
    assert any(name == "pd-g0-prefill" for began, name in served if began < deleted_at)
    print(f"pod deletion reached the router's view {1000 * (in_view_at - deleted_at):.1f} ms "
          "after the API server wrote it")


async def test_model_route_edit_mid_stream(cluster: KubeCluster) -> None:
    client = cluster.client()
    messages = [{"role": "user", "content": "stream while the route changes"}]
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=120, stream=True  # ~0.4 s at 3 ms a token
    )
    pieces: list[str] = []
    edited = False
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if not edited and len(pieces) == 3:
            edited = True
            route = model_route("deepseek-v4", MODEL, [SERVER])
            route["spec"]["loraAdapters"] = [ADAPTER]
            cluster.api.update(route)
    assert "".join(pieces) == expected_text(chat_ids(messages), 120, kv_from_store=True,
                                            model=MODEL)
    await wait_until(lambda: ADAPTER in cluster.state.view.snapshot.routes_by_model)
    answer = await client.chat.completions.create(model=ADAPTER, messages=messages, max_tokens=2)
    assert answer.choices[0].message.content and answer.model == ADAPTER
