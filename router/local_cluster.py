"""A whole PD cluster on one machine: Mooncake master, simulated pods, and the router.

`pdgate up` and `pdgate demo` read the same YAML directory the router serves, start one
`engine_sim` process per ready Pod (on the pod's IP and the ModelServer's port; every
127.x.y.z address is loopback on Linux, so pods can share a port), then the router.

The launcher owns its children. Each runs in a process group of its own (a Ctrl-C in the
terminal reaches only the launcher, which then stops them in order) with the Linux
parent-death signal set to SIGKILL, so a launcher killed outright takes them all down.
A child counts as started only once it serves on its own socket (a leftover of an earlier
run answering on that port does not count). The stop order is: the router, waiting for
its whole drain; then the pods; then the Mooncake master last (a pod whose master is gone
takes seconds to close its store client). A child that fails to start or dies is named,
with the tail of its log, and the rest is stopped.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from router.resilience.config import ResilienceConfig
from router.sources.files import load_directory
from router.view import ClusterView, Endpoint

if TYPE_CHECKING:
    from engine_sim.mooncake_master import MooncakeMaster

STARTUP_TIMEOUT_SECONDS = 60.0
#: PYTHONHASHSEED of the simulated pods (vLLM: unset means a random root per process).
POD_HASH_SEED = "0"
#: What the router may take beyond its drain grace to exit before it is killed.
ROUTER_STOP_SLACK_SECONDS = 10.0
#: What a pod may take to close its store client and exit before it is killed.
POD_STOP_TIMEOUT_SECONDS = 10.0
POLL_SECONDS = 0.1
LOG_TAIL_LINES = 15
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_TCP_LISTEN = "0A"  # the state column of /proc/net/tcp


class UnsupportedConfig(ValueError):
    """The config directory asks for something the simulated pods cannot be."""


@dataclass(frozen=True, slots=True)
class SimPodSpec:
    endpoint: Endpoint
    model: str
    engine: str
    #: The deployment's data-parallel ranks (its ModelServer's `pdgate.io/data-parallel-size`).
    data_parallel_size: int = 1
    #: On one node of a hybrid deployment over pods: the ranks it runs, from which global
    #: rank (None: all of them, behind one API server).
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0

    def data_parallel_flags(self) -> list[str]:
        """The simulator's flags for this pod's ranks (vLLM's names)."""
        flags = ["--data-parallel-size", str(self.data_parallel_size)]
        if self.data_parallel_size_local is not None:
            flags += ["--data-parallel-size-local", str(self.data_parallel_size_local),
                      "--data-parallel-start-rank", str(self.data_parallel_start_rank),
                      "--data-parallel-hybrid-lb"]
        return flags


def sim_pods(config_dir: Path) -> list[SimPodSpec]:
    """The simulated pods a config directory describes, one per ready pod and role (a pod
    whose ranks are targets of their own is one process with that many engine cores; a
    node of a hybrid deployment over pods runs its own ranks)."""
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
        ranks = server.data_parallel
        if ranks.external:
            raise UnsupportedConfig(f"ModelServer {server.server.meta.key}: pdgate up runs "
                             "a data-parallel pod's ranks behind one API server a pod "
                             "(pdgate.io/data-parallel-lb: internal or hybrid), not one a "
                             "rank (external)")
        node = ranks.mode == "hybrid"
        specs.extend(
            SimPodSpec(endpoint, model, engine, ranks.size,
                       ranks.local_size if node else None,
                       endpoint.dp_rank or 0 if node else 0)
            for endpoint in server.endpoints()
            if endpoint.local_index in (None, 0)  # the pod's first target
        )
    return specs


@dataclass(slots=True)
class Child:
    """One process the launcher started: its name for people, its log."""

    name: str  # "router", "pod g0-decode", "Mooncake master"
    popen: subprocess.Popen[bytes]
    log_path: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signum)

    def log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(f"    {line}" for line in lines[-LOG_TAIL_LINES:])


class ChildFailed(Exception):
    """A child failed to start or died; the message names it and ends with its log."""

    def __init__(self, child: Child, what: str) -> None:
        self.child = child
        super().__init__(f"{child.name} {what}; last lines of {child.log_path}:\n"
                         f"{child.log_tail()}")


class Interrupted(Exception):
    """A stop signal came while the cluster was starting."""


