"""Real processes on loopback for end-to-end tests: simulated pods, the router, config YAML.

Every pod of one ModelServer shares `workloadPort.port`, as in a cluster, so each
simulated pod binds its own 127.x address on that port (all of 127/8 is loopback). Pods
also bind vLLM's fixed ports on their address (KV events 5557, the bootstrap server 8998):
each test module takes its addresses from `loopback_net()`, so no two share one.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import openai
import yaml

from engine_sim.block_hash import DEFAULT_HASH_SEED
from engine_sim.ports import common_free_port as free_port
from engine_sim.ports import wait_http

API_VERSION = "networking.serving.volcano.sh/v1alpha1"

#: Loopback /24s one test session may take (`loopback_net`).
NETS_PER_SESSION = 64
#: Sessions' slots of `NETS_PER_SESSION` nets in 127.1.0.0-127.254.255.255.
_SESSION_SLOTS = 254 * 256 // NETS_PER_SESSION
_SESSION_FIRST_NET = (os.getpid() % _SESSION_SLOTS) * NETS_PER_SESSION
#: What every pod address of this session starts with: an error a client sees must not
#: contain it (pod addresses are internal).
POD_ADDRESS_PREFIX = f"127.{1 + _SESSION_FIRST_NET // 256}."


def precise_scheduler(load_weight: float = 0.1) -> str:
    """A router scheduler that scores aggregated requests on the precise prefix index (the
    engines' KV events) and, at `load_weight`, on requests in flight; engine metrics off."""
    return f"""\
profiles:
  aggregated:
    scorers:
      - {{type: precise-prefix-cache, weight: 1.0}}
      - {{type: least-request, weight: {load_weight}}}
engineMetrics: {{enabled: false}}
"""


#: `precise_scheduler` with load only breaking ties.
PRECISE_SCHEDULER = precise_scheduler()
_next_net = itertools.count()


def loopback_net() -> str:
    """A loopback /24, "127.A.B", that no other caller in this test session gets.

    A fixed address per module was shared by modules (and by two suites run at once on
    one machine): a pod still holding 127.0.93.11:5557 made the next module's pod exit
    with "Address already in use". Sessions are spread by pid (slots of 64 nets, as
    `benchmarks.cluster.loopback_net` spreads bench runs), and kept out of 127.0.x, where
    the routers listen (127.0.0.1) and the benchmarks' pods live.
    """
    index = next(_next_net)
    if index >= NETS_PER_SESSION:
        raise RuntimeError(f"a test session takes at most {NETS_PER_SESSION} loopback nets")
    net = _SESSION_FIRST_NET + index
    return f"127.{1 + net // 256}.{net % 256}"


def get_json(url: str) -> object:
    import json

    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


@dataclass
class Process:
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    env: dict[str, str] | None = None  # set on top of this process's environment

    def start(self) -> None:
        log = self.log_path.open("ab")
        self.popen = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, **(self.env or {})},
        )
        log.close()

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int | None:
        if self.popen is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            self.popen.send_signal(sig)
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            return self.popen.wait()

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass
class SimPodSpec:
    name: str
    ip: str
    role: str  # prefill | decode | both
    group: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    flags: list[str] = field(default_factory=list)


