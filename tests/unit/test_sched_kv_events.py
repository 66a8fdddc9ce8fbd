"""KV events: vLLM's wire format over real ZMQ sockets, gaps, replay, restarts, per-pod wiring."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from engine_sim.kv_events_pub import BlockRemoved as SimRemoved
from engine_sim.kv_events_pub import KVEventBatch as SimBatch
from engine_sim.kv_events_pub import block_stored_event
from router.kvhash.keyspace import KeySpace
from router.resources import ModelServer, ObjectMeta, PDGroup, Pod
from router.scheduling.kv_events import (
    Cleared,
    DecodeError,
    KVEventsManager,
    PodEventStream,
    Removed,
    Stored,
    StreamSettings,
    StreamTarget,
    decode_batch,
    stream_targets,
)
from router.scheduling.kv_wire import (
    GroupChoice,
    RankMismatch,
    _decode_generic,
    _decode_typed,
    apply_events,
)
from router.scheduling.metrics import SchedulerMetrics
from router.scheduling.precise_index import PrecisePrefixIndex
from router.view import (
    DataParallel,
    Endpoint,
    PDGroupPods,
    ServerPods,
    Snapshot,
    build_snapshot,
)
from tests.polling import eventually
from tests.vllm_kv_events import ArrayAllBlocksCleared as AllBlocksCleared
from tests.vllm_kv_events import (
    ArrayBatch,
    MapAllBlocksCleared,
    MapBatch,
    MapBlockRemoved,
    MapBlockStored,
)
from tests.vllm_kv_events import ArrayBlockRemoved as BlockRemoved
from tests.vllm_kv_events import ArrayBlockStored as BlockStored

_encoder = msgspec.msgpack.Encoder()


def stored(*hashes: int, medium: str | None = "GPU", parent: int | None = None) -> BlockStored:
    return BlockStored(list(hashes), parent, [1] * 16 * len(hashes), 16, None, medium)


def removed(*hashes: int, medium: str | None = "GPU") -> BlockRemoved:
    return BlockRemoved(list(hashes), medium)


def payload(*events: Any, rank: int | None = 0) -> bytes:
    return _encoder.encode(ArrayBatch(time.time(), list(events), rank))


class FakeEngine:
    """A vLLM `ZmqEventPublisher`: PUB frames (topic, seq, payload) and a ROUTER replay."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, context: zmq.asyncio.Context, topic: str = "kv-events",
                 replay: bool = True) -> None:
        self.pub = context.socket(zmq.XPUB)  # XPUB: lets the test wait for the subscriber
        self.pub.setsockopt(zmq.LINGER, 0)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router: zmq.asyncio.Socket | None = None
        self.replay_port: int | None = None
        if replay:
            self.router = context.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.topic = topic.encode()
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.replays: list[int] = []
        #: The last seq a replay answer delivers (None: all), the rest and the end marker
        #: lost, as when vLLM's replay ROUTER drops what its send bound cannot hold.
        self.replay_upto: int | None = None
        self.replay_pace_s = 0.0  # a pause before each replayed batch
        self._task: asyncio.Task[None] | None = None

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str | None:
        return None if self.replay_port is None else f"tcp://127.0.0.1:{self.replay_port}"

    async def wait_subscriber(self) -> None:
        message = await asyncio.wait_for(self.pub.recv(), 5)
        assert message[:1] == b"\x01"

    async def publish(self, data: bytes, send: bool = True) -> int:
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, data))
        if send:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), data])
        return seq

    def restart(self) -> None:
        self.seq = 0
        self.buffer.clear()

    def serve_replay(self) -> None:
        self._task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        assert self.router is not None
        while True:
            client, empty, start = await self.router.recv_multipart()
            begin = int.from_bytes(start, "big")
            self.replays.append(begin)
            for seq, data in self.buffer:
                if self.replay_upto is not None and seq > self.replay_upto:
                    break
                if seq >= begin:
                    if self.replay_pace_s:
                        await asyncio.sleep(self.replay_pace_s)
                    await self.router.send_multipart([client, empty, seq.to_bytes(8, "big"),
                                                      data])
            else:
                await self.router.send_multipart([client, empty, self.END_SEQ, b""])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await self._task
        self.pub.close(0)
        if self.router is not None:
            self.router.close(0)


