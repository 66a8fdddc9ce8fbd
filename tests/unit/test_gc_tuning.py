"""The router process's garbage-collector settings (router/gc_tuning.py).

Each case runs in a fresh interpreter: freezing the suite's own process would keep every
test's leftovers alive for the rest of the session.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True,
        text=True, timeout=60, check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_tune_freezes_startup_objects_and_raises_the_young_threshold() -> None:
    state = _run("""
        import gc, json
        from router import gc_tuning
        before = gc.get_threshold()
        built = [{"startup": i} for i in range(1000)]  # what start-up leaves alive
        gc_tuning.tune(12345)
        print(json.dumps({"before": before, "after": gc.get_threshold(),
                          "frozen": gc.get_freeze_count(),
                          "tracked_startup": any(o is built for o in gc.get_objects())}))
    """)
    assert state["after"] == [12345, *state["before"][1:]]
    assert state["frozen"] >= 1000
    # Frozen objects are out of every generation: no collection walks them again.
    assert state["tracked_startup"] is False


def test_zero_keeps_cpythons_defaults() -> None:
    state = _run("""
        import gc, json
        from router import gc_tuning
        before = gc.get_threshold()
        gc_tuning.tune(0)
        print(json.dumps({"before": before, "after": gc.get_threshold(),
                          "frozen": gc.get_freeze_count()}))
    """)
    assert state["after"] == state["before"]
    assert state["frozen"] == 0


def _serve_state(config: Path, *flags: str) -> dict[str, Any]:
    """`pdgate serve` up to the point where it would start serving: the collector then."""
    argv = ["serve", "--config", str(config), "--port", "0", "--log-level", "warning", *flags]
    return _run(f"""
        import gc, json
        from router import cli
        from router.resilience.runner import DrainingRunner
        seen = {{}}
        def run(self):
            seen.update(threshold=gc.get_threshold()[0], frozen=gc.get_freeze_count())
            return 0
        DrainingRunner.run = run
        seen["code"] = cli.main({argv!r})
        print(json.dumps(seen))
    """)


def test_serve_tunes_once_built(tmp_path: Path) -> None:
    """`pdgate serve` freezes what it built and sets `--gc-threshold` before serving."""
    from router.gc_tuning import DEFAULT_YOUNG_THRESHOLD

    state = _serve_state(tmp_path, "--gc-threshold", "4321")
    assert state["code"] == 0
    assert state["threshold"] == 4321 and state["frozen"] > 0
    assert _serve_state(tmp_path)["threshold"] == DEFAULT_YOUNG_THRESHOLD
    kept = _serve_state(tmp_path, "--gc-threshold", "0")
    assert kept["threshold"] == gc.get_threshold()[0] and kept["frozen"] == 0  # CPython's
