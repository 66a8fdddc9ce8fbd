"""Shared fixtures: a real Mooncake master and simulated engine pods on loopback.

- `mooncake_master` (session): a running `MooncakeMaster`; skips the test when the Mooncake
  library cannot be imported.
- every `openai.AsyncOpenAI` a test makes is closed when the test ends (autouse; why below).
- `sim_pod` (function) / `sim_pod_session` (session): factories
  `start(role="both", model=DEFAULT_MODEL, *, mooncake=None, **flags) -> SimPod` that run
  `python -m engine_sim` as a subprocess on a free port and wait for `/health`. Flags map
  to CLI flags (`max_num_seqs=2` -> `--max-num-seqs 2`, `fast=True` -> `--fast`; False and
  None are dropped). `mooncake=None` means "connect to the session master unless role is
  both". Pods stop when the test (or session) ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest

from engine_sim.block_hash import DEFAULT_HASH_SEED
from engine_sim.kvstore import mooncake_import_error
from engine_sim.mooncake_master import MooncakeMaster

DEFAULT_MODEL = "sim-model"


def pytest_sessionstart(session: pytest.Session) -> None:
    """Refuse to test a stale build: a module compiled in place (setup.py) that is older
    than its source would run the old code while the suite reads the new.

    SIGTERM (a CI job's timeout, `kill`) is taken as Ctrl-C: pytest then stops the test
    that runs and tears down every fixture, so the simulator pods, Mooncake masters and
    routers the tests started are stopped rather than left running without their parent.
    """
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    from router.build import stale_modules

    stale = stale_modules()
    if stale:
        pytest.exit(f"compiled modules older than their source: {', '.join(stale)}; "
                    "run `make setup` (or `make test`) to rebuild them", returncode=4)

POD_START_TIMEOUT_S = 30.0
POD_STOP_TIMEOUT_S = 15.0
_LOG_TAIL_BYTES = 3000


@dataclass
class SimPod:
    """One `python -m engine_sim` subprocess."""

    role: str
    model: str
    engine_id: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    args: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self) -> str:
        if not self.log_path.exists():
            return ""
        return self.log_path.read_bytes()[-_LOG_TAIL_BYTES:].decode(errors="replace")

    def terminate(self) -> None:
        """Send SIGTERM (the pod closes its store and exits 0)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = POD_STOP_TIMEOUT_S) -> int:
        """SIGTERM, wait, kill if it hangs; returns the exit code."""
        self.terminate()
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


class _MasterHolder:
    """Starts the session's Mooncake master on first demand."""

    def __init__(self, workdir: Path) -> None:
        self._workdir = workdir
        self._master: MooncakeMaster | None = None

    def get(self) -> MooncakeMaster:
        if self._master is None:
            reason = mooncake_import_error()
            if reason is not None:
                pytest.skip(f"Mooncake store unavailable: {reason}")
            self._master = MooncakeMaster(log_path=self._workdir / "mooncake-master.log").start()
        return self._master

    def stop(self) -> None:
        if self._master is not None:
            self._master.stop()
            self._master = None


class SimPodLauncher:
    """Starts pods and stops them all at once (stopping in parallel: a store close takes ~2 s)."""

    def __init__(self, workdir: Path, masters: _MasterHolder) -> None:
        self._workdir = workdir
        self._masters = masters
        self.pods: list[SimPod] = []

    def start(
        self,
        role: str = "both",
        model: str = DEFAULT_MODEL,
        *,
        mooncake: bool | None = None,
        **flags: Any,
    ) -> SimPod:
        engine_id = str(flags.pop("engine_id", None) or f"{role}-{uuid.uuid4().hex[:8]}")
        name = f"{engine_id}-{uuid.uuid4().hex[:6]}"
        port_file = self._workdir / f"{name}.port"
        log_path = self._workdir / f"{name}.log"
        args = [
            sys.executable, "-m", "engine_sim", "--role", role, "--model", model,
            "--port", "0", "--port-file", str(port_file), "--engine-id", engine_id,
        ]  # fmt: skip
        if mooncake if mooncake is not None else role != "both":
            master = self._masters.get()
            args += ["--mooncake-master", master.rpc_address]
            args += ["--metadata-server", master.metadata_url]
        # One PYTHONHASHSEED for every pod (pods sharing a store need one root), unless a
        # test passes python_hash_seed=None: then each pod draws its own, as vLLM does.
        flags.setdefault("python_hash_seed", DEFAULT_HASH_SEED)
        args += _flag_args(flags)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env
            )
        pod = SimPod(role, model, engine_id, 0, process, log_path, args)
        self.pods.append(pod)
        pod.port = _wait_until_serving(pod, port_file)
        return pod

    def stop_all(self) -> None:
        pods, self.pods = self.pods, []
        for pod in pods:
            pod.terminate()
        for pod in pods:
            pod.stop()


