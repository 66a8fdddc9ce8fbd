"""The simulated cluster every router is measured on: a Mooncake master and engine pods.

Pods of one ModelServer share a port, so each binds its own loopback address
(127.0.<net>.<host>, all of 127/8 is loopback on Linux). `ClusterShape` says what to start:
PD (`groups` prefill/decode pairs, one Mooncake master for the KV store) or aggregated
(`pods` engines with `--role both`), with the simulator's latency model or `--fast`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Final, Literal

from benchmarks.procs import ManagedProcess
from engine_sim.block_hash import DEFAULT_HASH_SEED
from engine_sim.ports import common_free_port as free_shared_port
from router.local_cluster import owned_child

MODEL: Final = "bench-model"
SERVER_NAME: Final = "bench"
NAME_LABEL: Final = "modelserving.volcano.sh/name"
GROUP_LABEL: Final = "modelserving.volcano.sh/group-name"
ROLE_LABEL: Final = "modelserving.volcano.sh/role"
API_VERSION: Final = "networking.serving.volcano.sh/v1alpha1"

Mode = Literal["pd", "agg"]
Role = Literal["prefill", "decode", "both"]


@dataclass(frozen=True, slots=True)
class PodSpec:
    name: str
    role: Role
    ip: str
    port: int
    group: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.ip}:{self.port}"


@dataclass(frozen=True, slots=True)
class ClusterShape:
    """What to start. `sim_flags` go to every pod (latency model, cache size, ...)."""

    mode: Mode
    size: int  # PD groups (one prefill + one decode each), or aggregated pods
    fast: bool = False
    sim_flags: tuple[str, ...] = ()
    prefill_flags: tuple[str, ...] = ()  # after sim_flags, prefill pods only

    @property
    def label(self) -> str:
        kind = "PD" if self.mode == "pd" else "aggregated"
        return f"{kind} x{self.size}{' fast' if self.fast else ''}"


def loopback_net(salt: int = 0) -> int:
    """A third octet for this run's pod addresses (spread by pid, so runs rarely meet)."""
    return 100 + (os.getpid() + salt) % 150


def plan_pods(shape: ClusterShape, net: int, port: int) -> list[PodSpec]:
    if shape.mode == "pd":
        pods: list[PodSpec] = []
        for g in range(shape.size):
            group = f"{SERVER_NAME}-{g}"
            pods.append(PodSpec(f"{group}-prefill", "prefill", f"127.0.{net}.{10 * g + 11}",
                                port, group))
            pods.append(PodSpec(f"{group}-decode", "decode", f"127.0.{net}.{10 * g + 12}",
                                port, group))
        return pods
    return [
        PodSpec(f"{SERVER_NAME}-{i}", "both", f"127.0.{net}.{i + 11}", port)
        for i in range(shape.size)
    ]


@dataclass
class SimCluster:
    """Starts the master and the pods; use as a context manager."""

    shape: ClusterShape
    log_dir: Path
    net: int = field(default_factory=loopback_net)
    #: Annotations of the ModelServer pdgate is given (e.g. pdgate.io/kv-pool).
    server_annotations: dict[str, str] = field(default_factory=dict)
    pods: list[PodSpec] = field(default_factory=list)
    _processes: list[ManagedProcess] = field(default_factory=list)
    _master: object | None = None

    def __enter__(self) -> SimCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def prefill(self) -> list[PodSpec]:
        return [p for p in self.pods if p.role == "prefill"]

    @property
    def decode(self) -> list[PodSpec]:
        return [p for p in self.pods if p.role == "decode"]

    @property
    def compute_pods(self) -> list[PodSpec]:
        """The pods whose prefix cache serves prompts: prefill in PD, all in aggregated."""
        return self.prefill if self.shape.mode == "pd" else list(self.pods)

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        store_flags: list[str] = []
        if self.shape.mode == "pd":
            from engine_sim.mooncake_master import MooncakeMaster

            master = MooncakeMaster(
                log_path=self.log_dir / "mooncake-master.log",
                preexec_fn=owned_child(os.getpid()),
            )
            self._master = master
            master.start()
            store_flags = ["--mooncake-master", master.rpc_address,
                           "--metadata-server", master.metadata_url]
        ips = [pod.ip for pod in plan_pods(self.shape, self.net, 0)]
        port = free_shared_port(ips)
        self.pods = plan_pods(self.shape, self.net, port)
        for pod in self.pods:
            argv = [
                sys.executable, "-m", "engine_sim",
                "--role", pod.role, "--host", pod.ip, "--port", str(port),
                "--model", MODEL, "--pod-name", pod.name,
                "--engine-id", pod.name, "--log-level", "warning",
                "--bootstrap-port", "0",  # runs overlap while old pods stop: no fixed port
                "--python-hash-seed", DEFAULT_HASH_SEED,  # one root: the pods share a store
                *store_flags,
                *(["--fast"] if self.shape.fast else []),
                *self.shape.sim_flags,
                *(self.shape.prefill_flags if pod.role == "prefill" else ()),
            ]  # fmt: skip
            self._processes.append(
                ManagedProcess(pod.name, argv, self.log_dir / f"pod-{pod.name}.log")
            )
        for pod, process in zip(self.pods, self._processes, strict=True):
            process.wait_http(f"{pod.base_url}/health")

    def stop(self) -> None:
        for process in self._processes:
            process.terminate()  # all at once: each pod takes ~2 s to close its store
        for process in self._processes:
            process.stop()
        self._processes.clear()
        master, self._master = self._master, None
        if master is not None:
            with contextlib.suppress(Exception):
                master.stop()  # type: ignore[attr-defined]

    def stop_in_background(self) -> threading.Thread:
        """Stop on a thread (pods take ~2 s to close their store); join it before exiting."""
        thread = threading.Thread(target=self.stop, name="cluster-stop", daemon=True)
        thread.start()
        return thread

    def pdgate_config(self, directory: Path) -> Path:
        """Write the Kthena objects (ModelRoute, ModelServer, Pods) pdgate serves from."""
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "cluster.yaml").write_text(
            kthena_yaml(self.shape.mode, self.pods, self.server_annotations)
        )
        return directory


