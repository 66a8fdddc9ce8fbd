"""LoRA adapters end to end: the adapter's name reaches the engine, and its KV is its own.

Two simulated vLLM pods serve a base model and the adapter `sql-lora` (`--lora-modules`,
as vLLM); one ModelServer selects both and names the base model (`spec.model`), and its
ModelRoute serves the base model and the adapter (`loraAdapters`). The router scores with
the precise prefix index (the pods' KV events, the real DeepSeek tokenizer).

vLLM puts the adapter's name in every block's hash: an adapter's prompt never reuses the
base model's blocks of the same tokens. The router must predict exactly that: no hit for
the adapter's first request whatever the base model cached, then the adapter's own hit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from engine_sim.prompts import DEFAULT_CHAT_TEMPLATE, DEFAULT_TOKENIZER
from tests.integration.harness import (
    PRECISE_SCHEDULER,
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
from tests.sim_tokens import chat_ids

pytestmark = pytest.mark.integration

BASE = "m-base"
ADAPTER = "sql-lora"
NET = loopback_net()
PODS = (SimPodSpec("lora-0", f"{NET}.51", "both", labels={"app": "lora"}),
        SimPodSpec("lora-1", f"{NET}.52", "both", labels={"app": "lora"}))
SYSTEM = "You translate questions about tables into SQL. " * 30  # many full blocks


@dataclass
class Lora:
    cluster: SimCluster
    port: int

    def client(self) -> openai.AsyncOpenAI:
        return self.cluster.client()

    def precise(self, name: str) -> float:
        for head, value in metric_values(self.cluster.router_metrics(), name):
            if 'index="precise"' in head:
                return value
        return 0.0

    def pod_json(self, spec: SimPodSpec, path: str) -> Any:
        return get_json(f"http://{spec.ip}:{self.port}{path}")

    def last_record(self, pod_name: str) -> dict[str, Any]:
        spec = next(s for s in PODS if s.name == pod_name)
        records: list[dict[str, Any]] = self.pod_json(spec, "/sim/stats")["recent"]
        return records[-1]


@pytest.fixture(scope="module")
def lora(mooncake_master: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lora]:
    cluster = SimCluster(mooncake_master, tmp_path_factory.mktemp("lora"))
    port = free_port([spec.ip for spec in PODS])
    try:
        for spec in PODS:
            cluster.start_pod(spec, port, BASE,
                              ["--fast", "--lora-modules", f"{ADAPTER}=/adapters/{ADAPTER}"])
        cluster.wait_pods(port, PODS)
        route, server = pd_server_manifests(
            "lora", BASE, pd=False, port=port, connector="http",
            annotations={"pdgate.io/tokenizer": DEFAULT_TOKENIZER,
                         "pdgate.io/chat-template": str(DEFAULT_CHAT_TEMPLATE),
                         "pdgate.io/kv-events-replay-port": "0"},
        )
        route["spec"]["loraAdapters"] = [ADAPTER]  # type: ignore[index]
        server["spec"]["model"] = BASE  # type: ignore[index]
        write_yaml(cluster.config_dir / "objects.yaml",
                   [route, server, *(pod_manifest(spec) for spec in PODS)])
        scheduler = cluster.workdir / "scheduler.yaml"
        scheduler.write_text(PRECISE_SCHEDULER)
        cluster.start_router(["--scheduler-config", str(scheduler)])
        yield Lora(cluster, port)
    finally:
        cluster.stop()


def messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


async def ask(lora: Lora, model: str, question: str) -> tuple[str, dict[str, Any]]:
    """One chat through the router: the pod that served it and its engine's record."""
    raw = await lora.client().chat.completions.with_raw_response.create(
        model=model, messages=messages(question), max_tokens=2)  # type: ignore[arg-type]
    answer = raw.parse()
    assert answer.model == model  # the engine was asked for this name, not the base's
    pod = raw.headers["x-pdgate-decode-pod"]
    await asyncio.sleep(0.3)  # the engine's KV events reach the router's index
    return pod, lora.last_record(pod)


def test_pods_list_the_adapter_as_vllm_does(lora: Lora) -> None:
    cards = {card["id"]: card for card in lora.pod_json(PODS[0], "/v1/models")["data"]}
    assert cards[BASE]["parent"] is None
    assert cards[ADAPTER]["parent"] == BASE and cards[ADAPTER]["root"] == f"/adapters/{ADAPTER}"


async def test_an_adapters_prompt_keys_the_adapters_blocks_not_the_base_models(
    lora: Lora,
) -> None:
    blocks = len(chat_ids(messages("base"))) // 16
    assert blocks >= 10
    # The base model computes the prompt, then hits it.
    pod, record = await ask(lora, BASE, "q1")
    assert record["cached_tokens"] == 0
    hits = lora.precise("pdgate_prefix_cache_hits_total")
    again, record = await ask(lora, BASE, "q2")
    assert again == pod and record["cached_tokens"] >= (blocks - 1) * 16
    assert lora.precise("pdgate_prefix_cache_hits_total") - hits >= blocks - 1
    # The adapter's first request: the same tokens, none of them cached for the adapter;
    # the router's index knows it (no hit counted), wherever the request went.
    hits = lora.precise("pdgate_prefix_cache_hits_total")
    adapter_pod, record = await ask(lora, ADAPTER, "q3")
    assert record["cached_tokens"] == 0
    assert lora.precise("pdgate_prefix_cache_hits_total") == hits
    # Its second: the adapter's own blocks, on the pod that holds them, predicted as hit.
    again, record = await ask(lora, ADAPTER, "q4")
    assert again == adapter_pod and record["cached_tokens"] >= (blocks - 1) * 16
    assert lora.precise("pdgate_prefix_cache_hits_total") - hits >= blocks - 1
