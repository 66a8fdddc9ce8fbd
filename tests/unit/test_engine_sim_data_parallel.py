"""`--data-parallel-size`: which rank serves a request (header, vLLM's balancer), each rank's
KV events on its own ports with its rank in every batch, one /metrics page with every
engine, engine ids per rank, and a PD handoff between ranks of two servers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from engine_sim.block_hash import hash_prompt_blocks
from engine_sim.bootstrap import BootstrapServer
from engine_sim.config import SimConfig
from engine_sim.data_parallel import (
    Balancer,
    EngineGroup,
    Load,
    check_rank,
    rank_engine_id,
    rank_from_header,
)
from engine_sim.engine import Engine
from engine_sim.generation import expected_text
from engine_sim.kv_events_pub import KVEventPublisher, start_kv_events
from engine_sim.kv_params import parse_kv_transfer_params
from engine_sim.kvstore import MemoryKVStore
from engine_sim.latency import LatencyModel
from engine_sim.ports import free_port_runs, free_ports
from engine_sim.prompts import STAND_IN
from engine_sim.protocol import RequestError, parse_request
from engine_sim.service import start_engines
from tests.vllm_kv_events import ArrayBlockStored, MapBlockStored, array_decoder, map_decoder

HOST = "127.0.0.1"
PROMPT = "one two three four " * 12  # stand-in tokenizer: 96 tokens, 6 full blocks


def config(**changes: Any) -> SimConfig:
    fields: dict[str, Any] = {
        "role": "both", "model": "m", "port": 0, "host": HOST, "engine_id": "eng",
        "tokenizer": STAND_IN, "latency": LatencyModel.fast(), "python_hash_seed": "0",
        "data_parallel_size": 2, "kv_events_port": 0,
    }  # fmt: skip
    fields.update(changes)
    return SimConfig(**fields)


@pytest.fixture
def group() -> Iterator[EngineGroup]:
    publishers: list[KVEventPublisher] = []
    yield EngineGroup(start_engines(config(), None, publishers))
    assert not publishers  # events off


async def complete(engine: Engine, prompt: str = PROMPT, params: Any = None,
                   max_tokens: int = 2) -> tuple[int, Any, str]:
    """Run one request on `engine`: its cached tokens, kv_transfer_params and text."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens,
            "kv_transfer_params": params}  # fmt: skip
    parsed = parse_request(body, "completion", engine.tokenizer, engine.limits)
    plan = parse_kv_transfer_params(parsed.kv_transfer_params)
    async with engine.run(parsed, "req", plan, time.perf_counter()) as generation:
        text = "".join(generation.pieces)
        return generation.cached_tokens, generation.kv_transfer_params, text


# -- the rank of a request -----------------------------------------------------------------


def test_header_is_read_as_vllm_reads_it() -> None:
    assert rank_from_header(None) is None
    assert rank_from_header("1") == 1
    assert rank_from_header(" 1 ") == 1  # int() strips blanks
    assert rank_from_header("-3") == -3  # refused later, as out of range
    for malformed in ("", "one", "1.0", "0x1"):
        assert rank_from_header(malformed) is None  # no pin: the balancer picks


def test_out_of_range_rank_is_refused_with_vllms_message() -> None:
    check_rank(0, 2)
    check_rank(1, 2)
    for rank in (2, -1):
        with pytest.raises(RequestError) as caught:
            check_rank(rank, 2)
        assert caught.value.status == 400 and caught.value.err_type == "BadRequestError"
        assert caught.value.message == f"data_parallel_rank {rank} is out of range [0, 2)."


def test_group_pins_refuses_and_balances(group: EngineGroup) -> None:
    assert group.choose("1") == 1 and group.choose("0") == 0
    with pytest.raises(RequestError, match=r"data_parallel_rank 2 is out of range \[0, 2\)\."):
        group.choose("2")
    with group.route("0") as engine:  # rank 0 has a request in flight
        assert engine is group.engines[0] and group.balancer.inflight == [1, 0]
        for _ in range(3):  # whatever the scan's start, the idle rank wins
            assert group.choose(None) == 1
            assert group.choose("garbage") == 1
    assert group.balancer.inflight == [0, 0]
    with pytest.raises(RequestError), group.route("5"):
        pass
    assert group.balancer.inflight == [0, 0]  # a refused request was never in flight


def test_balancer_scores_as_vllms_internal_load_balancer() -> None:
    idle = Load(waiting=0, running=0, kv_usage=0.0)
    balancer = Balancer(3)
    # Equal scores: the scan starts one rank further each pick, so idle ranks take turns.
    assert [balancer.pick([idle] * 3) for _ in range(4)] == [0, 1, 2, 0]
    balancer = Balancer(2)
    assert balancer.pick([Load(1, 3, 0.0), Load(0, 2, 0.0)]) == 1  # waiting + running
    # The same waiting + running, but rank 0's queue sits on a nearly full KV cache: its
    # waiting requests weigh 6 x (usage - 0.5) more.
    balancer = Balancer(2)
    assert balancer.pick([Load(2, 1, 0.9), Load(0, 3, 0.9)]) == 1
    balancer = Balancer(2)
    assert balancer.pick([Load(2, 1, 0.5), Load(0, 3, 0.9)]) == 0  # no pressure: a tie
    # The in-flight count is a floor under the snapshot.
    balancer = Balancer(2)
    balancer.inflight[0] = 4
    assert balancer.pick([Load(0, 1, 0.0), Load(0, 3, 0.0)]) == 1


