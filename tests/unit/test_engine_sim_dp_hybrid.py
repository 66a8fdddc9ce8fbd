"""One node of a multi-node data-parallel deployment (vLLM's hybrid and external load
balancing): the process runs global ranks S..S+L-1, `X-data-parallel-rank` is an index
among them, and every other surface names an engine by its global rank."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from engine_sim.bootstrap import BootstrapServer
from engine_sim.config import SimConfig
from engine_sim.data_parallel import EngineGroup, rank_view
from engine_sim.engine import Engine
from engine_sim.kv_events_pub import KVEventPublisher, cache_view
from engine_sim.latency import LatencyModel
from engine_sim.ports import free_port_runs
from engine_sim.prompts import STAND_IN
from engine_sim.protocol import RequestError
from engine_sim.service import register_workers, start_engines
from tests.unit.test_engine_sim_data_parallel import complete
from tests.vllm_kv_events import map_decoder

HOST = "127.0.0.1"


def node(**changes: Any) -> SimConfig:
    """The second node of a 4-rank deployment: global ranks 2 and 3."""
    fields: dict[str, Any] = {
        "role": "both", "model": "m", "port": 0, "host": HOST, "engine_id": "eng",
        "tokenizer": STAND_IN, "latency": LatencyModel.fast(), "python_hash_seed": "0",
        "data_parallel_size": 4, "data_parallel_size_local": 2,
        "data_parallel_start_rank": 2, "kv_events_port": 0,
    }  # fmt: skip
    fields.update(changes)
    return SimConfig(**fields)


def test_the_node_runs_its_global_ranks_with_local_engine_ids() -> None:
    """Engines keep their global rank; the engine id carries the local rank, as vLLM's
    `_dp<local_dp_rank>` (counted from 0 on every node)."""
    engines = start_engines(node(), None, [])
    assert [e.rank for e in engines] == [2, 3]
    assert [e.local_rank for e in engines] == [0, 1]
    assert [e.engine_id for e in engines] == ["eng_dp0", "eng_dp1"]
    (one,) = start_engines(node(data_parallel_size_local=1, data_parallel_start_rank=3), None,
                           [])
    assert (one.rank, one.engine_id) == (3, "eng_dp0")  # external LB: one engine, rank R


def test_header_is_an_index_among_the_nodes_engines() -> None:
    """vLLM's hybrid LB: `X-data-parallel-rank` i indexes `core_engines` (global ranks
    S..S+L-1), checked against [0, L); a non-integer is no pin, balanced locally."""
    group = EngineGroup(start_engines(node(), None, []))
    assert group.engines[group.choose("1")].rank == 3
    assert group.engines[group.choose("0")].rank == 2
    for pin in ("2", "3", "-1"):
        with pytest.raises(RequestError) as caught:
            group.choose(pin)
        assert caught.value.status == 400
        assert caught.value.message == f"data_parallel_rank {pin} is out of range [0, 2)."
    with group.route("1") as engine:
        assert engine.rank == 3 and group.balancer.inflight == [0, 1]
        for _ in range(3):  # not a pin: the balancer picks the idle local engine
            assert group.engines[group.choose("x")].rank == 2
            assert group.engines[group.choose(None)].rank == 2


async def test_stats_records_and_metrics_name_global_ranks() -> None:
    engines = start_engines(node(), None, [])
    await complete(engines[1])
    stats = engines[1].stats_json()
    assert stats["data_parallel_rank"] == 3 and stats["engine_id"] == "eng_dp1"
    assert [r["rank"] for r in stats["recent"]] == [3]
    page = engines[0].metrics.render().decode()
    labels = {sample.labels["engine"] for family in text_string_to_metric_families(page)
              for sample in family.samples if "engine" in sample.labels}
    assert labels == {"2", "3"}  # vLLM's StatLoggerManager(engine_idxs=engine_ranks_managed)
    assert 'vllm:prompt_tokens_total{engine="3",model_name="m"} 96.0' in page


def test_debug_views_list_the_nodes_ranks_and_take_global_ranks() -> None:
    engines = start_engines(node(), None, [])
    body = rank_view(engines, None, cache_view)
    assert [body[k] for k in ("data_parallel_size", "data_parallel_size_local",
                              "data_parallel_start_rank")] == [4, 2, 2]
    assert [r["data_parallel_rank"] for r in body["ranks"]] == [2, 3]
    assert rank_view(engines, "3", Engine.stats_json)["data_parallel_rank"] == 3
    for rank in ("1", "4"):
        with pytest.raises(ValueError, match=r"rank \d is out of range \[2, 4\)"):
            rank_view(engines, rank, cache_view)
    # External LB: one engine, still listed as this node's rank of the deployment.
    one = start_engines(node(data_parallel_size_local=1, data_parallel_start_rank=1), None, [])
    single = rank_view(one, None, Engine.stats_json)
    assert (single["data_parallel_size_local"], single["data_parallel_start_rank"]) == (1, 1)
    assert [r["data_parallel_rank"] for r in single["ranks"]] == [1]
    assert rank_view(one, "1", Engine.stats_json)["engine_id"] == "eng_dp0"


async def _first_batch(sub: zmq.asyncio.Socket, engine: Engine) -> Any:
    """A batch `sub` received, requests with new prompts sent to `engine` until one arrives
    (a ZMQ subscriber misses what is sent before its subscription lands)."""
    for attempt in range(200):
        await complete(engine, prompt=f"r{engine.rank} w{attempt} " * 40)
        try:
            return map_decoder.decode((await asyncio.wait_for(sub.recv_multipart(), 0.05))[2])
        except TimeoutError:
            continue
    raise AssertionError("no KV events batch reached the subscriber")


async def test_kv_events_ports_and_batches_carry_the_global_rank() -> None:
    """vLLM creates each publisher with `data_parallel_index`, the global rank: ports
    + global rank, `data_parallel_rank` the global rank."""
    base, replay = free_port_runs(2, 4, HOST)
    publishers: list[KVEventPublisher] = []
    context = zmq.asyncio.Context()
    sub = context.socket(zmq.SUB)
    try:
        engines = start_engines(node(kv_events_port=base, kv_events_replay_port=replay), None,
                                publishers)
        assert [p.endpoint for p in publishers] == [f"tcp://{HOST}:{base + r}" for r in (2, 3)]
        assert [p.replay_endpoint for p in publishers] == [f"tcp://{HOST}:{replay + r}"
                                                           for r in (2, 3)]
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://{HOST}:{base + 3}")
        assert (await _first_batch(sub, engines[1])).data_parallel_rank == 3
    finally:
        sub.close(0)
        for publisher in publishers:
            publisher.close()
        context.term()


def test_bootstrap_lists_the_nodes_engines_under_their_local_ranks() -> None:
    """vLLM's Mooncake worker registers `data_parallel_rank_local` with local engines only
    (each node has its own bootstrap server)."""
    bootstrap = BootstrapServer(HOST, 0)
    register_workers(bootstrap, start_engines(node(), None, []), HOST, 8000)
    assert {r: e.engine_id for r, e in bootstrap.registry.workers.items()} == {
        0: "eng_dp0", 1: "eng_dp1"}


# -- flags -----------------------------------------------------------------------------------

POD = ["--role", "both", "--port", "0", "--model", "m"]


def _ranks(*flags: str) -> range:
    from engine_sim.cli import parse_config

    return parse_config([*POD, *flags]).data_parallel_ranks


def test_flags_pick_the_nodes_ranks_as_vllm_does() -> None:
    assert _ranks() == range(0, 1)
    assert _ranks("-dp", "4") == range(0, 4)  # one API server for all ranks
    hybrid = ["-dp", "4", "--data-parallel-size-local", "2", "--data-parallel-start-rank", "2"]
    assert _ranks(*hybrid, "--data-parallel-hybrid-lb") == range(2, 4)
    assert _ranks(*hybrid) == range(2, 4)  # vLLM infers hybrid from a nonzero start rank
    assert _ranks("-dp", "4", "-dpl", "2", "-dph") == range(0, 2)  # the first node
    assert _ranks("-dp", "4", "--data-parallel-rank", "3") == range(3, 4)  # external LB
    assert _ranks("-dp", "4", "-dpn", "1", "-dpl", "1", "-dpr", "1") == range(1, 2)
    assert _ranks("-dp", "2", "-dpl", "2", "-dph") == range(0, 2)  # one node: internal LB


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["-dp", "4", "-dpl", "2"], "runs part of the ranks"),  # no headless nodes here
        (["-dp", "4", "-dpl", "0", "-dph"], "--data-parallel-size-local must be positive"),
        (["-dp", "4", "-dpl", "2", "-dpr", "-1", "-dph"], "must be >= 0"),
        (["-dp", "4", "-dpl", "2", "-dpr", "3", "-dph"], "are past --data-parallel-size 4"),
        (["-dp", "4", "-dpr", "1"], "are past --data-parallel-size 4"),  # L defaults to N
        (["-dp", "4", "-dph"], "--data-parallel-hybrid-lb needs --data-parallel-size-local"),
        (["-dp", "4", "-dpn", "1", "-dph"], "exclude each other"),
        (["-dp", "4", "-dpn", "1", "-dpl", "2"], "--data-parallel-size-local must be 1"),
        (["-dp", "4", "-dpn", "1", "-dpr", "2"], "contradicts --data-parallel-rank 1"),
        (["-dp", "4", "-dpn", "4"], "--data-parallel-rank 4 is out of range [0, 4)"),
        (["-dp", "4", "-dpn", "-1"], "--data-parallel-rank -1 is out of range [0, 4)"),
    ],
)
def test_flags_refuse_what_vllm_or_the_simulator_cannot_run(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _ranks(*flags)
    assert message in capsys.readouterr().err


def test_replay_ports_run_over_the_local_ranks() -> None:
    """The events and replay runs are the local ranks' (+ S both): with more than one
    local rank replay is off by default and a given one must be L away from the events
    port; one local rank binds one port of each run, so the default replay stays on."""
    from engine_sim.cli import parse_config

    hybrid = [*POD, "-dp", "8", "-dpl", "2", "-dpr", "4", "-dph", "--kv-events-port", "6000"]
    assert parse_config(hybrid).kv_events_replay_port == 0
    assert parse_config([*hybrid, "--kv-events-replay-port", "6002"]).kv_events_replay_port \
        == 6002
    with pytest.raises(SystemExit):
        parse_config([*hybrid, "--kv-events-replay-port", "6001"])  # 6005 is rank 5's events
    external = [*POD, "-dp", "8", "--data-parallel-rank", "5"]
    assert parse_config(external).kv_events_replay_port is None  # 5558 + 5: on, as one engine
    assert parse_config([*POD, "-dp", "8", "-dpl", "1", "-dpr", "5", "-dph"]) \
        .kv_events_replay_port is None
    # Several ranks of one API server: as before, the whole run of N ranks.
    assert parse_config([*POD, "-dp", "2"]).kv_events_replay_port == 0
