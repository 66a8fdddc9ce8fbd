"""pdgate's upstream-vLLM Mooncake path end to end: real Mooncake master, simulated pods with
bootstrap servers, the router, the openai SDK.

ModelServers use `kvConnector.type: mooncake` with `pdgate.io/mooncake-protocol: vllm`, so
the router asks each prefill pod's bootstrap server `/query`, makes up a transfer_id and
sends prefill and decode at once. Decode's answer is a deterministic function of the KV it
read from the store, so `expected_text(kv_from_store=True)` proves the rendezvous worked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from engine_sim.generation import expected_text
from tests.integration.harness import (
    POD_ADDRESS_PREFIX,
    SimCluster,
    SimPodSpec,
    free_port,
    get_json,
    loopback_net,
    metric_values,
    pd_server_manifests,
    pod_manifest,
    write_yaml,
)
from tests.sim_tokens import chat_ids, prompt_ids

pytestmark = pytest.mark.integration

MODEL = "sim-mc-vllm"
RETRY_MODEL = "sim-mc-retry"
BAD_MODEL = "sim-mc-bad"
LONG_PROMPT = "Tell me a story about rivers and mountains. " * 12  # several full KV blocks


def _annotations(bootstrap_port: int) -> dict[str, str]:
    return {
        "pdgate.io/mooncake-protocol": "vllm",
        "pdgate.io/mooncake-bootstrap-port": str(bootstrap_port),
    }


def _specs(
    app: str, base: str, prefill_flags: dict[str, list[str]] | None = None
) -> list[SimPodSpec]:
    """Groups g0 (`base`.1, .2) and g1 (`base`.11, .12) of `app`; pods named app-group-role."""
    flags = prefill_flags or {}
    specs = []
    for group, last in (("g0", 1), ("g1", 11)):
        for offset, role in enumerate(("prefill", "decode")):
            specs.append(SimPodSpec(
                name=f"{app}-{group}-{role}", ip=f"{base}.{last + offset}", role=role,
                group=group, labels={"app": app, "group": group, "role": role},
                flags=flags.get(group, []) if role == "prefill" else [],
            ))  # fmt: skip
    return specs


@dataclass
class Cluster:
    sim: SimCluster
    specs: list[SimPodSpec]
    port: int

    def stats(self, name: str) -> dict[str, Any]:
        spec = next(s for s in self.specs if s.name == name)
        answer = get_json(f"http://{spec.ip}:{self.port}/sim/stats")
        assert isinstance(answer, dict)
        return answer

    def totals(self) -> dict[str, int]:
        """Counters summed over the pods of each role."""
        out = {"published": 0, "claimed": 0, "blocks_read": 0, "decode_errors": 0, "queries": 0}
        for spec in self.specs:
            stats = self.stats(spec.name)
            mooncake = stats["mooncake_vllm"]
            if spec.role == "prefill":
                out["published"] += mooncake["transfers_published"]
                out["queries"] += mooncake["bootstrap"]["queries"]
            else:
                out["claimed"] += mooncake["transfers_claimed"]
                out["blocks_read"] += stats["kv_blocks_read"]
                out["decode_errors"] += stats["errors"]
        return out

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.sim.router_url}/v1", api_key="unused", max_retries=0
        )

    def metric(self, name: str, **labels: str) -> float:
        wanted = [f'{key}="{value}"' for key, value in labels.items()]
        return sum(
            value
            for found, value in metric_values(self.sim.router_metrics(), name)
            if all(label in found for label in wanted)
        )


def _start(
    master: object, workdir: Path, servers: list[tuple[str, str, list[SimPodSpec], int]]
) -> Cluster:
    """Start every pod on one shared HTTP port and one bootstrap port, then the router.

    `servers`: (ModelServer name, model, pods, retry attempts).
    """
    sim = SimCluster(master, workdir)
    specs = [spec for *_, group, _ in servers for spec in group]
    ips = [spec.ip for spec in specs]
    port = free_port(ips)
    bootstrap_port = free_port(ips)
    while bootstrap_port == port:
        bootstrap_port = free_port(ips)
    extra = ["--fast", "--bootstrap-port", str(bootstrap_port), "--kv-wait-timeout", "10"]
    docs: list[dict[str, object]] = []
    try:
        for name, model, group, attempts in servers:
            for spec in group:
                sim.start_pod(spec, port, model, extra)
            docs += pd_server_manifests(
                name, model, connector="mooncake", port=port, retry_attempts=attempts,
                annotations=_annotations(bootstrap_port),
            )  # fmt: skip
        sim.wait_pods(port, specs)
        write_yaml(sim.config_dir / "servers.yaml", docs)
        write_yaml(sim.config_dir / "pods.yaml", [pod_manifest(s) for s in specs])
        sim.start_router()
    except BaseException:
        sim.stop()
        raise
    return Cluster(sim, specs, port)


@pytest.fixture(scope="module")
def cluster(mooncake_master: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    specs = _specs("mcv", loopback_net())
    started = _start(
        mooncake_master, tmp_path_factory.mktemp("mc-vllm"), [("mcv", MODEL, specs, 2)]
    )
    try:
        yield started
    finally:
        started.sim.stop()


def _group(pod_name: str | None) -> str:
    assert pod_name is not None
    return pod_name.split("-")[1]


async def test_chat_non_streaming_decode_reads_prefill_kv(cluster: Cluster) -> None:
    before = cluster.totals()
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": LONG_PROMPT}]
    raw = await cluster.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=12
    )
    completion = raw.parse()
    prompt = chat_ids(list(messages))
    assert completion.choices[0].message.content == expected_text(
        prompt, 12, kv_from_store=True, model=MODEL
    )
    assert completion.choices[0].message.content != expected_text(
        prompt, 12, kv_from_store=False, model=MODEL
    )
    prefill, decode = raw.headers["x-pdgate-prefill-pod"], raw.headers["x-pdgate-decode-pod"]
    assert _group(prefill) == _group(decode)
    after = cluster.totals()
    assert after["published"] - before["published"] == 1
    assert after["claimed"] - before["claimed"] == 1
    assert after["blocks_read"] - before["blocks_read"] >= 2
    # The router asks /query on every attempt; decode asks once per engine id it meets.
    assert after["queries"] - before["queries"] in (1, 2)
    record = cluster.stats(decode)["recent"][-1]
    assert record["kind"] == "decode" and record["kv_from_store"] is True
    record = cluster.stats(prefill)["recent"][-1]
    assert record["kind"] == "prefill" and record["blocks"] >= 2


async def test_chat_streaming_with_usage(cluster: Cluster) -> None:
    before = cluster.totals()
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Stream me " + LONG_PROMPT}
    ]
    stream = await cluster.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
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
        chat_ids(list(messages)), 20, kv_from_store=True, model=MODEL
    )
    assert chunks >= 20
    assert usage is not None and usage.completion_tokens == 20
    assert cluster.totals()["claimed"] - before["claimed"] == 1


async def test_completions_streaming_and_not(cluster: Cluster) -> None:
    client = cluster.client()
    expected = expected_text(prompt_ids(LONG_PROMPT), 8, kv_from_store=True, model=MODEL)
    completion = await client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=8)
    assert completion.choices[0].text == expected
    stream = await client.completions.create(
        model=MODEL, prompt=LONG_PROMPT, max_tokens=8, stream=True
    )
    assert "".join([chunk.choices[0].text async for chunk in stream if chunk.choices]) == expected


async def test_concurrent_requests_each_meet_their_own_prefill(cluster: Cluster) -> None:
    before = cluster.totals()
    client = cluster.client()

    async def one(i: int) -> tuple[str, str]:
        prompt = f"Question {i}: " + LONG_PROMPT
        raw = await client.completions.with_raw_response.create(
            model=MODEL, prompt=prompt, max_tokens=4
        )
        assert raw.parse().choices[0].text == expected_text(
            prompt_ids(prompt), 4, kv_from_store=True, model=MODEL
        )
        return raw.headers["x-pdgate-prefill-pod"], raw.headers["x-pdgate-decode-pod"]

    pairs = await asyncio.gather(*(one(i) for i in range(16)))
    assert all(_group(p) == _group(d) for p, d in pairs)
    assert {_group(p) for p, _ in pairs} == {"g0", "g1"}
    after = cluster.totals()
    assert after["published"] - before["published"] == 16
    assert after["claimed"] - before["claimed"] == 16
    assert after["decode_errors"] == before["decode_errors"]


@pytest.fixture(scope="module")
def faulty(mooncake_master: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """`retry`: g0's bootstrap server answers garbage, g1's is sound. `bad`: g0's answers JSON
    without an engine id, g1's is down (connections refused)."""
    retry = _specs("retry", loopback_net(), {"g0": ["--bootstrap-fault", "garbage"]})
    bad = _specs(
        "bad", loopback_net(),
        {"g0": ["--bootstrap-fault", "malformed"], "g1": ["--bootstrap-fault", "down"]},
    )  # fmt: skip
    started = _start(
        mooncake_master,
        tmp_path_factory.mktemp("mc-vllm-faults"),
        [("retry", RETRY_MODEL, retry, 3), ("bad", BAD_MODEL, bad, 2)],
    )
    try:
        yield started
    finally:
        started.sim.stop()


