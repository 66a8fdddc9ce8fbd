"""A whole PD cluster on one machine: Mooncake master, simulated pods, and the router.

`pdgate up` and `pdgate demo` read the same YAML directory the router serves, start one
`engine_sim` process per ready Pod (on the pod's IP and the ModelServer's port; every
127.x.y.z address is loopback on Linux, so pods can share a port), then the router.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from engine_sim.ports import wait_http
from router.sources.files import load_directory
from router.view import ClusterView, Endpoint

STARTUP_TIMEOUT_SECONDS = 60.0
#: PYTHONHASHSEED of the simulated pods (vLLM: unset means a random root per process).
POD_HASH_SEED = "0"


@dataclass(frozen=True, slots=True)
class SimPodSpec:
    endpoint: Endpoint
    model: str
    engine: str


def sim_pods(config_dir: Path) -> list[SimPodSpec]:
    """The simulated pods a config directory describes, one per ready pod and role."""
    view = ClusterView()
    load_directory(config_dir, view)
    specs: list[SimPodSpec] = []
    models_by_server = {
        (route.meta.namespace, target.model_server_name): route.model_name or ""
        for route in view.snapshot.routes_by_model.values()
        for rule in route.rules
        for target in rule.target_models
    }
    for key, server in sorted(view.snapshot.servers.items()):
        model = server.server.model or models_by_server.get(key, key[1])
        engine = server.server.inference_engine
        specs.extend(SimPodSpec(endpoint, model, engine) for endpoint in server.endpoints())
    return specs


class LocalCluster:
    """Starts and stops the processes of a local cluster; use as a context manager."""

    def __init__(self, config_dir: Path, router_port: int = 8080, quiet: bool = True) -> None:
        self.config_dir = config_dir
        self.router_port = router_port
        self.quiet = quiet
        self._processes: list[subprocess.Popen[bytes]] = []
        self._master: object | None = None
        self.pods: list[SimPodSpec] = []

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        from engine_sim.mooncake_master import MooncakeMaster

        master = MooncakeMaster()
        master.start()
        self._master = master
        self.pods = sim_pods(self.config_dir)
        for spec in self.pods:
            endpoint = spec.endpoint
            self._spawn(
                [
                    sys.executable, "-m", "engine_sim",
                    "--role", endpoint.role,
                    "--host", endpoint.ip,
                    "--port", str(endpoint.port),
                    "--model", spec.model,
                    "--pod-name", endpoint.pod_name,
                    "--mooncake-master", master.rpc_address,
                    "--metadata-server", master.metadata_url,
                    # One PYTHONHASHSEED for all pods, as pods sharing a Mooncake Store need.
                    "--python-hash-seed", POD_HASH_SEED,
                ]
            )
        for spec in self.pods:
            wait_http(f"{spec.endpoint.base_url}/health", STARTUP_TIMEOUT_SECONDS)
        self._spawn(
            [
                sys.executable, "-m", "router", "serve",
                "--config", str(self.config_dir),
                "--host", "127.0.0.1",
                "--port", str(self.router_port),
            ]
        )
        wait_http(f"{self.router_url}/readyz", STARTUP_TIMEOUT_SECONDS)

    def _spawn(self, argv: list[str]) -> None:
        output = subprocess.DEVNULL if self.quiet else None
        self._processes.append(
            subprocess.Popen(argv, stdout=output, stderr=output, env=dict(os.environ))
        )

    def stop(self) -> None:
        for process in reversed(self._processes):
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        for process in reversed(self._processes):
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._processes.clear()
        if self._master is not None:
            self._master.stop()  # type: ignore[attr-defined]
            self._master = None

    def wait(self) -> None:
        """Block until Ctrl-C or until any process exits."""
        with contextlib.suppress(KeyboardInterrupt):
            while all(process.poll() is None for process in self._processes):
                time.sleep(0.5)