def pod_manifest(
    spec: SimPodSpec, namespace: str = "default", ready: bool = True
) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": spec.name, "namespace": namespace, "labels": dict(spec.labels)},
        "status": {
            "phase": "Running",
            "podIP": spec.ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def pd_server_manifests(
    name: str,
    model: str,
    *,
    connector: str = "nixl",
    engine: str = "vLLM",
    port: int,
    retry_attempts: int = 2,
    timeout: str = "60s",
    annotations: dict[str, str] | None = None,
    route_name: str | None = None,
    pd: bool = True,
) -> list[dict[str, object]]:
    """A ModelRoute for `model` and a PD (or aggregated) ModelServer named `name`."""
    selector: dict[str, object] = {"matchLabels": {"app": name}}
    if pd:
        selector["pdGroup"] = {
            "groupKey": "group",
            "prefillLabels": {"role": "prefill"},
            "decodeLabels": {"role": "decode"},
        }
    server_meta: dict[str, object] = {"name": name, "namespace": "default"}
    if annotations:
        server_meta["annotations"] = annotations
    return [
        {
            "apiVersion": API_VERSION,
            "kind": "ModelRoute",
            "metadata": {"name": route_name or f"{name}-route", "namespace": "default"},
            "spec": {
                "modelName": model,
                "rules": [{"name": "default", "targetModels": [{"modelServerName": name}]}],
            },
        },
        {
            "apiVersion": API_VERSION,
            "kind": "ModelServer",
            "metadata": server_meta,
            "spec": {
                "inferenceEngine": engine,
                "workloadPort": {"port": port, "protocol": "http"},
                "workloadSelector": selector,
                "trafficPolicy": {
                    "timeout": timeout,
                    "retry": {"attempts": retry_attempts, "retryInterval": "50ms"},
                },
                "kvConnector": {"type": connector},
            },
        },
    ]


def write_yaml(path: Path, docs: Iterable[dict[str, object]]) -> None:
    """Write atomically, so the router's file source never reads half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(yaml.safe_dump_all(list(docs), sort_keys=False))
    tmp.replace(path)


class SimCluster:
    """A Mooncake-backed simulated cluster of one ModelServer's pods, plus a router."""

    def __init__(self, master: object, workdir: Path | None = None) -> None:
        self.master = master
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="pdgate-it-"))
        self.config_dir = self.workdir / "config"
        self.config_dir.mkdir(parents=True, exist_ok=True)
        self.pods: dict[str, Process] = {}
        self.router: Process | None = None
        self.router_port = 0

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def client(self) -> openai.AsyncOpenAI:
        """The official SDK against the router, its own retries off (a test sees each
        answer as the router gave it)."""
        return openai.AsyncOpenAI(base_url=f"{self.router_url}/v1", api_key="x",
                                  max_retries=0)

    def start_pod(
        self, spec: SimPodSpec, port: int, model: str, extra: Sequence[str] = ()
    ) -> Process:
        process = Process(
            [
                sys.executable, "-m", "engine_sim",
                "--role", spec.role, "--host", spec.ip, "--port", str(port),
                "--model", model, "--pod-name", spec.name,
                "--mooncake-master", self.master.rpc_address,  # type: ignore[attr-defined]
                "--metadata-server", self.master.metadata_url,  # type: ignore[attr-defined]
                "--python-hash-seed", DEFAULT_HASH_SEED,  # one root: the pods share a store
                *spec.flags, *extra,
            ],
            self.workdir / f"pod-{spec.name}.log",
        )
        process.start()
        self.pods[spec.name] = process
        return process

    def wait_pods(self, port: int, specs: Iterable[SimPodSpec]) -> None:
        for spec in specs:
            wait_http(f"http://{spec.ip}:{port}/health")

    def start_router(
        self, extra: Sequence[str] = (), env: dict[str, str] | None = None
    ) -> Process:
        """The cluster's own router (`router_url`; stopped with the cluster)."""
        self.router_port = free_port()
        self.router = self.serve_router("router", extra, self.router_port, env)
        return self.router

    def serve_router(
        self, name: str, extra: Sequence[str] = (), port: int | None = None,
        env: dict[str, str] | None = None,
    ) -> Process:
        """A router on this cluster's config at `port` (default: a free one), once ready;
        its log is `<name>.log`. Beside `start_router`, the caller stops it (one that never
        gets ready is stopped here)."""
        port = free_port() if port is None else port
        process = Process(
            [
                sys.executable, "-m", "router", "serve", "--config", str(self.config_dir),
                "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *extra,
            ],
            self.workdir / f"{name}.log",
            env=env,
        )
        process.start()
        try:
            wait_http(f"http://127.0.0.1:{port}/readyz")
        except BaseException:
            process.stop()
            raise
        return process

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        for process in self.pods.values():
            process.stop()

    def router_metrics(self) -> str:
        with urllib.request.urlopen(f"{self.router_url}/metrics", timeout=5) as response:
            return str(response.read().decode())


def metric_values(text: str, name: str) -> list[tuple[str, float]]:
    """(labels, value) of every sample of `name` in a Prometheus exposition."""
    samples = []
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in "{ "):
            head, _, value = line.rpartition(" ")
            samples.append((head[len(name):], float(value)))
    return samples
