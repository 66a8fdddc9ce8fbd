"""A real peer drives the simulated pods: vLLM Router (`vllm-router`, Rust, pinned 0.1.17) in
`--vllm-pd-disaggregation` mode, first with `--kv-connector mooncake` (bootstrap `/query` +
transfer_id), then with `--kv-connector nixl` (the sequential handle).

This proves the simulator speaks both PD protocols as a real router expects, not only as
pdgate does: every answer must be `expected_text(kv_from_store=True)`, which only a decode pod
that read prefill's KV from the Mooncake Store can produce, and the pods' `/sim/stats` must
show the transfers. Two prefill and two decode pods on their own 127.x addresses; loopback
only, free ports, bounded waits; the router is stopped at the end of each mode.
"""

from __future__ import annotations

import shutil
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from engine_sim.generation import expected_text
from tests.integration.harness import (
    Process,
    SimCluster,
    SimPodSpec,
    free_port,
    get_json,
    loopback_net,
)
from tests.sim_tokens import chat_ids, prompt_ids

pytestmark = pytest.mark.integration

MODEL = "sim-interop-model"
VLLM_ROUTER_VERSION = "0.1.17"
ROUTER_READY_TIMEOUT_S = 60.0
NET = loopback_net()
PREFILLS = (f"{NET}.1", f"{NET}.2")
DECODES = (f"{NET}.11", f"{NET}.12")
LONG_PROMPT = "Tell me a story about rivers and mountains. " * 12  # several full KV blocks


def _router_binary() -> str:
    beside = Path(sys.executable).with_name("vllm-router")
    found = str(beside) if beside.exists() else shutil.which("vllm-router")
    if found is None:
        pytest.skip(f"vllm-router is not installed: pip install vllm-router=={VLLM_ROUTER_VERSION}")
    return found


@dataclass
class Pods:
    sim: SimCluster
    port: int
    bootstrap_port: int
    specs: list[SimPodSpec]

    def url(self, ip: str) -> str:
        return f"http://{ip}:{self.port}"

    def stats(self, ip: str) -> dict[str, Any]:
        answer = get_json(f"{self.url(ip)}/sim/stats")
        assert isinstance(answer, dict)
        return answer

    def totals(self) -> dict[str, int]:
        out = {"published": 0, "claimed": 0, "blocks_read": 0, "blocks_exported": 0}
        out |= {"prefills": 0, "decodes": 0, "errors": 0, "local_decodes": 0}
        for ip in PREFILLS:
            stats = self.stats(ip)
            out["published"] += stats["mooncake_vllm"]["transfers_published"]
            out["prefills"] += stats["requests"]["prefill"]
            out["errors"] += stats["errors"]
            out["blocks_exported"] += stats["kv_blocks_written"] + stats["kv_blocks_write_skipped"]
        for ip in DECODES:
            stats = self.stats(ip)
            out["claimed"] += stats["mooncake_vllm"]["transfers_claimed"]
            out["blocks_read"] += stats["kv_blocks_read"]
            out["decodes"] += stats["requests"]["decode"]
            out["errors"] += stats["errors"]
            out["local_decodes"] += sum(
                1 for r in stats["recent"] if r["kind"] == "decode" and not r["kv_from_store"]
            )
        return out


@pytest.fixture(scope="module")
def pods(mooncake_master: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pods]:
    _router_binary()  # skip before starting anything
    sim = SimCluster(mooncake_master, tmp_path_factory.mktemp("vllm-router-pods"))
    specs = [
        SimPodSpec(name=f"{role}-{i}", ip=ip, role=role)
        for role, ips in (("prefill", PREFILLS), ("decode", DECODES))
        for i, ip in enumerate(ips)
    ]
    port = free_port([spec.ip for spec in specs])
    bootstrap_port = free_port(list(PREFILLS))
    while bootstrap_port == port:
        bootstrap_port = free_port(list(PREFILLS))
    try:
        for spec in specs:
            sim.start_pod(spec, port, MODEL, ["--fast", "--bootstrap-port", str(bootstrap_port),
                                              "--engine-id", f"eng-{spec.name}"])  # fmt: skip
        sim.wait_pods(port, specs)
        yield Pods(sim, port, bootstrap_port, specs)
    finally:
        sim.stop()


def _free_local_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Peer:
    mode: str  # --kv-connector
    policy: str
    process: Process
    url: str

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)


