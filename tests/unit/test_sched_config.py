"""Scheduler config: defaults, the shipped file, validation, hot reload, and the runtime."""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from router.load import InFlight
from router.resources import ModelServer, ObjectMeta, PDGroup, Pod
from router.scheduling import ScheduleRequest
from router.scheduling.config import (
    DEFAULT_PROFILES,
    SchedulerConfig,
    SchedulerConfigError,
    load_scheduler_config,
    parse_scheduler_config,
)
from router.scheduling.metrics import SchedulerMetrics
from router.scheduling.runtime import SchedulerRuntime, build_scheduler
from router.scheduling.watcher import SchedulerConfigWatcher
from router.view import ClusterView

REPO = Path(__file__).resolve().parents[2]


def test_defaults_without_a_file() -> None:
    config = load_scheduler_config(None)
    assert config == SchedulerConfig()
    assert [s.type for s in config.profile("prefill").scorers] == [
        "prefix-cache", "prefill-backlog", "queue", "cache-pressure"]
    assert [s.type for s in config.profile("decode").scorers] == [
        "least-request", "queue", "kv-cache-usage"]
    assert config.profile("aggregated") == DEFAULT_PROFILES["aggregated"]
    assert not config.precise_enabled
    assert config.engine_metrics.interval_s == 0.2


def test_the_shipped_file_spells_out_the_defaults() -> None:
    assert load_scheduler_config(REPO / "config" / "scheduler.yaml") == SchedulerConfig()


def test_parse_a_full_config() -> None:
    config = parse_scheduler_config({
        "kind": "SchedulerConfig",
        "profiles": {
            "prefill": {
                "unit": "score",
                "filters": ["ready", {"type": "not-saturated", "maxWaiting": 8}],
                "scorers": [{"type": "precise-prefix-cache", "weight": 2, "storeHitFactor": 0.5},
                            {"type": "session-affinity", "weight": 0.5}],
                "picker": {"tieTolerance": 0, "guard": {"absolute": 4, "relative": 1.5}},
            },
            "decode": {"unit": "score", "scorers": ["random"]},
        },
        "pairing": {"decodeWeight": 0.5},
        "costModel": {"prefillSecondsPerToken": 0.0002, "decodeAdmission": "20ms"},
        "preciseIndex": {"replayPort": None, "storeMedia": ["MOONCAKE", "REDIS"],
                         "replayTimeout": "1s"},
        "engineMetrics": {"interval": "100ms", "timeout": 0.5},
    })
    prefill = config.profile("prefill")
    assert prefill.unit == "score"
    assert prefill.scorers[0].params == {"storeHitFactor": 0.5}
    assert prefill.filters[1].params["maxWaiting"] == 8.0
    assert prefill.picker.guard.absolute == 4.0 and prefill.picker.tie_tolerance == 0.0
    assert config.profile("aggregated") == DEFAULT_PROFILES["aggregated"]
    assert config.pairing.decode_weight == 0.5
    assert config.cost_model.decode_admission_s == pytest.approx(0.02)
    assert config.precise_index.replay_port is None
    assert config.precise_index.replay_timeout_s == 1.0
    assert config.engine_metrics.interval_s == pytest.approx(0.1)
    assert config.precise_enabled


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"profile": {}}, "unknown key 'profile'"),
        ({"profiles": {"prefil": {}}}, "unknown profile 'prefil'"),
        ({"profiles": {"prefill": {"scorers": []}}}, "non-empty list"),
        ({"profiles": {"prefill": {"scorers": ["nope"]}}}, "unknown scorer 'nope'"),
        ({"profiles": {"prefill": {"scorers": [{"type": "queue", "treshold": 3}]}}},
         "unknown parameter 'treshold'"),
        ({"profiles": {"prefill": {"scorers": [{"type": "queue", "threshold": "x"}]}}},
         "threshold must be a float"),
        ({"profiles": {"prefill": {"scorers": ["queue"], "filters": ["nope"]}}},
         "unknown filter 'nope'"),
        ({"profiles": {"prefill": {"unit": "score", "scorers": ["queue"]}}}, "same unit"),
        ({"costModel": {"prefillSecondsPerToken": "fast"}}, "must be a number"),
        ({"engineMetrics": {"interval": "soon"}}, "invalid duration"),
        ({"preciseIndex": {"enabled": "maybe"}}, "true, false or auto"),
        ({"kind": "Pod"}, "kind must be SchedulerConfig"),
        ({"approximateIndex": {"blockBytes": 0}}, "must be positive"),
    ],
)
def test_invalid_configs_are_refused_with_the_key(raw: dict[str, object], message: str) -> None:
    with pytest.raises(SchedulerConfigError, match=message):
        parse_scheduler_config(raw)


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(SchedulerConfigError, match="cannot read"):
        load_scheduler_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("profiles: [\n")
    with pytest.raises(SchedulerConfigError, match=r"bad\.yaml: not valid YAML"):
        load_scheduler_config(bad)
    multi = tmp_path / "multi.yaml"
    multi.write_text("kind: ModelRoute\n---\nkind: SchedulerConfig\npairing: {decodeWeight: 2}\n")
    assert load_scheduler_config(multi).pairing.decode_weight == 2.0


