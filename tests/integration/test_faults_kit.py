"""Helpers of the fault, soak and security suites (no tests here).

A `FaultCluster` is a `SimCluster` of two PD groups whose pods can be made faulty at
runtime through each pod's `/sim/faults`, plus any number of router processes started on
the same config directory (each with its own flags).
"""

from __future__ import annotations

import json
import signal
import sys
import time
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from tests.integration.harness import (
    API_VERSION,
    POD_ADDRESS_PREFIX,
    Process,
    SimCluster,
    SimPodSpec,
    free_port,
    loopback_net,
    metric_values,
    pod_manifest,
    wait_http,
    write_yaml,
)

LEAK_MARKERS = ("Traceback", "10.12.0.7", "worker.py", POD_ADDRESS_PREFIX, "engine_sim fault")


def pd_specs(app: str) -> list[SimPodSpec]:
    """Two PD groups on a net of their own (`loopback_net`): g0 = (prefill .11, decode .12),
    g1 = (.13, .14)."""
    net = loopback_net()
    specs = []
    for g, group in enumerate(("g0", "g1")):
        for r, role in enumerate(("prefill", "decode")):
            specs.append(SimPodSpec(
                name=f"{group}-{role}", ip=f"{net}.{11 + 2 * g + r}", role=role, group=group,
                labels={"app": app, "group": group, "role": role},
            ))
    return specs


def server_manifests(
    name: str,
    model: str,
    *,
    app: str,
    port: int,
    upstream_model: str | None = None,
    retry_attempts: int = 2,
    timeout: str = "30s",
    rate_limit: dict[str, Any] | None = None,
    pd: bool = True,
    annotations: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """A ModelRoute for `model` and a ModelServer `name` over the pods labelled `app`."""
    selector: dict[str, Any] = {"matchLabels": {"app": app}}
    if pd:
        selector["pdGroup"] = {
            "groupKey": "group",
            "prefillLabels": {"role": "prefill"},
            "decodeLabels": {"role": "decode"},
        }
    route_spec: dict[str, Any] = {
        "modelName": model,
        "rules": [{"name": "default", "targetModels": [{"modelServerName": name}]}],
    }
    if rate_limit is not None:
        route_spec["rateLimit"] = rate_limit
    server_spec: dict[str, Any] = {
        "inferenceEngine": "vLLM",
        "workloadPort": {"port": port, "protocol": "http"},
        "workloadSelector": selector,
        "trafficPolicy": {
            "timeout": timeout,
            "retry": {"attempts": retry_attempts, "retryInterval": "20ms"},
        },
        "kvConnector": {"type": "nixl" if pd else "http"},
    }
    if upstream_model is not None:
        server_spec["model"] = upstream_model
    meta: dict[str, Any] = {"name": name, "namespace": "default"}
    if annotations:
        meta["annotations"] = annotations
    return [
        {"apiVersion": API_VERSION, "kind": "ModelRoute",
         "metadata": {"name": f"{name}-route", "namespace": "default"}, "spec": route_spec},
        {"apiVersion": API_VERSION, "kind": "ModelServer", "metadata": meta,
         "spec": server_spec},
    ]


@dataclass
class Router:
    """One router process on the cluster's config directory."""

    process: Process
    port: int
    admin_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ops_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port or self.port}"

    def metrics(self, key: str | None = None) -> str:
        """`/metrics` (on the API port without an admin port: send `key` if keys are set)."""
        request = urllib.request.Request(
            f"{self.ops_url}/metrics", headers={"authorization": f"Bearer {key}"} if key else {})
        with urllib.request.urlopen(request, timeout=5) as response:
            return str(response.read().decode())

    def pid(self) -> int:
        assert self.process.popen is not None
        return self.process.popen.pid

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid()}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def terminate(self) -> None:
        assert self.process.popen is not None
        self.process.popen.send_signal(signal.SIGTERM)


@dataclass
class FaultCluster:
    sim: SimCluster
    port: int
    specs: list[SimPodSpec]
    routers: list[Router] = field(default_factory=list)

    @property
    def pods(self) -> dict[str, SimPodSpec]:
        return {spec.name: spec for spec in self.specs}

    def pod_url(self, name: str) -> str:
        return f"http://{self.pods[name].ip}:{self.port}"

    def start_pods(self, model: str, flags: Sequence[str] = ()) -> None:
        for spec in self.specs:
            self.sim.start_pod(spec, self.port, model, flags)
        self.sim.wait_pods(self.port, self.specs)
        write_yaml(self.sim.config_dir / "pods.yaml", [pod_manifest(s) for s in self.specs])

    def restart_pod(self, name: str, model: str, flags: Sequence[str] = ()) -> None:
        self.sim.pods[name].stop()
        spec = self.pods[name]
        self.sim.start_pod(spec, self.port, model, flags)
        self.sim.wait_pods(self.port, [spec])

    def start_router(self, extra: Sequence[str] = (), admin: bool = False,
                     name: str = "router") -> Router:
        port = free_port()
        admin_port = free_port() if admin else None
        argv = [
            sys.executable, "-m", "router", "serve", "--config", str(self.sim.config_dir),
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *extra,
        ]
        if admin_port is not None:
            argv += ["--admin-port", str(admin_port)]
        process = Process(argv, self.sim.workdir / f"{name}-{port}.log")
        process.start()
        router = Router(process, port, admin_port)
        self.routers.append(router)
        wait_http(f"{router.ops_url}/readyz")
        return router

    def set_faults(self, name: str, replace: bool = False, **spec: Any) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{self.pod_url(name)}/sim/faults", data=json.dumps(spec).encode(),
            method="PUT" if replace else "POST",
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            return dict(json.loads(response.read()))

    def faults(self, name: str) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.pod_url(name)}/sim/faults", timeout=5) as response:
            return dict(json.loads(response.read()))

    def clear_faults(self) -> None:
        for name, process in self.sim.pods.items():
            if process.alive():
                self.set_faults(name, replace=True)

    def injected(self, kind: str, names: Iterable[str] | None = None) -> int:
        return sum(self.faults(n)["injected"][kind] for n in (names or self.pods))

    def cancelled(self, names: Iterable[str] | None = None) -> int:
        return sum(self.faults(n)["cancelled"] for n in (names or self.pods))

    def stop(self) -> None:
        """SIGTERM everything first, then wait (a pod's store close takes about 2 s)."""
        processes = [r.process for r in self.routers] + list(self.sim.pods.values())
        for process in processes:
            if process.alive():
                assert process.popen is not None
                process.popen.send_signal(signal.SIGTERM)
        for process in processes:
            process.stop()


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include every `labels` pair."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(value for head, value in metric_values(text, name)
               if all(w in head for w in wanted))


def wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.05) -> Any:
    """Poll `predicate()` until it returns something truthy; fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


def sse_payloads(raw: bytes) -> list[Any]:
    """The `data:` payloads of an SSE body: parsed JSON, or the string `[DONE]`."""
    out: list[Any] = []
    for event in raw.split(b"\n\n"):
        event = event.strip()
        if not event.startswith(b"data: "):
            continue
        data = event[len(b"data: "):]
        out.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return out


def stream_text(payloads: Sequence[Any]) -> str:
    """The text of a chat or completion stream's chunks."""
    text = []
    for payload in payloads:
        if not isinstance(payload, dict):
            continue
        for choice in payload.get("choices") or ():
            delta = choice.get("delta")
            piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if piece:
                text.append(piece)
    return "".join(text)


def assert_no_leak(text: str) -> None:
    for marker in LEAK_MARKERS:
        assert marker not in text, f"{marker!r} leaked in {text!r}"

