"""The simulator's KV events over real ZMQ sockets: vLLM's frames, batching, replay, bounds,
the store medium, and a router subscriber whose index ends equal to the cache."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from engine_sim.block_hash import hash_prompt_blocks
from engine_sim.config import SimConfig
from engine_sim.engine import Engine
from engine_sim.kv_events_pub import (
    KVEventPublisher,
    KVEventsError,
    start_kv_events,
    tcp_endpoint,
)
from engine_sim.kv_params import parse_kv_transfer_params
from engine_sim.kvstore import MemoryKVStore
from engine_sim.latency import LatencyModel
from engine_sim.ports import free_port, free_ports
from engine_sim.prefix_cache import PrefixCache
from engine_sim.prompts import STAND_IN
from engine_sim.protocol import parse_request
from router.scheduling.kv_events import (
    Cleared,
    PodEventStream,
    Removed,
    Stored,
    StreamSettings,
    StreamTarget,
    decode_batch,
)
from router.scheduling.metrics import SchedulerMetrics
from router.scheduling.precise_index import PrecisePrefixIndex
from tests.conftest import SimPod
from tests.polling import eventually
from tests.vllm_kv_events import ArrayBlockStored, MapBlockStored, array_decoder, map_decoder

HOST = "127.0.0.1"

#: vLLM's structs (tests/vllm_kv_events.py): decoding with these proves the payload is
#: what vLLM consumers expect.
_vllm_decoder = map_decoder  # vLLM now
_vllm_array_decoder = array_decoder  # vLLM before vllm#42892


class Rig:
    """A publisher on free ports, a SUB socket, and replay requests from a DEALER."""

    def __init__(self, **kwargs: Any) -> None:
        self.port, self.replay_port = free_ports(2, HOST)
        self.publisher = KVEventPublisher(
            tcp_endpoint(HOST, self.port), tcp_endpoint(HOST, self.replay_port), **kwargs
        )
        self.context = zmq.asyncio.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(f"tcp://{HOST}:{self.port}")

    async def recv(self) -> list[bytes]:
        return list(await asyncio.wait_for(self.sub.recv_multipart(), 5.0))

    async def replay(self, start: int) -> list[tuple[int, bytes]]:
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://{HOST}:{self.replay_port}")
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out: list[tuple[int, bytes]] = []
            while True:
                empty, seq, data = await asyncio.wait_for(dealer.recv_multipart(), 5.0)
                assert empty == b""
                number = int.from_bytes(seq, "big", signed=True)
                if number == -1:
                    assert data == b""
                    return out
                out.append((number, data))
        finally:
            dealer.close(0)

    def close(self) -> None:
        self.publisher.close()
        self.sub.close(0)
        self.context.term()


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    made = Rig()
    await asyncio.sleep(0.2)  # let the SUB connection and subscription settle
    yield made
    made.close()


def tokens(n: int, start: int = 0) -> tuple[int, ...]:
    return tuple(range(start, start + n))


async def tick() -> None:
    """Let the loop run the publisher's end-of-tick flush."""
    await asyncio.sleep(0)
    await asyncio.sleep(0)