async def test_bad_bootstrap_answer_is_retried_on_the_other_group(faulty: Cluster) -> None:
    client = faulty.client()
    retries_before = faulty.metric("pdgate_retries_total", model=RETRY_MODEL)
    for i in range(24):  # until the scheduler has tried g0 at least once (bounded)
        if i >= 6 and faulty.metric("pdgate_retries_total", model=RETRY_MODEL) > retries_before:
            break
        prompt = f"retry {i}: " + LONG_PROMPT
        raw = await client.completions.with_raw_response.create(
            model=RETRY_MODEL, prompt=prompt, max_tokens=5
        )
        assert raw.headers["x-pdgate-prefill-pod"] == "retry-g1-prefill"
        assert raw.headers["x-pdgate-decode-pod"] == "retry-g1-decode"
        assert raw.parse().choices[0].text == expected_text(
            prompt_ids(prompt), 5, kv_from_store=True, model=RETRY_MODEL
        )
    assert faulty.metric("pdgate_retries_total", model=RETRY_MODEL) > retries_before
    assert faulty.metric("pdgate_upstream_errors_total", reason="bad_bootstrap") >= 1
    # The sick pod was asked /query but never sent a prefill, nor its partner a decode.
    sick = faulty.stats("retry-g0-prefill")
    assert sick["mooncake_vllm"]["bootstrap"]["queries"] >= 1
    assert sick["requests"]["prefill"] == 0
    assert faulty.stats("retry-g0-decode")["requests"]["decode"] == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_every_bootstrap_bad_is_a_clean_502(faulty: Cluster, stream: bool) -> None:
    client = faulty.client()
    failed_before = faulty.metric("pdgate_requests_total", model=BAD_MODEL, status="502")
    with pytest.raises(openai.APIStatusError) as caught:
        await client.chat.completions.create(
            model=BAD_MODEL, messages=[{"role": "user", "content": "hi"}], stream=stream
        )
    assert caught.value.status_code == 502
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "bad_bootstrap"
    assert "bootstrap server" in error["message"] and POD_ADDRESS_PREFIX not in error["message"]
    assert faulty.metric("pdgate_requests_total", model=BAD_MODEL, status="502") == (
        failed_before + 1
    )
    assert faulty.stats("bad-g0-prefill")["mooncake_vllm"]["bootstrap"]["queries"] >= 1
    assert faulty.stats("bad-g1-prefill")["mooncake_vllm"]["bootstrap"]["port"] is None
    for name in ("bad-g0-decode", "bad-g1-decode"):  # no decode for an unusable prefill
        assert faulty.stats(name)["requests"]["decode"] == 0
