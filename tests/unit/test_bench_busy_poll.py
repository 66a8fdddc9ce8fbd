"""`python -m benchmarks.busy_poll`'s lineup: the same pdgate twice, once polling."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from benchmarks.busy_poll import lineup
from benchmarks.routers import RunningRouter


def _argv(spec: Any, tmp_path: Path) -> list[str]:
    pod = SimpleNamespace(base_url="http://127.0.0.1:1")
    cluster = SimpleNamespace(shape=SimpleNamespace(mode="agg"), pods=[pod],
                              pdgate_config=lambda path: path)
    router = RunningRouter(spec, cast(Any, cluster), tmp_path)
    return router._argv(8080)


def test_the_polling_pdgate_differs_only_by_its_flag(tmp_path: Path) -> None:
    direct, sleeping, polling, peer = lineup(2.0)
    assert (direct.kind, peer.kind) == ("direct", "vllm-router")
    assert sleeping.name == "pdgate (prefix-cache)"
    assert polling.name == "pdgate (prefix-cache, --busy-poll 2)"
    plain, busy = _argv(sleeping, tmp_path), _argv(polling, tmp_path)
    assert "--busy-poll" not in plain
    assert busy == [*plain, "--busy-poll", "2"]