async def test_each_rank_has_its_own_prefix_cache_and_records_its_rank(
    group: EngineGroup,
) -> None:
    rank0, rank1 = group.engines
    assert (await complete(rank0))[0] == 0
    assert (await complete(rank0))[0] == 80  # 5 of 6 blocks: vLLM computes the last token
    assert (await complete(rank1))[0] == 0  # rank 0's blocks are not rank 1's
    assert [r["rank"] for r in rank0.stats_json()["recent"]] == [0, 0]
    assert [r["rank"] for r in rank1.stats_json()["recent"]] == [1]
    stats = rank1.stats_json()
    assert stats["engine_id"] == "eng_dp1" and stats["data_parallel_rank"] == 1


async def test_one_engine_keeps_its_id_and_records_no_rank() -> None:
    (engine,) = start_engines(config(data_parallel_size=1), None, [])
    await complete(engine)
    stats = engine.stats_json()
    assert stats["engine_id"] == "eng" and "data_parallel_rank" not in stats
    assert "rank" not in stats["recent"][0]


def test_engine_ids_per_rank_are_vllms() -> None:
    assert rank_engine_id("eng", 0, 1) == "eng"
    assert [rank_engine_id("eng", r, 2) for r in (0, 1)] == ["eng_dp0", "eng_dp1"]


# -- /metrics --------------------------------------------------------------------------------


def _engines_per_family(engines: list[Engine]) -> dict[str, set[str]]:
    page = engines[0].metrics.render().decode()
    assert all(e.metrics.render().decode() == page for e in engines)  # one page
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if "engine" in sample.labels:
                out.setdefault(family.name, set()).add(sample.labels["engine"])
    return out


async def test_metrics_page_has_every_series_once_per_engine() -> None:
    engines = start_engines(config(), None, [])
    await complete(engines[1])
    families = _engines_per_family(engines)
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries", "vllm:prompt_tokens",
            "vllm:time_to_first_token_seconds", "vllm:request_success"} <= set(families)
    assert all(ranks == {"0", "1"} for ranks in families.values()), families
    page = engines[0].metrics.render().decode()
    assert 'vllm:prompt_tokens_total{engine="1",model_name="m"} 96.0' in page
    assert 'vllm:prompt_tokens_total{engine="0",model_name="m"} 0.0' in page
    assert page.count("# TYPE vllm:prompt_tokens_total counter") == 1
    single = _engines_per_family(start_engines(config(data_parallel_size=1), None, []))
    assert all(ranks == {"0"} for ranks in single.values())


# -- KV events ---------------------------------------------------------------------------------


async def _subscribe(context: zmq.asyncio.Context, port: int) -> zmq.asyncio.Socket:
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://{HOST}:{port}")
    return sub


async def first_batch(sub: zmq.asyncio.Socket, engine: Engine) -> bytes:
    """A batch `sub` received: requests with new prompts go to `engine` until one arrives
    (a ZMQ subscriber misses what is sent before its subscription lands)."""
    for attempt in range(200):
        await complete(engine, prompt=f"r{engine.rank} w{attempt} " * 40)
        try:
            return (await asyncio.wait_for(sub.recv_multipart(), 0.05))[2]
        except TimeoutError:
            continue
    raise AssertionError("no KV events batch reached the subscriber")


async def _replay(context: zmq.asyncio.Context, port: int) -> list[bytes]:
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://{HOST}:{port}")
    try:
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        payloads: list[bytes] = []
        while True:
            _, seq, payload = await asyncio.wait_for(dealer.recv_multipart(), 5)
            if int.from_bytes(seq, "big", signed=True) == -1:
                return payloads
            payloads.append(payload)
    finally:
        dealer.close(0)


