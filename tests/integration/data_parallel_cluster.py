"""What the data-parallel end-to-end tests share: a router over simulated data-parallel
pods, read through the official SDK, the pods' `/sim/stats` and the router's metrics.

A test computes a prompt on one rank by sending it to the pod directly, pinned with
`X-data-parallel-rank` (the rank itself behind one API server for every rank, its local
index on a node of a hybrid deployment), and waits for that rank's KV events to reach the
router. Events published before the router's SUB socket joined are lost (no replay with
several ranks a pod), so `wait_subscribed` has each rank compute fresh prompts until one
of its batches arrives.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

from engine_sim.prompts import DEFAULT_CHAT_TEMPLATE, DEFAULT_TOKENIZER
from tests.integration.harness import (
    PRECISE_SCHEDULER,
    SimCluster,
    SimPodSpec,
    free_port,
    get_json,
    metric_values,
    pd_server_manifests,
    pod_manifest,
    write_yaml,
)

#: How long `wait_subscribed` gives one rank's batch to reach the router, per attempt.
BATCH_WAIT_S = 0.2


def messages(topic: str, question: str) -> list[dict[str, str]]:
    """A chat whose long system prompt spans many KV blocks (16 tokens each)."""
    system = f"You answer questions about {topic}, at length and with care. " * 20
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def served_by(header: str) -> tuple[str, int]:
    """`pod/dp<rank>` (an `x-pdgate-*-pod` header) as (pod, rank)."""
    pod, _, rank = header.partition("/dp")
    return pod, int(rank)


@dataclass
class DPCluster:
    sim: SimCluster
    port: int
    #: The aggregated model that `compute_at` asks for.
    model: str

    def client(self) -> openai.AsyncOpenAI:
        return self.sim.client()

    def metric(self, name: str) -> float:
        return sum(value for _, value in metric_values(self.sim.router_metrics(), name))

    def batches(self) -> float:
        return self.metric("pdgate_kv_event_batches_total")

    def last_record(self, spec: SimPodSpec, rank: int) -> dict[str, Any]:
        """The last request global rank `rank` of the pod served."""
        stats = get_json(f"http://{spec.ip}:{self.port}/sim/stats?rank={rank}")
        records: list[dict[str, Any]] = stats["recent"]
        return records[-1]

    def compute_at(self, spec: SimPodSpec, pin: int, topic: str) -> None:
        """A chat sent to the pod directly (past the router), pinned with `pin`."""
        body = json.dumps({"model": self.model, "messages": messages(topic, "warm"),
                           "max_tokens": 1}).encode()
        request = urllib.request.Request(
            f"http://{spec.ip}:{self.port}/v1/chat/completions", data=body,
            headers={"Content-Type": "application/json", "X-data-parallel-rank": str(pin)})
        with urllib.request.urlopen(request, timeout=10):
            pass

    def wait_subscribed(self, ranks: Sequence[tuple[SimPodSpec, int]]) -> None:
        """Until the router reads each (pod, pin)'s stream (see the module docstring)."""
        for spec, pin in ranks:
            for attempt in range(50):
                batches = self.batches()
                self.compute_at(spec, pin, f"subscribed-{spec.name}-{pin}-{attempt}")
                deadline = time.monotonic() + BATCH_WAIT_S
                while self.batches() == batches and time.monotonic() < deadline:
                    time.sleep(0.01)
                if self.batches() > batches:
                    break
            else:
                raise AssertionError(f"{spec.name} rank {pin}'s KV events never came")


@dataclass(frozen=True)
class DPServer:
    """One ModelServer of the test cluster: its name, model and simulated pods."""

    name: str
    model: str
    pods: Sequence[SimPodSpec]


@contextmanager
def running_cluster(
    master: object, workdir: Path, agg: DPServer, pd: DPServer, ranks: Mapping[str, str],
    pod_flags: Callable[[SimPodSpec], list[str]], subscribe: Sequence[tuple[SimPodSpec, int]],
) -> Iterator[DPCluster]:
    """Simulated data-parallel pods (`pod_flags` each), an aggregated ModelServer and a PD
    one over upstream vLLM's Mooncake flow, both annotated `ranks`, and the router over
    them, once it reads each of `subscribe`'s (pod, pin) streams; stopped on exit."""
    sim = SimCluster(master, workdir)
    pods = [*agg.pods, *pd.pods]
    ips = [spec.ip for spec in pods]
    port = free_port(ips)
    bootstrap = free_port(ips)
    while bootstrap == port:
        bootstrap = free_port(ips)
    try:
        for server in (agg, pd):
            for spec in server.pods:
                sim.start_pod(spec, port, server.model, [
                    "--fast", *pod_flags(spec), "--bootstrap-port", str(bootstrap),
                    "--kv-wait-timeout", "10"])
        sim.wait_pods(port, pods)
        notes = {**ranks, "pdgate.io/tokenizer": DEFAULT_TOKENIZER,
                 "pdgate.io/chat-template": str(DEFAULT_CHAT_TEMPLATE)}
        agg_objects = pd_server_manifests(agg.name, agg.model, pd=False, port=port,
                                          connector="http", annotations=notes)
        pd_objects = pd_server_manifests(
            pd.name, pd.model, port=port, connector="mooncake",
            annotations={**notes, "pdgate.io/mooncake-protocol": "vllm",
                         "pdgate.io/mooncake-bootstrap-port": str(bootstrap)},
        )
        write_yaml(sim.config_dir / "objects.yaml",
                   [*agg_objects, *pd_objects, *(pod_manifest(spec) for spec in pods)])
        scheduler = sim.workdir / "scheduler.yaml"
        scheduler.write_text(PRECISE_SCHEDULER)
        sim.start_router(["--scheduler-config", str(scheduler)])
        cluster = DPCluster(sim, port, agg.model)
        cluster.wait_subscribed(subscribe)
        yield cluster
    finally:
        sim.stop()
