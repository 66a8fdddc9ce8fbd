"""A test run stopped by SIGTERM (a CI job's timeout, `kill`) stops the simulator pods and
Mooncake master its fixtures started, instead of leaving them running without a parent
(`tests/conftest.py` takes SIGTERM as Ctrl-C, so every fixture is torn down)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
INNER_SUITE = "tests/fixtures/interrupted_suite.py"
PYTEST_INTERRUPTED = 2
START_WITHIN_S = 60.0  # the inner run's start-up, its pod's and its master's


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_sigterm_stops_the_pods_and_master_a_test_run_started(tmp_path: Path) -> None:
    pids_file = tmp_path / "pids"
    inner = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", INNER_SUITE],
        cwd=REPO, env={**os.environ, "PDGATE_HOLD_PIDS": str(pids_file)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    pids: list[int] = []
    try:
        deadline = time.monotonic() + START_WITHIN_S
        while not pids_file.exists() and inner.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pids_file.exists(), inner.communicate()[0].decode(errors="replace")
        pids = [int(pid) for pid in pids_file.read_text().split()]
        assert len(pids) == 2 and all(_running(pid) for pid in pids)
        inner.send_signal(signal.SIGTERM)
        output = inner.communicate(timeout=60)[0].decode(errors="replace")
    finally:
        if inner.poll() is None:
            inner.kill()
            inner.wait()
        leftover = [pid for pid in pids if _running(pid)]
        for pid in leftover:  # what the run left behind must not outlive this test
            os.kill(pid, signal.SIGKILL)
    assert inner.returncode == PYTEST_INTERRUPTED, output
    assert leftover == [], f"left running: {leftover}\n{output}"