@pytest.mark.parametrize("layout", ["map", "array"])
async def test_rank_publishes_on_offset_ports_with_its_rank(layout: str) -> None:
    """vLLM's `offset_endpoint_port`: rank r binds the events port + r and the replay
    port + r; every batch says `data_parallel_rank` r (decoded with vLLM's structs)."""
    base, replay = free_port_runs(2, 2, HOST)
    cfg = config(kv_events_port=base, kv_events_replay_port=replay, kv_events_layout=layout)
    publishers: list[KVEventPublisher] = []
    context = zmq.asyncio.Context()
    subs: list[zmq.asyncio.Socket] = []
    try:
        engines = start_engines(cfg, None, publishers)
        assert [p.endpoint for p in publishers] == [f"tcp://{HOST}:{base}",
                                                    f"tcp://{HOST}:{base + 1}"]
        assert [p.replay_endpoint for p in publishers] == [f"tcp://{HOST}:{replay}",
                                                           f"tcp://{HOST}:{replay + 1}"]
        subs += [await _subscribe(context, base + rank) for rank in (0, 1)]
        decode = map_decoder if layout == "map" else array_decoder
        stored_type = MapBlockStored if layout == "map" else ArrayBlockStored
        for rank in (1, 0):
            batch = decode.decode(await first_batch(subs[rank], engines[rank]))
            assert batch.data_parallel_rank == rank
            stored = batch.events[0]
            assert isinstance(stored, stored_type)
            assert set(stored.block_hashes) <= set(engines[rank].cache._blocks)
            # Each rank numbers its own batches from 0 and replays them on its own port.
            replayed = [decode.decode(p) for p in await _replay(context, replay + rank)]
            assert len(replayed) == publishers[rank].last_seq + 1
            assert {b.data_parallel_rank for b in replayed} == {rank}
        assert not set(engines[0].cache._blocks) & set(engines[1].cache._blocks)
    finally:
        for sub in subs:
            sub.close(0)
        for publisher in publishers:
            publisher.close()
        context.term()


def test_rank_zero_ports_are_the_configured_ones() -> None:
    base, replay = free_ports(2, HOST)
    publisher = start_kv_events(config(kv_events_port=base, kv_events_replay_port=replay), 0)
    assert publisher is not None
    try:
        assert publisher.endpoint == f"tcp://{HOST}:{base}"
        assert publisher.replay_endpoint == f"tcp://{HOST}:{replay}"
    finally:
        publisher.close()


# -- PD between ranks --------------------------------------------------------------------------


async def test_prefill_at_one_rank_hands_its_ids_and_decode_at_another_loads_it() -> None:
    """NIXL shape: the handle names the serving rank's engine id; the transfer-id shape:
    the bootstrap server lists each rank and decode pulls from rank 1's id."""
    store = MemoryKVStore()
    prefill = EngineGroup(start_engines(config(role="prefill", engine_id="p"), store, []))
    decode = EngineGroup(start_engines(config(role="decode", engine_id="d"), store, []))
    bootstrap = BootstrapServer(HOST, 0)
    await bootstrap.start()
    try:
        for engine in prefill.engines:
            bootstrap.register_self(engine.engine_id, HOST, 1, engine.rank)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://{HOST}:{bootstrap.port}/query") as response:
                listed = await response.json()
        assert {dp: entry["engine_id"] for dp, entry in listed.items()} == {
            "0": "p_dp0", "1": "p_dp1"}

        _, handle, _ = await complete(prefill.engines[1], max_tokens=1,
                                   params={"do_remote_decode": True, "do_remote_prefill": False})
        assert handle["remote_engine_id"] == "p_dp1"
        # vLLM's NixlConnector: the side-channel port + the rank (VLLM_NIXL_SIDE_CHANNEL_*).
        assert (handle["remote_host"], handle["remote_port"]) == ("localhost", 5601)
        ids = prefill.engines[1].tokenizer.request_ids("completion", {"prompt": PROMPT})[0]
        assert len(handle["mooncake_store_keys"]) == len(hash_prompt_blocks(ids, 16))
        _, _, text = await complete(decode.engines[0], params=handle, max_tokens=4)
        assert text == expected_text(ids, 4, kv_from_store=True, model="m")

        xfer = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "x1"}
        await complete(prefill.engines[1], prompt=PROMPT + "nine", params=xfer, max_tokens=1)
        pull = {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": "x1",
                "remote_bootstrap_addr": f"http://{HOST}:{bootstrap.port}",
                "remote_engine_id": "p_dp1"}  # fmt: skip
        _, _, text = await complete(decode.engines[0], prompt=PROMPT + "nine", params=pull,
                                    max_tokens=4)
        ids = prefill.engines[1].tokenizer.request_ids("completion",
                                                       {"prompt": PROMPT + "nine"})[0]
        assert text == expected_text(ids, 4, kv_from_store=True, model="m")
        records = decode.engines[0].stats_json()["recent"]
        assert [(r["kind"], r["kv_from_store"], r["rank"]) for r in records] == [
            ("decode", True, 0), ("decode", True, 0)]
        assert decode.engines[1].stats_json()["recent"] == []
    finally:
        await bootstrap.stop()


def test_rank_ports_do_not_overlap() -> None:
    """Rank r binds both ports + r: by default replay is off with several ranks (5557 + 1
    is 5558), and a replay port inside the events ports' run is refused."""
    from engine_sim.cli import parse_config

    pod = ["--role", "both", "--port", "0", "--model", "m"]
    assert parse_config([*pod, "-dp", "2"]).kv_events_replay_port == 0
    assert parse_config(pod).kv_events_replay_port is None  # one rank: the default replay
    ranks = [*pod, "--data-parallel-size", "4", "--kv-events-port", "6000"]
    assert parse_config([*ranks, "--kv-events-replay-port", "6004"]).kv_events_replay_port == 6004
    with pytest.raises(SystemExit):
        parse_config([*ranks, "--kv-events-replay-port", "6003"])
