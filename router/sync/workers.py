"""`pdgate serve --workers N`: N router processes on one port, one supervisor.

Each worker binds its own listening socket with SO_REUSEPORT and the kernel spreads new
connections over them (by a hash of the connection's addresses), rather than all workers
accepting from one inherited socket: with one shared socket under epoll the worker that
is already awake tends to win every accept, so the busiest worker gets busier; with
SO_REUSEPORT each worker has its own accept queue. The cost: a connection is pinned to
one worker for its life (keep-alive clients spread per connection, not per request), and
connections queued on a worker that dies are reset. The supervisor restarts a worker that
exits on its own, forwards SIGTERM/SIGINT to every worker (each drains as one process
does) and exits when they have all exited; a worker whose supervisor dies gets SIGTERM
(`exit_with_supervisor`).

`auto` is the CPUs this process may run on: the affinity mask (`os.sched_getaffinity`),
capped by the cgroup v2 quota (`cpu.max`, rounded up): a container limited to 1.5 CPUs
gets 2 workers, not one per host core.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Final

log = logging.getLogger("pdgate.sync.workers")

#: The environment variable a worker process reads its place from: "host_id:index:count".
WORKER_ENV: Final = "PDGATE_WORKER"
#: The environment variable a worker reads its supervisor's pid from.
SUPERVISOR_ENV: Final = "PDGATE_SUPERVISOR_PID"
#: prctl(2) option: the signal a process gets when its parent dies (Linux).
PR_SET_PDEATHSIG: Final = 1
#: Most workers `--workers` accepts.
MAX_WORKERS: Final = 256
#: A worker that exits sooner than this after its start is not restarted (a config error
#: would otherwise loop); the supervisor stops instead.
MIN_UPTIME_S: Final = 5.0
CGROUP_CPU_MAX: Final = Path("/sys/fs/cgroup/cpu.max")


def cgroup_cpus(cpu_max: Path = CGROUP_CPU_MAX) -> float | None:
    """The cgroup v2 CPU quota in CPUs ("max" or no file: None)."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def available_cpus(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The CPUs this process may use: affinity mask, capped by the cgroup quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpus(cpu_max)
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def parse_workers(text: str) -> int:
    """`--workers`: a positive number or `auto`."""
    if text == "auto":
        return available_cpus()
    try:
        count = int(text)
    except ValueError:
        raise ValueError(f"--workers {text!r}: a number or 'auto'") from None
    if not 1 <= count <= MAX_WORKERS:
        raise ValueError(f"--workers {count}: between 1 and {MAX_WORKERS}")
    return count


def worker_place() -> tuple[str, int, int] | None:
    """(host id, index, count) when this process is a supervised worker."""
    value = os.environ.get(WORKER_ENV)
    if not value:
        return None
    host_id, index, count = value.split(":")
    return host_id, int(index), int(count)


def exit_with_supervisor() -> None:
    """A worker: get SIGTERM (and drain) when the supervisor dies, even by SIGKILL.

    Without it a killed supervisor left its workers serving the port, unsupervised, and a
    new supervisor's workers shared it with them. Linux only (prctl); elsewhere a no-op.
    A supervisor that died before this call is noticed by the parent pid.
    """
    expected = os.environ.get(SUPERVISOR_ENV)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if expected is not None and os.getppid() != int(expected):
        os.kill(os.getpid(), signal.SIGTERM)


def new_host_id() -> str:
    """A fresh id per router start: a restarted replica is a new origin to its peers."""
    return uuid.uuid4().hex[:12]


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket with SO_REUSEPORT, for uvicorn's `serve(sockets=...)`.

    Bound, not listening: uvicorn listens on it once the app's start-up is complete (a
    worker's start-up waits for its view and tokenizers, `AppState._warm_up`), and only a
    listening socket gets connections from the kernel. Listening here, the kernel queued
    connections on a worker that was still starting, for seconds.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(False)
    return sock


class Supervisor:
    """Starts `count` copies of this command as workers and keeps them running."""

    def __init__(self, argv: list[str], count: int, host_id: str | None = None) -> None:
        self.argv = argv
        self.count = count
        self.host_id = host_id or new_host_id()
        self.children: dict[int, tuple[subprocess.Popen[bytes], float]] = {}
        self.stopping = False

    def _start(self, index: int) -> None:
        env = dict(os.environ)
        env[WORKER_ENV] = f"{self.host_id}:{index}:{self.count}"
        env[SUPERVISOR_ENV] = str(os.getpid())
        process = subprocess.Popen([sys.executable, "-m", "router", *self.argv], env=env)
        self.children[index] = (process, time.monotonic())
        log.info("worker %d started (pid %d)", index, process.pid)

    def _forward(self, signum: int, _frame: object) -> None:
        self.stopping = True
        for process, _ in self.children.values():
            if process.poll() is None:
                process.send_signal(signum)

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._forward)
        for index in range(self.count):
            self._start(index)
        status = 0
        while self.children:
            time.sleep(0.2)
            for index, (process, started) in list(self.children.items()):
                code = process.poll()
                if code is None:
                    continue
                del self.children[index]
                if self.stopping:
                    status = status or code
                    continue
                if time.monotonic() - started < MIN_UPTIME_S:
                    log.error("worker %d exited %d right after its start: stopping", index, code)
                    self._forward(signal.SIGTERM, None)
                    status = code or 1
                    continue
                log.error("worker %d exited %d: restarting it", index, code)
                self._start(index)
        return status