async def test_frames_are_vllms_topic_seq_and_map_batch(rig: Rig) -> None:
    """vLLM since vllm#42892: a map batch of map events, the tag under "type", fields at
    their default left out (omit_defaults)."""
    cache = PrefixCache(capacity_blocks=8, block_size=16, on_event=rig.publisher.on_cache_event)
    prompt = tokens(40)
    hashes = hash_prompt_blocks(prompt, 16)
    cache.acquire(hashes, prompt)
    await tick()
    topic, seq, payload = await rig.recv()
    assert topic == b"" and seq == (0).to_bytes(8, "big")
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, dict) and raw["data_parallel_rank"] == 0
    assert abs(raw["ts"] - time.time()) < 5
    assert raw["events"] == [{
        "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
        "token_ids": list(prompt[:32]), "block_size": 16, "lora_id": None, "medium": "GPU",
        "lora_name": None, "extra_keys": [None, None], "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }]
    batch = _vllm_decoder.decode(payload)
    event = batch.events[0]
    assert isinstance(event, MapBlockStored)
    assert event.block_hashes == hashes and event.medium == "GPU"
    assert all(0 <= h < 1 << 64 for h in event.block_hashes)
    assert decode_batch(payload) == [
        Stored(tuple(hashes), "GPU", None, tuple(prompt[:32]), 16, None, (None, None))
    ]


async def test_the_array_layout_of_the_releases_before() -> None:
    rig = Rig(layout="array")
    try:
        await asyncio.sleep(0.2)
        cache = PrefixCache(capacity_blocks=8, block_size=16,
                            on_event=rig.publisher.on_cache_event)
        prompt = tokens(40)
        hashes = hash_prompt_blocks(prompt, 16)
        cache.acquire(hashes, prompt)
        await tick()
        _, _, payload = await rig.recv()
        raw = msgspec.msgpack.decode(payload)
        assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 0  # [ts, events, rank]
        # msgspec writes every field of an array_like struct (omit_defaults is for maps).
        assert raw[1] == [
            ["BlockStored", hashes, None, list(prompt[:32]), 16, None, "GPU", None,
             [None, None], 0, "full_attention", None]
        ]
        assert isinstance(_vllm_array_decoder.decode(payload).events[0], ArrayBlockStored)
        assert decode_batch(payload) == [
            Stored(tuple(hashes), "GPU", None, tuple(prompt[:32]), 16, None, (None, None))
        ]
    finally:
        rig.close()


async def test_one_batch_per_loop_tick_and_sequence_counts_up(rig: Rig) -> None:
    cache = PrefixCache(capacity_blocks=2, block_size=4, on_event=rig.publisher.on_cache_event)
    first = hash_prompt_blocks(tokens(8), 4)
    lease = cache.acquire(first, tokens(8))
    cache.release(lease)
    second = hash_prompt_blocks(tokens(8, 100), 4)
    cache.acquire(second, tokens(8, 100))  # evicts both blocks of `first`, stores two
    await tick()
    cache.clear()
    await tick()
    _, seq0, payload0 = await rig.recv()
    _, seq1, payload1 = await rig.recv()
    assert (int.from_bytes(seq0, "big"), int.from_bytes(seq1, "big")) == (0, 1)
    events = decode_batch(payload0)
    # Same tick: stored, then the evictions (one event), then the new blocks.
    assert events[0] == Stored(tuple(first), "GPU", None, tuple(tokens(8)), 4, None, (None,) * 2)
    assert events[1] == Removed((first[1], first[0]), "GPU")  # tail first, like the LRU
    assert events[2] == Stored(
        tuple(second), "GPU", None, tuple(tokens(8, 100)), 4, None, (None,) * 2
    )
    assert decode_batch(payload1) == [Cleared()]
    assert rig.publisher.last_seq == 1


async def test_store_written_blocks_are_published_as_vllms_mooncake_store(rig: Rig) -> None:
    """vLLM's MooncakeStoreWorker: one `BlockStored(medium="cpu")` a block written, its
    parent the prompt's block before it (written or not), group 0, no extra keys."""
    prompt = tokens(80)
    hashes = hash_prompt_blocks(prompt, 16)
    rig.publisher.store_written(hashes, [0, 1, 3], prompt, 16)
    await tick()
    _, _, payload = await rig.recv()
    batch = _vllm_decoder.decode(payload)
    runs = [(e.block_hashes, e.parent_block_hash, e.medium, e.token_ids, e.group_idx,
             e.extra_keys) for e in batch.events if isinstance(e, MapBlockStored)]
    assert runs == [
        ([hashes[0]], None, "cpu", list(prompt[0:16]), 0, None),
        ([hashes[1]], hashes[0], "cpu", list(prompt[16:32]), 0, None),
        ([hashes[3]], hashes[2], "cpu", list(prompt[48:64]), 0, None),
    ]


async def test_replay_answers_from_a_bounded_ring() -> None:
    rig = Rig(buffer_steps=3)
    try:
        await asyncio.sleep(0.2)
        for i in range(5):
            rig.publisher.store_written([1000 + i], [0], tokens(16), 16)
            await tick()
        for _ in range(5):
            await rig.recv()
        got = await rig.replay(0)
        assert [seq for seq, _ in got] == [2, 3, 4]  # the ring kept the last three
        assert decode_batch(got[0][1]) == [
            Stored((1002,), "cpu", None, tuple(tokens(16)), 16, None, None)
        ]
        assert [seq for seq, _ in await rig.replay(4)] == [4]
        assert await rig.replay(9) == []
        assert rig.publisher.stats.replays == 3
    finally:
        rig.close()


async def test_a_full_sender_queue_drops_a_batch_as_a_sequence_gap(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    publisher = rig.publisher
    publisher.store_written([1], [0], tokens(16), 16)
    await tick()

    def full(*args: Any, **kwargs: Any) -> None:
        raise zmq.Again()

    monkeypatch.setattr(publisher, "_tx", _Wrapped(publisher._tx, full))
    publisher.store_written([2], [0], tokens(16), 16)
    await tick()
    monkeypatch.undo()
    publisher.store_written([3], [0], tokens(16), 16)
    await tick()
    seqs = [int.from_bytes((await rig.recv())[1], "big") for _ in range(2)]
    assert seqs == [0, 2]  # seq 1 never went out: subscribers see the gap and resync
    assert publisher.stats.dropped_batches == 1


class _Wrapped:
    def __init__(self, sock: Any, send: Callable[..., None]) -> None:
        self._sock = sock
        self.send_multipart = send

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


async def test_publishing_never_waits_without_subscribers() -> None:
    publisher = KVEventPublisher(tcp_endpoint(HOST, free_port()), None)
    try:
        cache = PrefixCache(capacity_blocks=64, block_size=16, on_event=publisher.on_cache_event)
        started = time.perf_counter()
        for i in range(2000):
            prompt = tokens(64, i * 64)
            cache.release(cache.acquire(hash_prompt_blocks(prompt, 16), prompt))
            await tick()
        elapsed = time.perf_counter() - started
        assert publisher.stats.batches == 2000 and publisher.stats.dropped_batches == 0
        assert elapsed < 10  # bounded work per batch; nothing waited on the network
    finally:
        publisher.close()


def test_start_kv_events_ports() -> None:
    base = SimConfig(role="both", model="m", port=0, host=HOST)
    assert start_kv_events(_with(base, kv_events_port=0)) is None
    taken = socket.socket()
    taken.bind((HOST, 0))
    taken.listen()
    port = int(taken.getsockname()[1])
    try:
        with pytest.raises(KVEventsError):
            start_kv_events(_with(base, kv_events_port=port, kv_events_replay_port=0))
        # Default ports are best effort: a taken one is logged, and the pod runs without.
        publisher = start_kv_events(_with(base, kv_events_port=free_port(),
                                          kv_events_replay_port=0))
        assert publisher is not None and publisher.replay_endpoint is None
        publisher.close()
    finally:
        taken.close()
    assert tcp_endpoint("0.0.0.0", 5557) == "tcp://*:5557"
    assert tcp_endpoint("::1", 5557) == "tcp://[::1]:5557"


def _with(config: SimConfig, **changes: Any) -> SimConfig:
    from dataclasses import replace

    return replace(config, **changes)


async def test_router_subscriber_index_equals_the_cache_after_evictions(rig: Rig) -> None:
    """The router's own subscriber, fed by the publisher: its index is the cache, exactly."""
    index = PrecisePrefixIndex()
    target = StreamTarget("ns/p", f"tcp://{HOST}:{rig.port}", f"tcp://{HOST}:{rig.replay_port}",
                          "", "ns/srv")
    context = zmq.asyncio.Context()
    stream = PodEventStream(target, index, context, SchedulerMetrics(CollectorRegistry()),
                            StreamSettings(2.0, True))
    cache = PrefixCache(capacity_blocks=24, block_size=16, on_event=rig.publisher.on_cache_event)
    task = asyncio.create_task(stream.run())
    try:
        await asyncio.sleep(0.2)
        for i in range(60):  # 20 system prompts, more than the cache holds: evictions
            prompt = tokens(100, 1000 * (i % 20)) + tokens(20, 7 * i)
            cache.release(cache.acquire(hash_prompt_blocks(prompt, 16), prompt))
            if i % 7 == 0:
                await tick()
        await tick()
        last = rig.publisher.last_seq
        await eventually(lambda: stream.last_seq == last)
        assert index.blocks_of("ns/p") == set(cache._blocks)
        assert cache.num_cached == 24
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        context.term()


async def test_sim_pod_publishes_serves_cache_and_cache_config_info(
    sim_pod: Callable[..., SimPod],
) -> None:
    port, replay = free_ports(2, HOST)
    pod = sim_pod(role="both", fast=True, kv_capacity_blocks=64, kv_events_port=port,
                  kv_events_replay_port=replay)
    context = zmq.asyncio.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://{HOST}:{port}")
    try:
        await asyncio.sleep(0.3)
        body = {"model": pod.model, "prompt": "hello world " * 40, "max_tokens": 2}
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{pod.base_url}/v1/completions", json=body) as response:
                assert response.status == 200
            _, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
            assert seq == (0).to_bytes(8, "big")
            stored = [e for e in decode_batch(payload) if isinstance(e, Stored)]
            async with http.get(f"{pod.base_url}/sim/cache") as response:
                cache = await response.json()
            async with http.get(f"{pod.base_url}/metrics") as response:
                metrics = await response.text()
        assert set(stored[0].block_hashes) == set(cache["block_hashes"])
        assert cache["kv_events"]["last_seq"] == 0 and cache["capacity_blocks"] == 64
        assert ('vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="64"} 1.0'
                in metrics)
    finally:
        sub.close(0)
        context.term()


# -- the engine: store writes as vLLM's Mooncake Store events, prefix reuse through the store --


def _engine(publisher: KVEventPublisher | None, store: MemoryKVStore, **changes: Any) -> Engine:
    # The stand-in tokenizer: one token per word and per space, so block counts are exact.
    changes.setdefault("latency", LatencyModel.fast())
    changes.setdefault("role", "prefill")
    config = SimConfig(model="m", port=0, host=HOST, tokenizer=STAND_IN,
                       python_hash_seed="0", **changes)
    engine = Engine(config, store, publisher.on_cache_event if publisher else None)
    engine.kv_events = publisher
    return engine


async def _prefill(engine: Engine, prompt: str) -> int:
    """Run one PD prefill leg; the prompt's cached tokens (local cache + store)."""
    parsed = parse_request({"model": "m", "prompt": prompt, "max_tokens": 1}, "completion",
                           engine.tokenizer, engine.limits)
    plan = parse_kv_transfer_params({"do_remote_decode": True, "do_remote_prefill": False})
    async with engine.run(parsed, "req", plan, time.perf_counter()) as generation:
        return generation.cached_tokens


async def test_an_adapters_blocks_are_its_own_and_say_so(rig: Rig) -> None:
    """`--lora-modules`: a request naming the adapter hashes its blocks with the adapter's
    name (vLLM's `_gen_lora_extra_hash_keys`), so it reuses none of the base model's, and
    its `BlockStored` names the adapter and carries it in every block's extra keys."""
    engine = _engine(rig.publisher, MemoryKVStore(), role="both",
                     lora_modules=(("sql-lora", "/adapters/sql"),))
    prompt = "one two three four " * 8  # 64 tokens: 4 full blocks

    async def run(model: str) -> int:
        parsed = parse_request({"model": model, "prompt": prompt, "max_tokens": 1},
                               "completion", engine.tokenizer, engine.limits)
        plan = parse_kv_transfer_params(None)
        async with engine.run(parsed, "req", plan, time.perf_counter()) as generation:
            return generation.cached_tokens

    assert await run("m") == 0
    assert await run("sql-lora") == 0  # the base model's blocks are not the adapter's
    assert await run("sql-lora") == 48  # its own are (vLLM recomputes the last token)
    await tick()
    events: list[Any] = []
    while len([e for e in events if isinstance(e, Stored)]) < 2:
        events.extend(decode_batch((await rig.recv())[2]))
    ids = engine.tokenizer.request_ids("completion", {"prompt": prompt})[0]
    base, adapter = (e for e in events if isinstance(e, Stored))
    assert base.lora_name is None and base.extra_keys == (None,) * 4
    assert adapter.lora_name == "sql-lora" and adapter.extra_keys == (["sql-lora"],) * 4
    assert adapter.block_hashes == tuple(engine.block_hashes.hashes(ids, None, "sql-lora"))
    assert not set(adapter.block_hashes) & set(base.block_hashes)
    with pytest.raises(Exception, match="does not exist"):
        parse_request({"model": "other-lora", "prompt": prompt}, "completion",
                      engine.tokenizer, engine.limits)


async def test_engine_publishes_store_writes_as_vllms_mooncake_store(rig: Rig) -> None:
    store = MemoryKVStore()
    engine = _engine(rig.publisher, store)
    prompt = "one two three four " * 20  # 160 tokens: 10 full blocks
    await _prefill(engine, prompt)
    await tick()
    events: list[Any] = []
    while len([e for e in events if isinstance(e, Stored)]) < 2:
        events.extend(decode_batch((await rig.recv())[2]))
    gpu = [e for e in events if isinstance(e, Stored) and e.medium == "GPU"]
    pooled = [e for e in events if isinstance(e, Stored) and e.medium == "cpu"]
    ids = engine.tokenizer.request_ids("completion", {"prompt": prompt})[0]
    hashes = tuple(engine.block_hashes.hashes(ids))
    ids = tuple(ids)[: 16 * len(hashes)]
    nones = (None,) * len(hashes)
    assert gpu == [Stored(hashes, "GPU", None, ids, 16, None, nones)]
    # Published one block an event, as vLLM's store connector does; the router's decoder
    # merges the chain back into one run (the wire form is pinned by the test above).
    assert pooled == [Stored(hashes, "cpu", None, ids, 16, None, None)]
    # The same prompt again: its blocks are in the store already, nothing new is published.
    published = rig.publisher.last_seq
    await _prefill(engine, prompt)
    await tick()
    assert rig.publisher.last_seq == published


async def test_a_prompts_blocks_are_published_once_its_prefill_is_computed(rig: Rig) -> None:
    """vLLM publishes a step's `BlockStored` after the step ran (`update_from_output`), so
    a router hears of a prompt's blocks when its prefill is done, not when it starts: while
    the prompt holds the compute line nothing of it is published."""
    compute = LatencyModel(prefill_overhead_s=0.0, prefill_per_token_s=0.002, itl_base_s=0.0,
                           itl_per_running_s=0.0)
    engine = _engine(rig.publisher, MemoryKVStore(), latency=compute)
    prompt = "one two three four " * 20  # 160 tokens: 0.32 s of compute
    running = asyncio.create_task(_prefill(engine, prompt))
    await eventually(lambda: engine.cache.num_cached > 0)  # its blocks are taken
    for _ in range(10):
        await tick()
    assert rig.publisher.last_seq == -1 and not running.done()
    await running
    await tick()
    stored = [e for e in decode_batch((await rig.recv())[2]) if isinstance(e, Stored)]
    assert stored[0].medium == "GPU" and len(stored[0].block_hashes) == 10


async def test_a_prompt_past_the_step_budget_is_published_chunk_by_chunk(rig: Rig) -> None:
    """vLLM prefills a prompt longer than `max_num_batched_tokens` over several steps and
    publishes each step's blocks after it: a router hears of the first chunk's blocks
    while the rest still computes, each chunk's event naming the block before it."""
    compute = LatencyModel(prefill_overhead_s=0.0, prefill_per_token_s=0.001, itl_base_s=0.0,
                           itl_per_running_s=0.0)
    engine = _engine(rig.publisher, MemoryKVStore(), latency=compute, max_num_batched_tokens=64)
    prompt = "one two three four " * 20  # 160 tokens: steps end at 64, 128 and 160 tokens
    running = asyncio.create_task(_prefill(engine, prompt))
    batches: list[list[Stored]] = []
    while sum(len(e.block_hashes) for batch in batches for e in batch) < 10:
        events = decode_batch((await rig.recv())[2])
        batches.append([e for e in events if isinstance(e, Stored) and e.medium == "GPU"])
    await running
    ids = engine.tokenizer.request_ids("completion", {"prompt": prompt})[0]
    hashes = tuple(engine.block_hashes.hashes(ids))
    assert [[len(e.block_hashes) for e in batch] for batch in batches] == [[4], [4], [2]]
    chunks = [batch[0] for batch in batches]
    assert [e.parent_block_hash for e in chunks] == [None, hashes[3], hashes[7]]
    assert sum((e.block_hashes for e in chunks), ()) == hashes
    assert sum((e.token_ids for e in chunks), ()) == tuple(ids[:160])


async def test_store_prefix_cache_reads_what_another_pod_wrote() -> None:
    store = MemoryKVStore()
    writer = _engine(None, store)
    reader = _engine(None, store, store_prefix_cache=True)
    plain = _engine(None, store, store_prefix_cache=False)
    prompt = "alpha beta gamma delta " * 24  # 192 tokens: 12 full blocks
    await _prefill(writer, prompt)
    await _prefill(plain, prompt)
    assert plain.stats_json()["store_prefix_cache"]["hits"] == 0  # computed again
    assert await _prefill(reader, prompt + "and more") == 0  # nothing in its own cache...
    stats = reader.stats_json()["store_prefix_cache"]
    assert stats == {"queries": 192, "hits": 192}  # ...all 12 blocks read from the store
    assert await _prefill(reader, prompt) == 176  # now local (the last block recomputes)
    metrics = reader.metrics.render().decode()
    assert 'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 192.0' in metrics


class SlowStore(MemoryKVStore):
    """A store client that takes real wall time per call, like the real one under load."""

    def __init__(self, delay_s: float, log: list[str]) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.log = log

    async def get(self, keys: Any) -> list[bytes | None]:
        await asyncio.sleep(self.delay_s)
        return await super().get(keys)

    async def put(self, keys: Any, values: Any) -> None:
        self.log.append("store write")
        await asyncio.sleep(self.delay_s)
        await super().put(keys, values)


async def test_real_store_io_is_inside_the_modelled_time_not_added_to_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The simulator charges modelled hardware time for KV moves (README): the wall time of
    its own store client is not added on top. A store read's time is taken off the pause;
    a prefill's store write runs during the pause (Mooncake streams it with compute)."""
    log: list[str] = []
    pauses: list[float] = []

    async def recorded(seconds: float) -> None:
        pauses.append(seconds)
        log.append("pause")
        await asyncio.sleep(0.01)
        log.append("pause end")

    monkeypatch.setattr("engine_sim.engine.pause", recorded)
    store = SlowStore(0.05, log)
    latency = LatencyModel(prefill_overhead_s=0.3, prefill_per_token_s=0.0)
    writer = _engine(None, store, latency=latency)
    prompt = "alpha beta gamma delta " * 24  # 192 tokens: 12 full blocks
    await _prefill(writer, prompt)
    assert log[:3] == ["pause", "store write", "pause end"]  # the write ran inside the pause
    assert pauses == [pytest.approx(0.3)]  # no read: the whole modelled time
    reader = _engine(None, store, latency=latency, store_prefix_cache=True)
    log.clear()
    pauses.clear()
    assert await _prefill(reader, prompt + "and more") == 0
    assert reader.stats_json()["store_prefix_cache"]["hits"] == 192
    modelled = 0.3 + latency.kv_transfer_seconds(192)
    # The read took at least the store's 50 ms: that much less is paused.
    assert 0 < pauses[0] <= modelled - 0.05