class Rig:
    def __init__(self, replay: bool = True, join: bool = False,
                 replay_timeout: float = 2.0) -> None:
        self.context = zmq.asyncio.Context()
        self.engine = FakeEngine(self.context, replay=replay)
        self.index = PrecisePrefixIndex()
        self.registry = CollectorRegistry()
        self.metrics = SchedulerMetrics(self.registry)
        target = StreamTarget("ns/p", self.engine.endpoint, self.engine.replay_endpoint,
                              "kv-events", "ns/srv")
        self.stream = PodEventStream(target, self.index, self.context, self.metrics,
                                     StreamSettings(replay_timeout, join))
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.engine.router is not None:
            self.engine.serve_replay()
        self.task = asyncio.create_task(self.stream.run())
        await self.engine.wait_subscriber()

    async def close(self) -> None:
        assert self.task is not None
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task
        await self.engine.close()
        self.context.term()

    def blocks(self) -> set[int]:
        return self.index.blocks_of("ns/p")

    def metric(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


# -- decoding ------------------------------------------------------------------------------------


def test_decode_array_encoded_batches() -> None:
    events = decode_batch(payload(stored(1, 2), removed(1), AllBlocksCleared()))
    assert events == [
        Stored((1, 2), "GPU", None, (1,) * 32, 16), Removed((1,), "GPU"), Cleared()
    ]
    # Hashes as bytes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0): big-endian, low 64 bits.
    raw = (2**64 + 5).to_bytes(9, "big")
    parent = (2**64 + 4).to_bytes(9, "big")
    assert decode_batch(payload(BlockStored([raw], parent, [], 16, None, None))) == [
        Stored((5,), None, 4, (), 16)
    ]
    # Batches without a data-parallel rank, and events with every trailing field: the
    # token ids, block size, parent, LoRA name and per-block extra keys the index re-hashes.
    full = BlockStored([7, 8], 6, [1] * 32, 16, None, "CPU", "lora", [["lora", "salt"], None], 0)
    assert decode_batch(_encoder.encode(ArrayBatch(1.0, [full]))) == [
        Stored((7, 8), "CPU", 6, (1,) * 32, 16, "lora", (["lora", "salt"], None))
    ]
    # Token ids that are not ints are not re-hashed (the event still counts by its hashes).
    odd = BlockStored([7], None, ["x"] * 16, 16, None, "GPU")
    assert decode_batch(payload(odd)) == [Stored((7,), "GPU", None, None, 16)]


def test_decode_map_encoded_events_and_ignore_other_groups() -> None:
    data = _encoder.encode(MapBatch(1.0, [
        MapBlockStored([1, 2], None, [1] * 32, 16, None, "GPU", None, None, 0,
                       "full_attention"),
        MapBlockStored([3], None, [1] * 16, 16, None, "GPU", None, None, 1, "sliding_window"),
        MapBlockRemoved([2], "GPU"),
        MapAllBlocksCleared(),
    ], 0))
    assert decode_batch(data) == [
        Stored((1, 2), "GPU", None, (1,) * 32, 16), Removed((2,), "GPU"), Cleared()
    ]
    assert _decode_typed(data) == _decode_generic(data) == decode_batch(data)  # map: typed
    as_map = msgspec.msgpack.encode({"ts": 1.0, "events": [{"type": "BlockRemoved",
                                                            "block_hashes": [9]}]})
    assert decode_batch(as_map) == [Removed((9,), None)]


def test_decode_rejects_garbage_and_skips_unknown_events() -> None:
    with pytest.raises(DecodeError):
        decode_batch(b"\xc1")
    with pytest.raises(DecodeError):
        decode_batch(msgspec.msgpack.encode(5))
    with pytest.raises(DecodeError):
        decode_batch(msgspec.msgpack.encode([1.0, [["BlockStored", "x"]]]))
    assert decode_batch(msgspec.msgpack.encode([1.0, [["SomethingNew", 1]]])) == []


def test_the_typed_fast_path_decodes_exactly_like_the_generic_decoder() -> None:
    """vLLM's array layout (the simulator's publisher: every trailing field, the newer
    ones too) takes the typed path; a batch it does not accept falls back, and both give
    the same events."""
    sim = _encoder.encode(SimBatch(1.0, [
        block_stored_event([2**64 - 1, 3], 12, list(range(32)), 16, "GPU", 0, "salt"),
        block_stored_event([2**64 - 1, 3], 12, list(range(32)), 16, "cpu", 0, "salt"),
        SimRemoved([3], "GPU", 0),
    ], 0))
    typed = _decode_typed(sim)
    assert typed is not None and typed == _decode_generic(sim)
    first = typed[0]
    assert isinstance(first, Stored) and first.block_hashes == (2**64 - 1, 3)
    assert (first.medium, first.parent_block_hash, first.token_ids, first.block_size) == (
        "GPU", 12, tuple(range(32)), 16)
    assert first.extra_keys is not None and len(first.extra_keys) == 2
    cases = {
        "negative int hash": payload(stored(-1, 2)),
        "bytes hash": payload(BlockStored([b"\x01\x02"], None, [], 16, None, None)),
        "token id past 32 bits": payload(BlockStored([7], None, [2**32], 16, None, "GPU")),
        "token ids not ints": payload(BlockStored([7], None, ["x"], 16, None, "GPU")),
        "other group": payload(BlockStored([7], None, [1] * 16, 16, None, "GPU", None,
                                           None, 1)),
        "unknown kind": msgspec.msgpack.encode([1.0, [["SomethingNew", 1], ["AllBlocksCleared"]]]),
        "map events": _encoder.encode(MapBatch(1.0, [MapBlockRemoved([2], "GPU")])),
        "map events, array batch": _encoder.encode(ArrayBatch(1.0, [MapBlockRemoved([2], "GPU")])),
        "no rank": _encoder.encode(ArrayBatch(1.0, [removed(4)])),
    }
    took_fast = set()
    for name, data in cases.items():
        fast = _decode_typed(data)
        if fast is not None:
            took_fast.add(name)
            assert fast == _decode_generic(data), name
        assert decode_batch(data) == _decode_generic(data), name
    assert decode_batch(cases["negative int hash"])[0].block_hashes == (2**64 - 1, 2)
    assert took_fast == {"negative int hash", "other group", "no rank", "map events",
                         "map events, array batch"}


def test_a_hybrid_models_full_attention_group_is_the_one_indexed() -> None:
    """A hybrid model's group 0 may be sliding-window (Gemma 3) or Mamba (Qwen3-Next):
    the stream learns each group's kind from its stores and indexes the full-attention
    one, its removals too (which name only their group), in later batches as well."""
    groups = GroupChoice()
    first = _encoder.encode(MapBatch(1.0, [
        MapBlockStored([11], None, [1] * 16, 16, None, "GPU", None, None, 0, "sliding_window"),
        MapBlockStored([21], None, [1] * 16, 16, None, "GPU", None, None, 1, "full_attention"),
        MapBlockStored([31], None, [1] * 16, 16, None, "GPU", None, None, 2, "mamba"),
    ], 0))
    assert decode_batch(first, groups) == [Stored((21,), "GPU", None, (1,) * 16, 16)]
    later = _encoder.encode(MapBatch(2.0, [
        MapBlockRemoved([11], "GPU", 0), MapBlockRemoved([21], "GPU", 1),
        MapBlockRemoved([31], "GPU", 2),
    ], 0))
    assert decode_batch(later, groups) == [Removed((21,), "GPU")]
    assert groups.group == 1
    # Without kinds (older vLLM, one group): group 0, as before.
    plain = GroupChoice()
    assert decode_batch(payload(stored(5), removed(5)), plain) == [
        Stored((5,), "GPU", None, (1,) * 16, 16), Removed((5,), "GPU")
    ]
    # An MLA model (DeepSeek) reports mla_attention: a full prefix too.
    mla = _encoder.encode(MapBatch(1.0, [
        MapBlockStored([7], None, [1] * 16, 16, None, "GPU", None, None, 0, "mla_attention"),
    ], 0))
    assert decode_batch(mla) == [Stored((7,), "GPU", None, (1,) * 16, 16)]


async def test_without_a_full_attention_group_group_0_is_indexed_and_a_later_one_resets() -> None:
    """A single group vLLM calls "unknown" (or one without kinds) is still indexed; should a
    full-attention group turn up later than group 0's events, the pod's entries are cleared
    before it is indexed, so no other group's block is left behind."""
    unknown = _encoder.encode(MapBatch(1.0, [
        MapBlockStored([5], None, [1] * 16, 16, None, "GPU", None, None, 0, "unknown"),
    ], 0))
    assert decode_batch(unknown) == [Stored((5,), "GPU", None, (1,) * 16, 16)]
    rig = Rig()
    try:
        await rig.stream.handle(0, payload(stored(1, 2)))  # no kinds: group 0
        assert rig.blocks() == {1, 2}
        later = _encoder.encode(MapBatch(2.0, [
            MapBlockStored([3], None, [1] * 16, 16, None, "GPU", None, None, 0,
                           "sliding_window"),
            MapBlockStored([4], None, [1] * 16, 16, None, "GPU", None, None, 1,
                           "full_attention"),
        ], 0))
        await rig.stream.handle(1, later)
        assert rig.blocks() == {4}
    finally:
        await rig.engine.close()
        rig.context.term()


def test_vllms_one_block_store_events_are_applied_as_one_run() -> None:
    """vLLM's MooncakeStoreConnector sends each block written as its own event: chained
    ones become one run, and the index ends the same as with the events one by one."""
    chain = [BlockStored([100 + i], 99 + i if i else None, [i] * 16, 16, None, "cpu")
             for i in range(4)]
    apart = BlockStored([500], 7, [5] * 16, 16, None, "cpu")  # another prompt's block
    no_tokens = BlockStored([600], 500, [], 16, None, "cpu")  # vLLM's when it has none
    events = decode_batch(payload(*chain, apart, no_tokens))
    assert events == [
        Stored((100, 101, 102, 103), "cpu", None,
               tuple(t for i in range(4) for t in [i] * 16), 16),
        Stored((500,), "cpu", 7, (5,) * 16, 16),
        Stored((600,), "cpu", 500, (), 16),
    ]
    # Keyed by token ids (router keys chained from each parent), as the trace phase keys.
    one_by_one, merged = PrecisePrefixIndex(), PrecisePrefixIndex()
    for index in (one_by_one, merged):
        index.set_spaces({"s": KeySpace.of("tokens")})
    for event in chain:
        apply_events(one_by_one, "p", "s", decode_batch(payload(event)))
    apply_events(merged, "p", "s", events)
    assert len(one_by_one.store_blocks("s")) == 4
    assert merged.store_blocks("s") == one_by_one.store_blocks("s")
    assert merged.unkeyed_blocks == 2  # 500's parent unknown, 600 without token ids


# -- one pod's stream over real sockets --------------------------------------------------------


async def test_in_order_batches_and_a_gap_filled_by_replay() -> None:
    rig = Rig()
    await rig.start()
    try:
        engine = rig.engine
        await engine.publish(payload(stored(1, 2, 3)))  # seq 0
        await engine.publish(payload(stored(4, parent=3)))  # seq 1
        await eventually(lambda: rig.blocks() == {1, 2, 3, 4})
        await engine.publish(payload(removed(2, 3)), send=False)  # seq 2: lost
        await engine.publish(payload(stored(5)), send=False)  # seq 3: lost
        await engine.publish(payload(stored(6)))  # seq 4: gap detected
        await eventually(lambda: rig.stream.last_seq == 4)
        assert rig.blocks() == {1, 4, 5, 6}
        assert engine.replays == [2]
        await engine.publish(payload(removed(6)))  # seq 5: in order again
        await eventually(lambda: rig.blocks() == {1, 4, 5})
        assert rig.metric("pdgate_kv_event_gaps_total") == 1
        assert rig.metric("pdgate_kv_event_resyncs_total", how="replay") == 1
        assert rig.metric("pdgate_kv_event_resyncs_total", how="clear") == 0
    finally:
        await rig.close()


async def test_the_cpu_applying_events_is_counted() -> None:
    rig = Rig()
    await rig.start()
    try:
        assert rig.metric("pdgate_background_cpu_seconds_total", work="kv_events") == 0
        await rig.engine.publish(payload(stored(*range(1, 4001))))
        await eventually(lambda: len(rig.blocks()) == 4000)
        spent = rig.metric("pdgate_background_cpu_seconds_total", work="kv_events")
        assert 0 < spent < 5  # thread CPU of one 4,000-block batch, not wall time
    finally:
        await rig.close()


async def test_map_encoded_batches_and_all_blocks_cleared() -> None:
    rig = Rig()
    await rig.start()
    try:
        batch = MapBatch(1.0, [MapBlockStored([11, 12], None, [1] * 32, 16, None, "GPU",
                                              None)], 0)
        await rig.engine.publish(_encoder.encode(batch))
        await eventually(lambda: rig.blocks() == {11, 12})
        await rig.engine.publish(_encoder.encode(MapBatch(2.0, [MapAllBlocksCleared()], 0)))
        await eventually(lambda: rig.stream.last_seq == 1)
        assert rig.blocks() == set()
    finally:
        await rig.close()


async def test_a_gap_without_replay_clears_and_rebuilds() -> None:
    rig = Rig(replay=False)
    await rig.start()
    try:
        engine = rig.engine
        await engine.publish(payload(stored(1, 2)))
        await eventually(lambda: rig.blocks() == {1, 2})
        await engine.publish(payload(removed(2)), send=False)  # lost
        await engine.publish(payload(stored(3)))
        await eventually(lambda: rig.stream.last_seq == 2)
        # Never over-reports: what came before the gap is forgotten, what follows is kept.
        assert rig.blocks() == {3}
        assert rig.metric("pdgate_kv_event_resyncs_total", how="clear") == 1
    finally:
        await rig.close()


def test_a_batch_of_another_data_parallel_rank_is_refused_in_every_layout() -> None:
    """A rank's stream takes its own batches and those naming no rank; a batch naming
    another rank (the ports reach another engine) is refused, array, map or generic."""
    event = stored(1, 2)
    map_event = MapBlockStored([1, 2], None, list(range(32)), 16, None, "GPU", None)
    assert decode_batch(payload(event, rank=1), rank=1)
    assert decode_batch(payload(event, rank=None), rank=1)
    assert decode_batch(payload(event, rank=0))  # no rank expected: any
    for raw in (payload(event, rank=0),
                _encoder.encode(MapBatch(time.time(), [map_event], 0)),
                _encoder.encode([time.time(), [["BlockStored", [b"\x01"], None, [], 16,
                                                 None, "GPU"]], 0])):
        with pytest.raises(RankMismatch, match="rank 0 on the stream of rank 1"):
            decode_batch(raw, rank=1)


async def test_a_rank_stream_drops_another_ranks_batches_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    index = PrecisePrefixIndex()
    registry = CollectorRegistry()
    context = zmq.asyncio.Context()
    try:
        target = StreamTarget("ns/p/dp1", "tcp://127.0.0.1:1", None, "", "ns/srv", rank=1)
        stream = PodEventStream(target, index, context, SchedulerMetrics(registry),
                                StreamSettings(0.5, False))
        await stream.handle(0, payload(stored(1, 2), rank=0))
        await stream.handle(1, payload(stored(3), rank=0))
        assert index.blocks_of("ns/p/dp1") == set()
        assert registry.get_sample_value("pdgate_kv_event_errors_total") == 2
        assert caplog.text.count("a batch of data-parallel rank 0") == 1
        await stream.handle(2, payload(stored(4), rank=1))
        assert index.blocks_of("ns/p/dp1") == {4}
    finally:
        context.term()


async def test_a_replay_that_cannot_cover_the_gap_clears() -> None:
    rig = Rig()
    await rig.start()
    try:
        engine = rig.engine
        await engine.publish(payload(stored(1)))  # seq 0
        await engine.publish(payload(stored(2)), send=False)  # seq 1: lost...
        engine.buffer.pop()  # ...and gone from the engine's replay buffer too
        await engine.publish(payload(stored(3)), send=False)  # seq 2: lost, replayable
        await engine.publish(payload(stored(4)))  # seq 3
        await eventually(lambda: rig.stream.last_seq == 3)
        assert rig.blocks() == {3, 4}
        assert rig.metric("pdgate_kv_event_resyncs_total", how="clear") >= 1
    finally:
        await rig.close()


async def test_an_unanswered_replay_times_out_and_clears() -> None:
    rig = Rig(replay_timeout=0.2)
    rig.engine.router.close(0)  # type: ignore[union-attr]
    rig.engine.router = None  # the replay endpoint exists in config but nobody answers
    await rig.start()
    try:
        await rig.engine.publish(payload(stored(1)))
        await eventually(lambda: rig.blocks() == {1})
        await rig.engine.publish(payload(stored(2)), send=False)
        await rig.engine.publish(payload(stored(3)))
        await eventually(lambda: rig.stream.last_seq == 2)
        assert rig.blocks() == {3}
    finally:
        await rig.close()


async def test_an_engine_restart_clears_the_pod() -> None:
    rig = Rig()
    await rig.start()
    try:
        engine = rig.engine
        for h in (1, 2, 3):
            await engine.publish(payload(stored(h)))
        await eventually(lambda: rig.blocks() == {1, 2, 3})
        engine.restart()
        await engine.publish(payload(stored(9)))  # seq 0 again
        await eventually(lambda: rig.blocks() == {9})
        assert rig.metric("pdgate_kv_event_resyncs_total", how="restart") == 1
    finally:
        await rig.close()


async def test_joining_late_replays_from_the_start() -> None:
    rig = Rig(join=True)
    await rig.start()
    try:
        engine = rig.engine
        await engine.publish(payload(stored(1, 2)), send=False)  # before the router came
        await engine.publish(payload(removed(1)), send=False)
        await engine.publish(payload(stored(3)))
        await eventually(lambda: rig.stream.last_seq == 2)
        assert rig.blocks() == {2, 3}
        assert engine.replays == [0]
    finally:
        await rig.close()


async def test_a_replay_on_join_that_stops_short_clears_the_pod() -> None:
    """The join's replay delivers the first batch and loses the rest with its end marker:
    the pod is cleared before the batch that came on the SUB socket is applied (block 1,
    removed in a batch the replay lost, was reported held)."""
    rig = Rig(join=True, replay_timeout=0.2)
    rig.engine.replay_upto = 0
    await rig.start()
    try:
        engine = rig.engine
        await engine.publish(payload(stored(1, 2)), send=False)  # seq 0: before the router
        await engine.publish(payload(removed(1)), send=False)  # seq 1: lost with the answer
        await engine.publish(payload(stored(3)))  # seq 2
        await eventually(lambda: rig.stream.last_seq == 2)
        assert rig.blocks() == {3}
        assert rig.metric("pdgate_kv_event_resyncs_total", how="clear") == 1
    finally:
        await rig.close()


async def test_a_replay_longer_than_its_timeout_is_taken_whole() -> None:
    """The replay timeout bounds the wait for each message, not the whole answer, which
    takes longer to deliver and apply when it is long (it was cut off and the pod cleared)."""
    rig = Rig(join=True, replay_timeout=0.2)
    rig.engine.replay_pace_s = 0.02  # 30 batches: 0.6 s in all
    await rig.start()
    try:
        engine = rig.engine
        for block in range(1, 31):
            await engine.publish(payload(stored(block)), send=False)
        await engine.publish(payload(stored(31)))  # seq 30
        await eventually(lambda: rig.stream.last_seq == 30)
        assert rig.blocks() == set(range(1, 32))
        assert rig.metric("pdgate_kv_event_resyncs_total", how="clear") == 0
    finally:
        await rig.close()


async def test_store_medium_events_feed_the_shared_pool() -> None:
    rig = Rig()
    await rig.start()
    try:
        await rig.engine.publish(payload(stored(1, 2, medium="cpu"), stored(1)))
        await eventually(lambda: rig.stream.last_seq == 0)
        assert rig.blocks() == {1}
        assert rig.index.store_blocks("ns/srv") == {1, 2}
        assert rig.index.match(["ns/other-pod"], "ns/srv", [1, 2, 3]) == ([0], [2])
    finally:
        await rig.close()


# -- which pods, which endpoints -----------------------------------------------------------------


def _server(annotations: dict[str, str], pd: bool = True, name: str = "srv") -> ModelServer:
    return ModelServer(
        meta=ObjectMeta(name=name, annotations=annotations),
        model="m",
        inference_engine="vLLM",
        match_labels={"app": "x"},
        pd_group=PDGroup("g", {"r": "p"}, {"r": "d"}) if pd else None,
        port=8000,
    )


def _pd(server: ModelServer, prefill_ip: str = "10.0.0.1") -> ServerPods:
    return ServerPods(server=server, groups=(PDGroupPods(
        group="g0",
        prefill=(Endpoint("ns", "pre", prefill_ip, 8000, "prefill", "g0"),),
        decode=(Endpoint("ns", "dec", "10.0.0.2", 8000, "decode", "g0"),),
    ),))


def test_stream_targets_follow_annotations() -> None:
    default = _pd(_server({}))
    targets = stream_targets(Snapshot(servers={("default", "srv"): default}))
    assert list(targets) == ["ns/pre"]  # decode pods are not subscribed
    target = targets["ns/pre"]
    assert target.endpoint == "tcp://10.0.0.1:5557"
    assert target.replay_endpoint == "tcp://10.0.0.1:5558"
    assert target.topic == "" and target.scope == "default/srv"
    custom = _pd(_server({"pdgate.io/kv-events-port": "6000",
                          "pdgate.io/kv-events-replay-port": "none",
                          "pdgate.io/kv-events-topic": "kv"}), prefill_ip="fd00::1")
    target = stream_targets(Snapshot(servers={("default", "srv"): custom}))["ns/pre"]
    assert (target.endpoint, target.replay_endpoint, target.topic) == (
        "tcp://[fd00::1]:6000", None, "kv")
    off = _pd(_server({"pdgate.io/kv-events": "false"}))
    assert stream_targets(Snapshot(servers={("default", "srv"): off})) == {}
    agg = ServerPods(server=_server({}, pd=False),
                     aggregated=(Endpoint("ns", "a", "10.0.0.9", 8000, "both"),))
    assert list(stream_targets(Snapshot(servers={("default", "srv"): agg}))) == ["ns/a"]


def test_each_data_parallel_rank_is_a_stream_on_the_ports_plus_its_rank() -> None:
    """vLLM's rank r binds the configured events and replay ports + r."""
    ranks = tuple(Endpoint("ns", "pre", "10.0.0.1", 8000, "prefill", "g0", dp_rank=rank,
                           rank_pin=str(rank)) for rank in (0, 1, 2))
    server = ServerPods(server=_server({"pdgate.io/kv-events-port": "6000"}), groups=(
        PDGroupPods("g0", ranks, (Endpoint("ns", "dec", "10.0.0.2", 8000, "decode", "g0"),)),
    ), data_parallel=DataParallel(3))
    targets = stream_targets(Snapshot(servers={("default", "srv"): server}))
    assert {key: (t.endpoint, t.replay_endpoint) for key, t in targets.items()} == {
        "ns/pre/dp0": ("tcp://10.0.0.1:6000", "tcp://10.0.0.1:5558"),
        "ns/pre/dp1": ("tcp://10.0.0.1:6001", "tcp://10.0.0.1:5559"),
        "ns/pre/dp2": ("tcp://10.0.0.1:6002", "tcp://10.0.0.1:5560"),
    }
    # The default ports' runs overlap (5557 + 1 is 5558): no engine can replay then.
    overlapping = ServerPods(server=_server({}), groups=server.groups,
                             data_parallel=DataParallel(3))
    targets = stream_targets(Snapshot(servers={("default", "srv"): overlapping}))
    assert [(t.endpoint, t.replay_endpoint) for t in targets.values()] == [
        ("tcp://10.0.0.1:5557", None), ("tcp://10.0.0.1:5558", None),
        ("tcp://10.0.0.1:5559", None),
    ]


def test_a_multi_node_rank_streams_on_the_ports_plus_its_global_rank() -> None:
    """Hybrid data parallelism, 4 ranks over pods of 2: the second pod's ranks 2 and 3
    publish on the ports + 2 and + 3 (vLLM offsets by the global rank); a pod's own run
    of 2 decides the overlap, so replay 5560 beside events 5557 is asked for."""
    ranks = tuple(Endpoint("ns", "w", "10.0.0.3", 8000, "prefill", "g0", dp_rank=rank,
                           rank_pin=str(rank - 2)) for rank in (2, 3))
    dp = DataParallel(4, "hybrid", 2)
    server = ServerPods(server=_server({"pdgate.io/kv-events-replay-port": "5560"}), groups=(
        PDGroupPods("g0", ranks, (Endpoint("ns", "dec", "10.0.0.2", 8000, "decode", "g0"),)),
    ), data_parallel=dp)
    targets = stream_targets(Snapshot(servers={("default", "srv"): server}))
    assert {key: (t.endpoint, t.replay_endpoint, t.rank) for key, t in targets.items()} == {
        "ns/w/dp2": ("tcp://10.0.0.3:5559", "tcp://10.0.0.3:5562", 2),
        "ns/w/dp3": ("tcp://10.0.0.3:5560", "tcp://10.0.0.3:5563", 3),
    }


def test_a_headless_nodes_ranks_stream_from_that_node() -> None:
    """vLLM's internal balancing over nodes (DP 4, 2 ranks a node, no hybrid): the head
    pod's API server serves ranks 2 and 3, but their engines publish from the headless
    pod, on its ports + 2 and + 3; without that pod ready they have no stream (the head's
    ports + 2 and + 3 belong to no engine)."""
    ms = ModelServer(
        meta=ObjectMeta(name="srv", namespace="ns", annotations={
            "pdgate.io/data-parallel-size": "4", "pdgate.io/data-parallel-size-local": "2",
            "pdgate.io/kv-events-replay-port": "5560"}),
        model=None, inference_engine="vLLM", match_labels={"app": "x"}, pd_group=None,
        port=8000,
    )
    head = Pod(ObjectMeta(name="head", namespace="ns", labels={
        "app": "x", "leaderworkerset.sigs.k8s.io/worker-index": "0"}), ip="10.0.0.1",
        ready=True)
    headless = Pod(ObjectMeta(name="w", namespace="ns", labels={
        "app": "x", "leaderworkerset.sigs.k8s.io/worker-index": "1"}), ip="10.0.0.2",
        ready=True)
    targets = stream_targets(build_snapshot([], [ms], [head, headless]))
    assert {key: (t.endpoint, t.replay_endpoint, t.rank) for key, t in targets.items()} == {
        "ns/head/dp0": ("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5560", 0),
        "ns/head/dp1": ("tcp://10.0.0.1:5558", "tcp://10.0.0.1:5561", 1),
        "ns/head/dp2": ("tcp://10.0.0.2:5559", "tcp://10.0.0.2:5562", 2),
        "ns/head/dp3": ("tcp://10.0.0.2:5560", "tcp://10.0.0.2:5563", 3),
    }
    alone = stream_targets(build_snapshot([], [ms], [head]))
    assert sorted(alone) == ["ns/head/dp0", "ns/head/dp1"]


async def test_manager_subscribes_per_pod_and_drops_departed_pods() -> None:
    context = zmq.asyncio.Context()
    engine = FakeEngine(context, topic="")
    index = PrecisePrefixIndex()
    metrics = SchedulerMetrics(CollectorRegistry())
    manager = KVEventsManager(index, metrics, StreamSettings(1.0, False),
                              events_port=engine.port, replay_port=engine.replay_port)
    engine.serve_replay()
    server = _pd(_server({}), prefill_ip="127.0.0.1")
    manager.on_snapshot(Snapshot(servers={("default", "srv"): server}))
    task = asyncio.create_task(manager.run())
    try:
        await engine.wait_subscriber()
        await engine.publish(payload(stored(1, 2)))
        await eventually(lambda: index.blocks_of("ns/pre") == {1, 2})
        assert manager.stream("ns/pre") is not None
        manager.on_snapshot(Snapshot(servers={}))  # the pod left the view
        await eventually(lambda: manager.stream("ns/pre") is None)
        assert index.blocks_of("ns/pre") == set()
        manager.set_enabled(False)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await engine.close()
        context.term()