def kthena_yaml(
    mode: Mode, pods: Sequence[PodSpec], annotations: dict[str, str] | None = None
) -> str:
    """ModelRoute + ModelServer (+ Pods) in Kthena's schema for the given pods."""
    port = pods[0].port if pods else 0
    notes = "".join(f"    {k}: {json.dumps(v)}\n" for k, v in (annotations or {}).items())
    notes = f"  annotations:\n{notes}" if notes else ""
    pd_spec = ""
    if mode == "pd":
        pd_spec = (
            f"    pdGroup:\n"
            f"      groupKey: {GROUP_LABEL}\n"
            f"      prefillLabels:\n        {ROLE_LABEL}: prefill\n"
            f"      decodeLabels:\n        {ROLE_LABEL}: decode\n"
        )
    docs = [
        f"apiVersion: {API_VERSION}\nkind: ModelRoute\n"
        f"metadata:\n  name: {SERVER_NAME}\n  namespace: default\n"
        f"spec:\n  modelName: {MODEL}\n  rules:\n  - name: default\n    targetModels:\n"
        f"    - modelServerName: {SERVER_NAME}\n",
        f"apiVersion: {API_VERSION}\nkind: ModelServer\n"
        f"metadata:\n  name: {SERVER_NAME}\n  namespace: default\n{notes}"
        f"spec:\n  inferenceEngine: vLLM\n  model: {MODEL}\n"
        f"  workloadPort:\n    port: {port}\n    protocol: http\n"
        f"  workloadSelector:\n    matchLabels:\n      {NAME_LABEL}: {SERVER_NAME}\n{pd_spec}"
        f"  trafficPolicy:\n    timeout: 120s\n    retry:\n      attempts: 2\n"
        f"      retryInterval: 50ms\n"
        + ("  kvConnector:\n    type: nixl\n" if mode == "pd" else ""),
    ]
    for pod in pods:
        labels = f"    {NAME_LABEL}: {SERVER_NAME}\n"
        if pod.group is not None:
            labels += f"    {GROUP_LABEL}: {pod.group}\n    {ROLE_LABEL}: {pod.role}\n"
        docs.append(
            f"apiVersion: v1\nkind: Pod\nmetadata:\n  name: {pod.name}\n  namespace: default\n"
            f"  labels:\n{labels}"
            f"status:\n  phase: Running\n  podIP: {pod.ip}\n"
            f"  conditions:\n  - type: Ready\n    status: \"True\"\n"
        )
    return "---\n".join(docs)


@dataclass(frozen=True, slots=True)
class PrefixCounters:
    queries: float = 0.0
    hits: float = 0.0

    def __sub__(self, other: PrefixCounters) -> PrefixCounters:
        return PrefixCounters(self.queries - other.queries, self.hits - other.hits)

    def __add__(self, other: PrefixCounters) -> PrefixCounters:
        return PrefixCounters(self.queries + other.queries, self.hits + other.hits)

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries > 0 else None


def prefix_counters(pod: PodSpec, timeout: float = 5.0) -> PrefixCounters:
    """`vllm:prefix_cache_queries` / `_hits` from one engine's /metrics (tokens)."""
    with urllib.request.urlopen(f"{pod.base_url}/metrics", timeout=timeout) as response:
        text = response.read().decode()
    return parse_prefix_counters(text)


def parse_prefix_counters(text: str) -> PrefixCounters:
    queries = hits = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        value = float(line.rsplit(" ", 1)[1])
        if name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total"):
            queries += value
        elif name in ("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total"):
            hits += value
    return PrefixCounters(queries, hits)


def total_prefix_counters(pods: Sequence[PodSpec]) -> PrefixCounters:
    total = PrefixCounters()
    for pod in pods:
        total = total + prefix_counters(pod)
    return total
