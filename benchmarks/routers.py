"""The routers under test and how each is started on a `SimCluster`.

- `pdgate`: `python -m router serve` on a Kthena config directory written for the pods
  (PD pods use `kvConnector: nixl`, the protocol vLLM Router speaks too), one scheduler
  YAML per policy.
- `vllm-router` (Rust, pinned in requirements.txt): PD with `--vllm-pd-disaggregation
  --kv-connector nixl` and every prefill/decode URL, or `--worker-urls` for aggregated.
- `sglang-router`: aggregated only (`launch --worker-urls`), the non-PD comparison.
- `direct`: no router; the client sends each request to the next pod (aggregated) or does
  prefill-then-decode itself against the next prefill/decode pair (PD), round robin.

All log at warning level so that no router pays for per-request logging.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Final, Literal

from benchmarks.cluster import Mode, SimCluster
from benchmarks.procs import ManagedProcess, ResourceMeter
from benchmarks.targets import DirectPDTarget, HTTPTarget, RoundRobin, Target
from engine_sim.ports import free_port, free_ports

Kind = Literal["direct", "pdgate", "vllm-router", "sglang-router"]
ROUTER_STARTUP_SECONDS: Final = 60.0


@dataclass(frozen=True, slots=True)
class RouterSpec:
    kind: Kind
    policy: str | None = None
    scheduler_yaml: str | None = None  # pdgate: the scheduler config for `policy`
    #: pdgate: more `pdgate serve` flags (named with the policy).
    args: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        detail = ", ".join(filter(None, (self.policy, " ".join(self.args))))
        return f"{self.kind} ({detail})" if detail else self.kind

    def supports(self, mode: Mode) -> bool:
        return not (self.kind == "sglang-router" and mode == "pd")


def _binary(name: str) -> str:
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found: pip install -r benchmarks/requirements.txt")
    return found


class RunningRouter:
    """One router process (none for `direct`) in front of a cluster; a context manager."""

    def __init__(self, spec: RouterSpec, cluster: SimCluster, work_dir: Path) -> None:
        self.spec = spec
        self.cluster = cluster
        self.work_dir = work_dir
        self.process: ManagedProcess | None = None
        self.meter: ResourceMeter | None = None
        self.target: Target = self._direct_target()
        self.peak_rss: int | None = None

    def __enter__(self) -> RunningRouter:
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

    def _direct_target(self) -> Target:
        """The floor: the client itself spreads requests over the pods (each PD group's
        prefill and decode pod), round robin."""
        cluster = self.cluster
        if cluster.shape.mode == "pd":
            return RoundRobin("direct", [
                DirectPDTarget("direct", prefill.base_url, decode.base_url)
                for prefill, decode in zip(cluster.prefill, cluster.decode, strict=True)
            ])
        return RoundRobin("direct", [HTTPTarget("direct", pod.base_url) for pod in cluster.pods])

    def start(self) -> None:
        if self.spec.kind == "direct":
            return
        port = free_port()
        argv = self._argv(port)
        slug = self.spec.name.replace(" ", "").replace("(", "-").replace(")", "")
        log = self.work_dir / f"router-{slug}-{self.cluster.shape.mode}.log"
        self.process = ManagedProcess(self.spec.name, argv, log)
        ready = "/readyz" if self.spec.kind == "pdgate" else "/health"
        base = f"http://127.0.0.1:{port}"
        self.process.wait_http(base + ready, ROUTER_STARTUP_SECONDS)
        self.target = HTTPTarget(self.spec.name, base)
        self.meter = ResourceMeter(self.process.pid)

    def cpu_seconds(self) -> float | None:
        return None if self.meter is None else self.meter.cpu_seconds()

    def alive(self) -> bool:
        return self.process is None or self.process.alive()

    def stop(self) -> None:
        if self.meter is not None:
            self.peak_rss = self.meter.close()
            self.meter = None
        if self.process is not None:
            self.process.stop()

    def _argv(self, port: int) -> list[str]:
        cluster = self.cluster
        mode = cluster.shape.mode
        policy = self.spec.policy
        if self.spec.kind == "pdgate":
            config = cluster.pdgate_config(self.work_dir / f"pdgate-config-{mode}")
            argv = [sys.executable, "-m", "router", "serve", "--config", str(config),
                    "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
            if self.spec.scheduler_yaml is not None:
                slug = (policy or "default").replace(" ", "-")
                path = self.work_dir / f"scheduler-{slug}.yaml"
                path.write_text(self.spec.scheduler_yaml)
                argv += ["--scheduler-config", str(path)]
            return [*argv, *self.spec.args]
        # Not `port` again (a port just freed may be handed out twice): of two distinct
        # free ports, at least one is another.
        metrics_port = next(p for p in free_ports(2) if p != port)
        metrics = ["--prometheus-port", str(metrics_port), "--prometheus-host", "127.0.0.1"]
        if self.spec.kind == "sglang-router":
            return [_binary("sglang-router"), "launch", "--host", "127.0.0.1",
                    "--port", str(port), "--policy", policy or "cache_aware",
                    "--log-level", "warn", *metrics,
                    "--worker-urls", *(pod.base_url for pod in cluster.pods)]
        argv = [_binary("vllm-router"), "--host", "127.0.0.1", "--port", str(port),
                "--policy", policy or "cache_aware", "--log-level", "warning",
                "--worker-startup-check-interval", "1", *metrics]
        if mode == "pd":
            argv += ["--vllm-pd-disaggregation", "--kv-connector", "nixl"]
            for pod in cluster.prefill:
                argv += ["--prefill", pod.base_url]
            for pod in cluster.decode:
                argv += ["--decode", pod.base_url]
            return argv
        return [*argv, "--worker-urls", *(pod.base_url for pod in cluster.pods)]