def exit_description(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def owned_child(parent: int) -> Callable[[], None]:
    """A `preexec_fn`: the child gets its own process group (terminal signals reach only
    the launcher) and SIGKILL when the launcher dies, however it dies (Linux)."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before fork

    def preexec() -> None:
        os.setpgid(0, 0)
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl ran
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def owns_listener(pid: int, host: str, port: int) -> bool:
    """Whether process `pid` holds the TCP socket listening on host:port (Linux /proc).

    Answering HTTP on the port is not enough: a leftover process of an earlier run may be
    answering there while ours failed to bind.
    """
    try:
        address = struct.unpack("=I", socket.inet_aton(host))[0]
    except OSError:  # not IPv4 (local clusters use 127/8): the HTTP check has to do
        return True
    wanted = f"{address:08X}:{port:04X}"
    inodes = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[1] == wanted and fields[3] == _TCP_LISTEN:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return False
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd) in inodes:
                    return True
    return False


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


class LocalCluster:
    """Starts, watches and stops the processes of a local cluster; a context manager.

    Signals go to `request_stop` (the CLI installs it): the first stops the cluster in
    order, a second cuts the router's drain short, a third kills every child at once.
    """

    def __init__(
        self,
        config_dir: Path,
        router_port: int = 8080,
        log_dir: Path | None = None,
        drain_grace_s: float | None = None,
    ) -> None:
        """`drain_grace_s` None: the router's own default (`pdgate serve --drain-grace`)."""
        self.config_dir = config_dir
        self.router_port = router_port
        self.drain_grace_s = (ResilienceConfig().drain_grace_s if drain_grace_s is None
                              else drain_grace_s)
        self.temporary_logs = log_dir is None
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="pdgate-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.pods: list[SimPodSpec] = []
        self.signals = 0  # stop signals received
        self._master: MooncakeMaster | None = None
        self._pods: list[Child] = []
        self._router: Child | None = None
        self._preexec = owned_child(os.getpid())

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def children(self) -> list[Child]:
        master = self._master
        found = []
        if master is not None and master.process is not None and master.log_path is not None:
            found.append(Child("Mooncake master", master.process, master.log_path))
        found += self._pods
        if self._router is not None:
            found.append(self._router)
        return found

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def request_stop(self, signum: int, frame: object = None) -> None:
        """A signal handler: count the signal; `watch`, `start` and `stop` act on it."""
        self.signals += 1
        if self.signals >= 3:
            for child in self.children():
                child.signal(signal.SIGKILL)

    def start(self) -> None:
        from engine_sim.mooncake_master import MooncakeMaster

        self.pods = sim_pods(self.config_dir)
        master = MooncakeMaster(log_path=self.log_dir / "mooncake-master.log",
                                preexec_fn=self._preexec)
        self._master = master
        master.start()
        for spec in self.pods:
            endpoint = spec.endpoint
            self._pods.append(self._spawn(
                f"pod {endpoint.pod_name}", f"pod-{endpoint.pod_name}.log",
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
                    *spec.data_parallel_flags(),
                ],
            ))
        for spec, pod in zip(self.pods, self._pods, strict=True):
            self._wait_serving(pod, spec.endpoint.ip, spec.endpoint.port,
                               f"{spec.endpoint.base_url}/health")
        self._router = self._spawn("router", "router.log", [
            sys.executable, "-m", "router", "serve",
            "--config", str(self.config_dir),
            "--host", "127.0.0.1",
            "--port", str(self.router_port),
            "--drain-grace", str(self.drain_grace_s),
        ])
        self._wait_serving(self._router, "127.0.0.1", self.router_port,
                           f"{self.router_url}/readyz")

    def _spawn(self, name: str, log_name: str, argv: list[str]) -> Child:
        log_path = self.log_dir / log_name
        with log_path.open("ab") as log:
            popen = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=dict(os.environ), preexec_fn=self._preexec,
            )
        return Child(name, popen, log_path)

    def _wait_serving(self, child: Child, host: str, port: int, ready_url: str) -> None:
        """Until `child` itself listens on host:port and `ready_url` answers 200."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
        while True:
            if self.signals:
                raise Interrupted
            code = child.popen.poll()
            if code is not None:
                raise ChildFailed(child, f"{exit_description(code)} before serving on "
                                         f"{host}:{port}")
            if owns_listener(child.popen.pid, host, port) and answers(ready_url):
                return
            if time.monotonic() > deadline:
                raise ChildFailed(child, f"was not serving on {host}:{port} after "
                                         f"{STARTUP_TIMEOUT_SECONDS:.0f} s")
            time.sleep(POLL_SECONDS)

    def watch(self) -> None:
        """Block until a stop signal (return) or until a child exits (raise ChildFailed)."""
        while not self.signals:
            for child in self.children():
                code = child.popen.poll()
                if code is not None:
                    raise ChildFailed(child, exit_description(code))
            time.sleep(POLL_SECONDS)

    def stop(self) -> None:
        """The router first (its whole drain), then the pods, then the master.

        Each stays in `children()` until it is reaped, so a third signal still kills it.
        """
        router = self._router
        if router is not None:
            router.signal(signal.SIGTERM)
            cut_short = False
            deadline = time.monotonic() + self.drain_grace_s + ROUTER_STOP_SLACK_SECONDS
            while router.alive() and time.monotonic() < deadline:
                if self.signals >= 2 and not cut_short:
                    router.signal(signal.SIGTERM)  # the router's own cut-off: no waiting
                    cut_short = True
                time.sleep(POLL_SECONDS)
            _reap(router, 0)
            self._router = None
        for pod in self._pods:
            pod.signal(signal.SIGTERM)
        deadline = time.monotonic() + POD_STOP_TIMEOUT_SECONDS
        for pod in self._pods:
            _reap(pod, deadline - time.monotonic())
        self._pods = []
        if self._master is not None:
            self._master.stop(POD_STOP_TIMEOUT_SECONDS)
            self._master = None

    def remove_logs(self) -> None:
        """Delete the log directory if it is a temporary one of ours."""
        if self.temporary_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)


def _reap(child: Child, timeout_s: float) -> None:
    """Wait up to `timeout_s` for `child` to exit, then kill it."""
    try:
        child.popen.wait(max(timeout_s, 0.0))
    except subprocess.TimeoutExpired:
        child.signal(signal.SIGKILL)
        child.popen.wait()