def _flag_args(flags: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is not None and value is not False:
            out += [flag, str(value)]
    return out


def _wait_until_serving(pod: SimPod, port_file: Path) -> int:
    deadline = time.monotonic() + POD_START_TIMEOUT_S
    port = 0
    while time.monotonic() < deadline:
        if pod.process.poll() is not None:
            raise RuntimeError(
                f"engine_sim exited with {pod.process.returncode}: {pod.args}\n{pod.log_tail()}"
            )
        if not port and port_file.exists():
            port = int(port_file.read_text())
        if port:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return port
            except (urllib.error.URLError, OSError):
                pass
        time.sleep(0.05)
    pod.stop()
    raise RuntimeError(f"engine_sim not healthy after {POD_START_TIMEOUT_S} s\n{pod.log_tail()}")


@pytest.fixture(scope="session")
def _mooncake_masters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_MasterHolder]:
    holder = _MasterHolder(tmp_path_factory.mktemp("mooncake"))
    yield holder
    holder.stop()


@pytest.fixture(scope="session")
def mooncake_master(_mooncake_masters: _MasterHolder) -> MooncakeMaster:
    """A running Mooncake master (RPC + HTTP metadata) shared by the session."""
    return _mooncake_masters.get()


@pytest.fixture
def sim_pod(tmp_path: Path, _mooncake_masters: _MasterHolder) -> Iterator[Callable[..., SimPod]]:
    """Factory of engine_sim pods stopped at the end of the test."""
    launcher = SimPodLauncher(tmp_path, _mooncake_masters)
    yield launcher.start
    launcher.stop_all()


@pytest.fixture(scope="session")
def sim_pod_session(
    tmp_path_factory: pytest.TempPathFactory, _mooncake_masters: _MasterHolder
) -> Iterator[Callable[..., SimPod]]:
    """Factory of engine_sim pods stopped at the end of the session (share them to save time)."""
    launcher = SimPodLauncher(tmp_path_factory.mktemp("sim-pods"), _mooncake_masters)
    yield launcher.start
    launcher.stop_all()


@pytest.fixture
def start_sim_pod(sim_pod: Callable[..., SimPod]) -> Callable[..., SimPod]:
    """Alias of `sim_pod` under the factory's own name."""
    return sim_pod


# An AsyncOpenAI client left to the garbage collector is closed by a task its `__del__`
# schedules, after the cyclic collector may already have closed its sockets. asyncio's
# transport then removes the reader of the fd number it cached, which by then belongs to a
# new connection of a later test: that connection's response is never read and the test
# hangs until pytest-timeout (seen as 24 concurrent PD requests "not finishing" while the
# router had answered all of them). So every client a test makes is closed, in order, at
# the end of that test.
_open_clients: list[openai.AsyncOpenAI] = []
_client_init = openai.AsyncOpenAI.__init__


def _tracked_init(self: openai.AsyncOpenAI, *args: Any, **kwargs: Any) -> None:
    _client_init(self, *args, **kwargs)
    _open_clients.append(self)


openai.AsyncOpenAI.__init__ = _tracked_init  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
async def _close_openai_clients() -> AsyncIterator[None]:
    """Close the AsyncOpenAI clients made during the test (see the comment above)."""
    yield
    clients = _open_clients[:]
    _open_clients.clear()
    for client in clients:
        if not client.is_closed():
            await client.close()