def test_watcher_applies_valid_edits_and_keeps_the_config_on_bad_ones(tmp_path: Path) -> None:
    path = tmp_path / "scheduler.yaml"
    path.write_text("pairing: {decodeWeight: 1}\n")
    applied: list[SchedulerConfig] = []
    registry = CollectorRegistry()
    watcher = SchedulerConfigWatcher(path, applied.append, SchedulerMetrics(registry), 0.01)
    assert not watcher.check()  # unchanged since start
    path.write_text("pairing: {decodeWeight: 3}\n")
    os.utime(path, ns=(1, 1))
    assert watcher.check()
    assert applied[-1].pairing.decode_weight == 3.0
    path.write_text("pairing: {decodeWeight: oops}\n")
    assert not watcher.check()
    assert len(applied) == 1
    path.unlink()
    assert not watcher.check()
    assert registry.get_sample_value(
        "pdgate_scheduler_config_reloads_total", {"result": "ok"}) == 1
    assert registry.get_sample_value(
        "pdgate_scheduler_config_reloads_total", {"result": "error"}) == 1


# -- the runtime -------------------------------------------------------------------------------


def _objects(view: ClusterView, pods: list[str]) -> None:
    server = ModelServer(
        meta=ObjectMeta(name="srv"), model="m", inference_engine="vLLM",
        match_labels={"app": "x"}, pd_group=PDGroup("g", {"r": "p"}, {"r": "d"}), port=8000,
    )
    with view.batch():
        view.replace_all("ModelServer", [server])
        view.replace_all("Pod", [
            Pod(meta=ObjectMeta(name=name, labels={"app": "x", "g": "g0", "r": role}),
                ip="127.0.0.1", ready=True)
            for name in pods for role in (name[0],)
        ])


async def test_build_scheduler_runs_and_follows_the_view(tmp_path: Path) -> None:
    path = tmp_path / "scheduler.yaml"
    path.write_text("engineMetrics: {interval: 50ms, timeout: 50ms}\nreload: {interval: 20ms}\n")
    view = ClusterView()
    _objects(view, ["p0", "p1", "d0"])
    registry = CollectorRegistry()
    runtime = build_scheduler(path, InFlight(registry), view, registry, random.Random(1))
    assert isinstance(runtime, SchedulerRuntime)
    server = view.snapshot.servers[("default", "srv")]
    body = {"model": "m", "messages": [{"role": "system", "content": "sys " * 400},
                                       {"role": "user", "content": "hi"}]}
    pick = runtime.scheduler.pick(server, ScheduleRequest("m", "/v1/chat/completions", body,
                                                          {}), frozenset())
    assert pick is not None and pick.prefill is not None
    assert runtime.approx.blocks_of(pick.prefill.key) > 0
    task = asyncio.create_task(runtime.run())
    try:
        await asyncio.sleep(0.05)
        path.write_text("pairing: {decodeWeight: 4}\nreload: {interval: 20ms}\n")
        os.utime(path, ns=(5, 5))
        for _ in range(100):
            if runtime.config.pairing.decode_weight == 4.0:
                break
            await asyncio.sleep(0.02)
        assert runtime.config.pairing.decode_weight == 4.0
        _objects(view, ["p1", "d0"])  # the chosen prefill pod may have left
        if pick.prefill.pod_name == "p0":
            assert runtime.approx.blocks_of(pick.prefill.key) == 0
        assert registry.get_sample_value("pdgate_prefix_index_blocks",
                                         {"index": "approximate"}) is not None
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_apply_config_switches_indexes_and_hasher() -> None:
    registry = CollectorRegistry()
    runtime = SchedulerRuntime(SchedulerConfig(), InFlight(registry), ClusterView(), registry)
    runtime.approx.record("ns/p", [1, 2, 3])
    hasher = runtime.deps.hasher
    runtime.apply_config(parse_scheduler_config({
        "approximateIndex": {"blockBytes": 512},
        "preciseIndex": {"blockSize": 32, "enabled": True, "eventsPort": 6000},
        "sessions": {"maxSessions": 10},
    }))
    assert runtime.approx.total_blocks == 0  # a new block size invalidates every hash
    assert runtime.deps.hasher is not hasher and runtime.deps.hasher.block_size == 32
    assert runtime.kv_events.enabled and runtime.kv_events.events_port == 6000
    assert runtime.deps.sessions.max_sessions == 10
