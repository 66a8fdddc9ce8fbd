"""`pdgate up` owns its processes: a clean ordered stop, nothing left behind, loud failures.

Each test runs the real launcher (`python -m router up`) on a small config of its own (one
PD group on loopback addresses of this file, a free pod port, a free router port), finds
its children (Mooncake master, two simulated pods, router) by PID through /proc, then
signals, kills or sabotages it and checks what an operator would: the exit status, what
the launcher printed, and that no child outlives it. Whatever happens, every process a
test started is killed at its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import aiohttp
import psutil
import pytest

from engine_sim.mooncake_master import MooncakeMasterError, find_master_binary
from engine_sim.ports import accepts
from tests.integration.harness import (
    SimPodSpec,
    free_port,
    loopback_net,
    pd_server_manifests,
    pod_manifest,
    write_yaml,
)
from tests.integration.test_faults_kit import sse_payloads, wait_for

pytestmark = pytest.mark.integration

MODEL = "sim-up-model"
NET = loopback_net()
SPECS = [
    SimPodSpec(name=f"g0-{role}", ip=ip, role=role, group="g0",
               labels={"app": "up", "group": "g0", "role": role})
    for role, ip in (("prefill", f"{NET}.11"), ("decode", f"{NET}.12"))
]
#: Mooncake master, one prefill pod, one decode pod, the router.
CHILDREN = 4
START_S = 60.0
#: Tokens of an answer that outlasts 10 s at the simulator's default inter-token latency.
DRAINED_TOKENS = 1200
#: How long the launcher may take to stop once its router has drained.
STOP_S = 20.0


@dataclass(frozen=True)
class Proc:
    pid: int
    started: float  # creation time: tells a PID from a later reuse of it
    argv: str

    def alive(self) -> bool:
        """Running (a zombie waiting for its reaper holds nothing any more)."""
        try:
            process = psutil.Process(self.pid)
            return (process.create_time() == self.started
                    and process.status() != psutil.STATUS_ZOMBIE)
        except psutil.Error:
            return False


def children_of(parent: int) -> list[Proc]:
    try:
        children = psutil.Process(parent).children()
    except psutil.Error:
        return []
    found = []
    for child in children:
        with contextlib.suppress(psutil.Error):
            if child.status() != psutil.STATUS_ZOMBIE:
                found.append(Proc(child.pid, child.create_time(), " ".join(child.cmdline())))
    return found


@dataclass
class Up:
    """One `pdgate up` process and the children it started."""

    config: Path
    port: int
    pod_port: int
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    children: list[Proc] = field(default_factory=list)  # while serving
    seen: set[Proc] = field(default_factory=set)  # every child seen while it ran

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = dict(os.environ, TMPDIR=str(self.log_path.parent))
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "router", "up", "--config", str(self.config),
                 "--port", str(self.port)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            )
        threading.Thread(target=self._watch, args=(self.process,), daemon=True).start()

    def _watch(self, process: subprocess.Popen[bytes]) -> None:
        """Note every child the launcher has, until it exits (even one it starts late)."""
        while process.poll() is None:
            self.seen.update(children_of(process.pid))
            time.sleep(0.05)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_serving(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + START_S
        while "is serving on" not in self.output():
            assert self.process.poll() is None, self.output()
            assert time.monotonic() < deadline, self.output()
            time.sleep(0.1)
        self.children = children_of(self.process.pid)
        assert len(self.children) == CHILDREN, self.children

    def child(self, word: str) -> Proc:
        (found,) = [p for p in self.children if word in p.argv]
        return found

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def wait(self, timeout: float = STOP_S) -> int:
        assert self.process is not None
        return self.process.wait(timeout)

    def left_behind(self, within_s: float = 0.0) -> list[Proc]:
        """Children still alive after up to `within_s` seconds."""
        deadline = time.monotonic() + within_s
        while True:
            alive = [p for p in self.seen | set(self.children) if p.alive()]
            if not alive or time.monotonic() >= deadline:
                return alive
            time.sleep(0.1)

    def cleanup(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for proc in self.seen | set(self.children):
            if proc.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Up]:
    try:
        find_master_binary()
    except MooncakeMasterError as exc:
        pytest.skip(str(exc))
    config = tmp_path / "config"
    config.mkdir()
    pod_port = free_port([s.ip for s in SPECS])
    write_yaml(config / "servers.yaml",
               pd_server_manifests("up", MODEL, port=pod_port, timeout="120s"))
    write_yaml(config / "pods.yaml", [pod_manifest(s) for s in SPECS])
    run = Up(config, free_port(), pod_port, tmp_path / "up.log")
    try:
        yield run
    finally:
        run.cleanup()


def chat(content: str, max_tokens: int) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "stream": True}


async def test_sigterm_drains_the_router_first_and_exits_zero(up: Up) -> None:
    up.start()
    up.wait_serving()
    async with aiohttp.ClientSession() as session, session.post(
        f"{up.url}/v1/chat/completions", json=chat("drain me", DRAINED_TOKENS)
    ) as response:
        first = await response.content.readline()
        assert first.startswith(b"data: {")
        up.signal(signal.SIGTERM)
        signalled = time.monotonic()
        payloads = sse_payloads(first + await response.read())
        drained_s = time.monotonic() - signalled
    # The router drained with its pods still up: the whole answer, no error event.
    assert payloads[-1] == "[DONE]"
    assert not [p for p in payloads if isinstance(p, dict) and "error" in p]
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"
    # The launcher once killed its router 10 s into the drain: this drain lasts longer.
    assert drained_s > 10, drained_s
    code = await asyncio.to_thread(up.wait)
    assert code == 0, up.output()
    assert up.left_behind() == []
    assert "Traceback" not in up.output()


async def test_second_sigterm_cuts_the_drain_short_and_leaves_nothing(up: Up) -> None:
    up.start()
    up.wait_serving()
    async with aiohttp.ClientSession() as session, session.post(
        f"{up.url}/v1/chat/completions", json=chat("cut me", 5000)
    ) as response:
        first = await response.content.readline()
        up.signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        signalled = time.monotonic()
        up.signal(signal.SIGTERM)
        payloads = sse_payloads(first + await response.read())
    assert payloads[-1] == "[DONE]"
    assert payloads[-2]["error"]["code"] == "shutting_down"
    code = await asyncio.to_thread(up.wait)
    print(f"\ndouble SIGTERM: launcher exit {code} {time.monotonic() - signalled:.2f} s "
          "after the second")
    assert code == 0, up.output()
    assert up.left_behind() == []  # the Mooncake master too


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGINT], ids=["SIGHUP", "SIGINT"])
def test_sighup_and_sigint_stop_like_sigterm(up: Up, signum: int) -> None:
    up.start()
    up.wait_serving()
    up.signal(signum)
    assert up.wait() == 0, up.output()
    assert up.left_behind() == []
    wait_for(lambda: not accepts("127.0.0.1", up.port), timeout=5)


def test_sigkill_of_the_launcher_takes_every_child_down(up: Up) -> None:
    up.start()
    up.wait_serving()
    up.signal(signal.SIGKILL)
    up.wait()
    assert up.left_behind(within_s=10) == []
    # The kernel may close a killed process's sockets a moment after it is gone.
    wait_for(lambda: not accepts("127.0.0.1", up.port), timeout=5)


class _Answers200(BaseHTTPRequestHandler):
    """A leftover server of an earlier run: it answers every health check."""

    def do_GET(self) -> None:
        body = b'{"ready": true}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def leftover(host: str, port: int) -> Iterator[None]:
    server = ThreadingHTTPServer((host, port), _Answers200)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("taken", ["router", "g0-decode"])
def test_a_port_already_taken_fails_loudly_naming_the_child(up: Up, taken: str) -> None:
    if taken == "router":
        host, port = "127.0.0.1", up.port
    else:
        host, port = next(s.ip for s in SPECS if s.name == taken), up.pod_port
    with leftover(host, port):
        up.start()
        assert up.process is not None
        code = up.process.wait(START_S)
    out = up.output()
    print(f"\n{taken} port taken: exit {code}\n{out}")
    assert code != 0
    assert "is serving on" not in out
    failure = [line for line in out.splitlines() if "pdgate up:" in line]
    assert failure and taken in failure[0], out
    assert "address already in use" in out.lower()  # the child's own log tail
    assert up.seen and up.left_behind() == []


def test_a_pod_dying_fails_loudly_naming_it(up: Up) -> None:
    up.start()
    up.wait_serving()
    os.kill(up.child("--pod-name g0-decode").pid, signal.SIGKILL)
    code = up.wait()
    out = up.output()
    print(f"\npod killed: exit {code}\n{out}")
    assert code != 0
    failure = [line for line in out.splitlines() if "pdgate up:" in line]
    assert failure and "g0-decode" in failure[0], out
    assert up.left_behind() == []
