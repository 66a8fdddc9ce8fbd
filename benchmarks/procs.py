"""Child processes the harness starts, waits for, measures and stops (only its own, by pid).

`ManagedProcess` runs one command with its output in a log file. `ResourceMeter` reads a
process tree's CPU seconds (psutil, the process and its children) at the edges of a
measurement and samples its resident memory in a background thread, keeping the peak.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import psutil

from router.local_cluster import owned_child

STARTUP_TIMEOUT_SECONDS: Final = 60.0
STOP_TIMEOUT_SECONDS: Final = 10.0
RSS_SAMPLE_SECONDS: Final = 0.2


class StartupError(RuntimeError):
    """A child did not become ready (its log tail is in the message)."""


class ManagedProcess:
    """One child process; `stop()` sends SIGTERM, then SIGKILL after a bound."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("ab")
        self._log.write(f"$ {' '.join(self.argv)}\n".encode())
        self._log.flush()
        self.popen: subprocess.Popen[bytes] = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            # Own process group (Ctrl-C reaches the harness only; it stops us in order) and
            # SIGKILL if the harness dies without stopping us (no orphaned pods or routers).
            preexec_fn=owned_child(os.getpid()),
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def wait_http(self, url: str, timeout: float = STARTUP_TIMEOUT_SECONDS) -> None:
        """Poll `url` until it answers 200; fail early if the process exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise StartupError(
                    f"{self.name} exited with {self.popen.returncode}:\n{self.log_tail()}"
                )
            if http_ok(url):
                return
            time.sleep(0.1)
        raise StartupError(f"{self.name}: {url} not ready in {timeout:.0f} s:\n{self.log_tail()}")

    def terminate(self) -> None:
        """Send SIGTERM without waiting (`stop()` then waits); lets many stop at once."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.alive():
            self.terminate()
            try:
                self.popen.wait(timeout=STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                self._kill_tree()
        self._log.close()

    def _kill_tree(self) -> None:
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    child.kill()
        with contextlib.suppress(ProcessLookupError):
            self.popen.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=STOP_TIMEOUT_SECONDS)


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its live children."""
    total = 0.0
    for process in _tree(pid):
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            total += times.user + times.system
    return total


def main_thread_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process's main thread (its event loop, in a router),
    or None if it cannot be read."""
    with contextlib.suppress(psutil.Error):
        for thread in psutil.Process(pid).threads():
            if thread.id == pid:
                return float(thread.user_time + thread.system_time)
    return None


def tree_rss_bytes(pid: int) -> int:
    total = 0
    for process in _tree(pid):
        with contextlib.suppress(psutil.Error):
            total += process.memory_info().rss
    return total


def tree_hwm_bytes(pid: int) -> int | None:
    """Sum of the kernel's per-process RSS high-water marks (Linux VmHWM), if readable."""
    total = 0
    for process in _tree(pid):
        try:
            status = Path(f"/proc/{process.pid}/status").read_text()
        except OSError:
            return None
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                total += int(line.split()[1]) * 1024
                break
    return total or None


class ResourceMeter:
    """Peak RSS of a process tree, sampled in a daemon thread until `close()`."""

    def __init__(self, pid: int, interval: float = RSS_SAMPLE_SECONDS) -> None:
        self.pid = pid
        self.peak_rss = tree_rss_bytes(pid)
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rss-{pid}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak_rss = max(self.peak_rss, tree_rss_bytes(self.pid))

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.pid)

    def close(self) -> int:
        """Stop sampling; the peak RSS in bytes (the kernel's high-water mark if larger)."""
        self._stop.set()
        self._thread.join(timeout=2 * self._interval + 1)
        hwm = tree_hwm_bytes(self.pid)
        return max(self.peak_rss, hwm or 0)