def _wait_ready(peer: Peer) -> None:
    deadline = time.monotonic() + ROUTER_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if not peer.process.alive():
            pytest.fail(f"vllm-router exited at start:\n{peer.process.log()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{peer.url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)
    pytest.fail(
        f"vllm-router not ready in {ROUTER_READY_TIMEOUT_S} s:\n{peer.process.log()[-4000:]}"
    )


# cache_aware makes vllm-router call /v1/*/render on both pods before each request.
@pytest.fixture(
    scope="module",
    params=[("mooncake", "round_robin"), ("nixl", "round_robin"), ("mooncake", "cache_aware")],
    ids=lambda p: "-".join(p),
)
def peer(
    request: pytest.FixtureRequest, pods: Pods, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Peer]:
    mode, policy = request.param
    port = _free_local_port()
    argv = [
        _router_binary(), "--vllm-pd-disaggregation", "--kv-connector", mode,
        "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_local_port()),
        "--worker-startup-timeout-secs", "30", "--log-level", "info",
    ]  # fmt: skip
    for ip in PREFILLS:
        argv += ["--prefill", pods.url(ip)]
        if mode == "mooncake":
            argv.append(str(pods.bootstrap_port))
    for ip in DECODES:
        argv += ["--decode", pods.url(ip)]
    log = tmp_path_factory.mktemp(f"vllm-router-{mode}-{policy}") / "router.log"
    found = Peer(mode, policy, Process(argv, log), f"http://127.0.0.1:{port}")
    found.process.start()
    try:
        _wait_ready(found)
        yield found
    finally:
        found.process.stop(timeout=10)
    assert found.process.popen is not None and found.process.popen.poll() is not None


def _check_transfers(peer: Peer, before: dict[str, int], after: dict[str, int], n: int) -> None:
    """`n` requests went through prefill then decode, and each decode read prefill's KV."""
    assert after["errors"] == before["errors"]
    assert after["prefills"] - before["prefills"] == n
    assert after["decodes"] - before["decodes"] == n
    assert after["local_decodes"] == before["local_decodes"]
    assert after["blocks_read"] - before["blocks_read"] >= 2 * n
    assert after["blocks_exported"] - before["blocks_exported"] >= 2 * n
    moved = n if peer.mode == "mooncake" else 0  # the transfer-id rendezvous is mooncake's
    assert after["published"] - before["published"] == moved
    assert after["claimed"] - before["claimed"] == moved


async def test_chat_streaming_and_not(peer: Peer, pods: Pods) -> None:
    client = peer.client()
    before = pods.totals()
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": f"{peer.mode}: " + LONG_PROMPT}
    ]
    expected = expected_text(chat_ids(list(messages)), 12, kv_from_store=True, model=MODEL)
    assert expected != expected_text(
        chat_ids(list(messages)), 12, kv_from_store=False, model=MODEL
    )
    completion = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)
    assert completion.choices[0].message.content == expected
    assert completion.usage is not None and completion.usage.completion_tokens == 12
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    pieces: list[str] = []
    usage = None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == expected
    assert usage is not None and usage.completion_tokens == 12
    _check_transfers(peer, before, pods.totals(), 2)
    if peer.mode == "mooncake":  # it read each prefill's engine id from /query at start
        for ip in PREFILLS:
            bootstrap = pods.stats(ip)["mooncake_vllm"]["bootstrap"]
            assert bootstrap["port"] == pods.bootstrap_port and bootstrap["queries"] >= 1


async def test_completions_streaming_and_not_across_every_pod(peer: Peer, pods: Pods) -> None:
    client = peer.client()
    before = pods.totals()
    served = {ip: _served(pods, ip) for ip in (*PREFILLS, *DECODES)}
    for i in range(4):  # round robin: every prefill and every decode pod serves twice
        prompt = f"{peer.mode} {i}: " + LONG_PROMPT
        expected = expected_text(prompt_ids(prompt), 6, kv_from_store=True, model=MODEL)
        if i % 2:
            stream = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=6, stream=True
            )
            text = "".join([c.choices[0].text async for c in stream if c.choices])
        else:
            completion = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=6)
            text = completion.choices[0].text
        assert text == expected
    _check_transfers(peer, before, pods.totals(), 4)
    if peer.policy == "round_robin":
        for ip, count in served.items():
            assert _served(pods, ip) - count == 2, ip
    for ip in DECODES:
        records = pods.stats(ip)["recent"][-2:]
        assert all(r["kind"] == "decode" and r["kv_from_store"] for r in records)
        assert all(r["blocks"] >= 2 for r in records)


def _served(pods: Pods, ip: str) -> int:
    requests = pods.stats(ip)["requests"]
    return int(requests["prefill"] + requests["decode"])
