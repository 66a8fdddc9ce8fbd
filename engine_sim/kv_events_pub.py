"""KV events as vLLM publishes them, so a router can keep an exact index of each pod's cache.

Wire format (vLLM `vllm/distributed/kv_events.py`, `ZmqEventPublisher`). Since vllm#42892
vLLM writes batches and events as maps (`{"ts", "events", "data_parallel_rank"}`, each event
`{"type": "BlockStored", "block_hashes": ..., ...}`, fields at their default left out):
that is the default (`--kv-events-layout map`); `array` writes the array-encoded structs of
the releases before, which router decoders were first written against:

- a ZMQ PUB socket bound on `tcp://<--host>:<--kv-events-port>` (default 5557) sends one
  multipart message per batch: `[topic, seq as 8-byte big-endian, msgpack KVEventBatch]`;
  the topic is "" and seq counts 0, 1, 2, ... from process start;
- `KVEventBatch` is `[ts, events, data_parallel_rank]` (msgspec `array_like=True,
  omit_defaults=True`; data_parallel_rank is the engine's rank, 0 without data
  parallelism); each event is a tagged array (`tag=True`;
  msgspec writes every field of an array_like struct, defaults included):
      ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
       medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
       kv_cache_spec_sliding_window]
      ["BlockRemoved", block_hashes, medium, group_idx]
      ["AllBlocksCleared"]
  as vLLM's `BlockPool.cache_full_blocks` fills them: `parent_block_hash` None for a
  prompt's first block, `token_ids` the run's tokens, `lora_name` / `lora_id` the
  request's adapter (`--lora-modules`) or None, `extra_keys` one entry per block (the
  adapter's name on every block, then `"<cache_salt>"` on a salted prompt's block 0, else
  None; vllm#33304), `group_idx` 0 and `kv_cache_spec_kind` "full_attention" (the one
  full-attention group; vllm#37688, vllm#40984). Block hashes are vLLM's
  (`engine_sim.block_hash`, i.e. `router.kvhash.vllm`), 64-bit unsigned ints. (vLLM after
  vllm#42892 writes each event as a map with the tag under "type" instead; subscribers
  read both.)
- a ZMQ ROUTER replay socket on `--kv-events-replay-port` (default 5558) keeps the last
  `buffer_steps` batches: a client sends `[b"", start seq (8 bytes big-endian)]` and gets
  `[b"", seq, payload]` for every buffered batch with seq >= start, then
  `[b"", -1 (8 bytes, signed), b""]` (vLLM's `_service_replay`), sent at once with ZMQ's
  default send bound as vLLM's are: what a slow reader leaves past it is lost, end
  marker included.

Data parallelism (`--data-parallel-size N`): rank r is an engine of its own with its own
publisher on the events port + r and the replay port + r (vLLM's
`ZmqEventPublisher.offset_endpoint_port`), its own sequence numbers, and r as every batch's
`data_parallel_rank`; the topic is the same. Rank 0 is what a server of one engine is.
A node of a multi-node deployment (ranks S..S+L-1) publishes under the GLOBAL ranks too:
vLLM's scheduler creates its publisher with `parallel_config.data_parallel_index`, the
engine's global rank, which offsets both ports and fills `data_parallel_rank`.

Media: the pod's own cache publishes `medium="GPU"`. Blocks a prefill pod writes to the
Mooncake Store are published as vLLM's `MooncakeStoreConnector` publishes them: one
`BlockStored(medium="cpu")` a block, its parent the request's block before it, its token
ids, `group_idx` 0 and no extra keys or spec kind (any prefill pod of the server can load
those). The store never reports its own evictions to its clients, so no
`BlockRemoved(medium="cpu")` is ever sent.

Why a thread: the prefix cache reports events synchronously inside request handling.
`on_cache_event` only appends to the current loop tick's batch; at the end of the tick the
batch gets its sequence number, is encoded and handed over an inproc PAIR socket (bounded
by its high-water mark: when full the batch is dropped, which subscribers see as a
sequence gap and resync) to a thread that owns the PUB and ROUTER sockets. Nothing on the
event loop ever waits for the network.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import msgspec
import orjson
import zmq
from aiohttp import web

from engine_sim.cache_events import BlockRemoved as CacheRemoved
from engine_sim.cache_events import BlockStored as CacheStored
from engine_sim.cache_events import CacheEvent
from engine_sim.data_parallel import rank_view
from router.kvhash.vllm import block_extra_keys

if TYPE_CHECKING:
    from engine_sim.config import SimConfig
    from engine_sim.engine import Engine

log = logging.getLogger(__name__)

#: vLLM's defaults: `KVEventsConfig.endpoint` "tcp://*:5557"; replay is off in vLLM unless
#: configured, and 5558 is what its examples and the router's config use.
DEFAULT_EVENTS_PORT: Final = 5557
DEFAULT_REPLAY_PORT: Final = 5558
#: Batches kept for replay (vLLM `buffer_steps`).
DEFAULT_BUFFER_STEPS: Final = 10_000
#: PUB high-water mark (vLLM `hwm`): a slow subscriber loses messages beyond it.
DEFAULT_HWM: Final = 100_000
#: Batches waiting for the sender thread; beyond it a batch is dropped (a sequence gap).
MAX_QUEUED_BATCHES: Final = 10_000
#: Events in one batch: a longer tick is cut into several batches (none is lost).
MAX_BATCH_EVENTS: Final = 4_096
MEDIUM_GPU: Final = "GPU"
#: What vLLM's MooncakeStoreConnector calls the store (its CPU OffloadingConnector: "CPU").
MEDIUM_STORE: Final = "cpu"
END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
#: How often the sender thread checks for shutdown while idle (milliseconds).
_IDLE_POLL_MS: Final = 200
_WILDCARD_HOSTS: Final = ("", "0.0.0.0", "::", "*")


# -- the structs vLLM sends --------------------------------------------------------------------


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged events: encoded as `[tag, fields...]`."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


Event = BlockStored | BlockRemoved | AllBlocksCleared


def _map_twin(cls: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """`cls` as vLLM writes it since vllm#42892: the same fields and tag, as a map (fields
    at their default left out) instead of a positional array."""
    fields = [
        (f.name, f.type) if f.required else (f.name, f.type, f.default)
        for f in msgspec.structs.fields(cls)
    ]
    return msgspec.defstruct(cls.__name__, fields, tag=cls.__name__, omit_defaults=True,
                             gc=False)


class _MapBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


_MAP_OF: Final = {cls: _map_twin(cls) for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}
#: `--kv-events-layout`: how batches are written (`map`: vLLM since vllm#42892).
LAYOUTS: Final = ("map", "array")


def encode_batch(ts: float, events: list[Event], rank: int | None, layout: str = "map") -> bytes:
    """One KVEventBatch's msgpack bytes, as vLLM writes it in `layout`."""
    if layout == "array":
        return _encoder.encode(KVEventBatch(ts, events, rank))
    as_maps = [_MAP_OF[type(e)](*msgspec.structs.astuple(e)) for e in events]
    return _encoder.encode(_MapBatch(ts, as_maps, rank))
_encoder = msgspec.msgpack.Encoder()
FULL_ATTENTION: Final = "full_attention"


def block_stored_event(
    block_hashes: Sequence[int],
    parent: int | None,
    token_ids: Sequence[int],
    block_size: int,
    medium: str,
    first_block: int,
    cache_salt: str | None,
    lora_name: str | None = None,
    lora_id: int | None = None,
) -> BlockStored:
    """A `BlockStored` as vLLM fills it for a run of a prompt's blocks (module docstring)."""
    extra = [
        block_extra_keys(index * block_size, (index + 1) * block_size, lora_name=lora_name,
                         cache_salt=cache_salt)
        for index in range(first_block, first_block + len(block_hashes))
    ]
    return BlockStored(
        block_hashes=list(block_hashes),
        parent_block_hash=parent,
        token_ids=list(token_ids),
        block_size=block_size,
        lora_id=lora_id,
        medium=medium,
        lora_name=lora_name,
        extra_keys=extra,
        group_idx=0,
        kv_cache_spec_kind=FULL_ATTENTION,
    )


def wire_event(event: CacheEvent) -> Event:
    """The event vLLM publishes for one of the prefix cache's (the pod's own GPU cache)."""
    if isinstance(event, CacheStored):
        return block_stored_event(
            event.block_hashes, event.parent_block_hash, event.token_ids,
            event.block_size, MEDIUM_GPU, event.first_block, event.cache_salt,
            event.lora_name, event.lora_id,
        )
    if isinstance(event, CacheRemoved):
        return BlockRemoved(block_hashes=list(event.block_hashes), medium=MEDIUM_GPU)
    return AllBlocksCleared()


def store_write_events(
    block_hashes: Sequence[int],
    written: Sequence[int],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
) -> list[BlockStored]:
    """The events of blocks `written` (indices into the prompt's `block_hashes`) going to
    the store, as vLLM's `MooncakeStoreWorker` publishes them: one `BlockStored(medium=
    "cpu")` a block, its parent the prompt's block before it (written or not), no extra
    keys (`cache_salt` is not in them: a reader keys a salted block 0 by the pod's own
    GPU event of it) and no spec kind."""
    del cache_salt  # vLLM's store events carry no extra keys
    return [
        BlockStored(
            block_hashes=[block_hashes[index]],
            parent_block_hash=block_hashes[index - 1] if index > 0 else None,
            token_ids=list(token_ids[index * block_size : (index + 1) * block_size]),
            block_size=block_size,
            lora_id=None,
            medium=MEDIUM_STORE,
            lora_name=None,
            group_idx=0,
        )
        for index in written
    ]


def append_event(pending: list[Event], event: Event) -> None:
    """Add `event` to one tick's batch: evictions of one medium in a row are one event."""
    last = pending[-1] if pending else None
    if (
        isinstance(event, BlockRemoved)
        and isinstance(last, BlockRemoved)
        and last.medium == event.medium
    ):
        last.block_hashes.extend(event.block_hashes)
    else:
        pending.append(event)


class KVEventsError(Exception):
    """An explicitly requested KV events port could not be bound."""


def tcp_endpoint(host: str, port: int) -> str:
    if host in _WILDCARD_HOSTS:
        return f"tcp://*:{port}"
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


@dataclass(slots=True)
class PublisherStats:
    batches: int = 0
    events: int = 0
    dropped_batches: int = 0
    replays: int = 0


class KVEventPublisher:
    """PUB + replay ROUTER sockets fed from the event loop (see the module docstring).

    Call `on_cache_event` / `store_written` from the event loop thread only.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        data_parallel_rank: int = 0,
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        hwm: int = DEFAULT_HWM,
        max_queued: int = MAX_QUEUED_BATCHES,
        layout: str = "map",
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"kv events layout must be one of {LAYOUTS}, not {layout!r}")
        self.layout = layout
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.stats = PublisherStats()
        self._topic = topic.encode()
        self._dp_rank = data_parallel_rank
        self._seq = itertools.count()
        self.last_seq = -1
        self._pending: list[Event] = []
        self._flush_scheduled = False
        self._closed = False
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        sockets: list[zmq.Socket[bytes]] = []
        try:
            self._pub: zmq.Socket[bytes] = self._socket(zmq.PUB, sockets, endpoint)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._replay: zmq.Socket[bytes] | None = None
            if replay_endpoint is not None:
                # vLLM's replay ROUTER keeps ZMQ's default send bound (1,000 messages) and
                # no ROUTER_MANDATORY: a long answer to a reader with a bounded queue
                # loses messages, its end marker among them. So does this one.
                self._replay = self._socket(zmq.ROUTER, sockets, replay_endpoint)
            inproc = f"inproc://engine-sim-kv-events-{id(self)}"
            self._rx: zmq.Socket[bytes] = self._socket(zmq.PAIR, sockets, inproc)
            self._rx.setsockopt(zmq.RCVHWM, max_queued)
            self._tx: zmq.Socket[bytes] = self._ctx.socket(zmq.PAIR)
            sockets.append(self._tx)
            self._tx.setsockopt(zmq.LINGER, 0)
            self._tx.setsockopt(zmq.SNDHWM, max_queued)
            self._tx.connect(inproc)
        except zmq.ZMQError:
            for sock in sockets:
                sock.close(linger=0)
            self._ctx.term()
            raise
        self._thread = threading.Thread(target=self._serve, name="kv-events", daemon=True)
        self._thread.start()

    def _socket(self, kind: int, sockets: list[zmq.Socket[bytes]], bind: str) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._ctx.socket(kind)
        sockets.append(sock)
        sock.setsockopt(zmq.LINGER, 0)
        if bind.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        sock.bind(bind)
        return sock

    # -- the event loop side --------------------------------------------------------------------

    def on_cache_event(self, event: CacheEvent) -> None:
        """The prefix cache's hook (`PrefixCache(on_event=...)`): the pod's own GPU cache."""
        self._add(wire_event(event))

    def store_written(
        self,
        block_hashes: Sequence[int],
        written: Sequence[int],
        token_ids: Sequence[int],
        block_size: int,
        cache_salt: str | None = None,
    ) -> None:
        """Blocks `written` (indices into the prompt's `block_hashes`) went to the store
        (`store_write_events`)."""
        for event in store_write_events(block_hashes, written, token_ids, block_size,
                                        cache_salt):
            self._add(event)

    def _add(self, event: Event) -> None:
        if self._closed:
            return
        pending = self._pending
        append_event(pending, event)
        if len(pending) >= MAX_BATCH_EVENTS:
            self.flush()
        elif not self._flush_scheduled:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()
                return
            self._flush_scheduled = True
            loop.call_soon(self.flush)

    def flush(self) -> None:
        """Send this tick's events as one batch (called at the end of the tick)."""
        self._flush_scheduled = False
        if not self._pending or self._closed:
            return
        events, self._pending = self._pending, []
        seq = next(self._seq)
        self.last_seq = seq
        payload = encode_batch(time.time(), events, self._dp_rank, self.layout)
        try:
            self._tx.send_multipart((seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.stats.dropped_batches += 1
            log.warning("kv events: sender queue full, batch %d dropped", seq)
            return
        self.stats.batches += 1
        self.stats.events += len(events)

    def close(self) -> None:
        """Send what is pending, stop the thread, close the sockets."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._stop.set()
        with contextlib.suppress(zmq.ZMQError):
            self._tx.send_multipart((b"",), flags=zmq.NOBLOCK)  # wake the thread
        self._thread.join(timeout=2.0)
        self._tx.close(linger=0)
        if not self._thread.is_alive():
            self._ctx.term()

    def stats_json(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "last_seq": self.last_seq,
            "batches": self.stats.batches,
            "events": self.stats.events,
            "dropped_batches": self.stats.dropped_batches,
            "replays": self.stats.replays,
        }

    # -- the sender thread ----------------------------------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._rx, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(_IDLE_POLL_MS))
                if self._rx in ready:
                    self._forward()
                if self._replay is not None and self._replay in ready:
                    self._service_replay()
                if self._stop.is_set():
                    self._forward()
                    return
        except Exception:
            log.exception("kv events sender thread failed")
        finally:
            self._rx.close(linger=0)
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _forward(self) -> None:
        while True:
            try:
                frames = self._rx.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                continue  # a wake-up
            seq_bytes, payload = frames
            self._pub.send_multipart((self._topic, seq_bytes, payload))
            self._buffer.append((int.from_bytes(seq_bytes, "big"), payload))

    def _service_replay(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = self._replay.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:
                log.warning("kv events: invalid replay request of %d frames", len(frames))
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            self.stats.replays += 1
            for seq, payload in self._buffer:
                if seq >= start:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", END_SEQ, b""))


# -- wiring into the simulator -------------------------------------------------------------------


def _port(configured: int | None, default: int) -> tuple[int, bool]:
    """(port, explicit): None means the default, best effort; 0 disables."""
    return (default, False) if configured is None else (configured, True)


def offset_port(port: int, rank: int) -> int:
    """Rank `rank`'s port for base `port` (vLLM's `offset_endpoint_port`: port + rank)."""
    if port + rank > 65535:
        raise KVEventsError(f"kv events port {port} + data parallel rank {rank} is past 65535")
    return port + rank


def start_kv_events(config: SimConfig, rank: int = 0) -> KVEventPublisher | None:
    """Global rank `rank`'s publisher (the pod's, without data parallelism), or None when
    disabled or (default ports only) not bindable. Its ports are the configured ones plus
    the global rank (not the engine's index on its node: vLLM's `data_parallel_index`).

    With the default ports a bind failure is only logged: several simulated pods may share
    one address in tests. An explicit `--kv-events-port` that cannot be bound raises
    `KVEventsError`.
    """
    port, explicit = _port(config.kv_events_port, DEFAULT_EVENTS_PORT)
    if port == 0:
        return None
    replay_port, replay_explicit = _port(config.kv_events_replay_port, DEFAULT_REPLAY_PORT)
    endpoint = tcp_endpoint(config.host, offset_port(port, rank))
    replay = tcp_endpoint(config.host, offset_port(replay_port, rank)) if replay_port else None
    try:
        publisher = KVEventPublisher(endpoint, replay, data_parallel_rank=rank,
                                     layout=config.kv_events_layout)
    except zmq.ZMQError as exc:
        if explicit or replay_explicit:
            raise KVEventsError(f"kv events cannot bind {endpoint} / {replay}: {exc}") from exc
        log.warning("kv events not published: cannot bind %s / %s: %s", endpoint, replay, exc)
        return None
    log.info("kv events of rank %d on %s (replay %s)", rank, endpoint, replay or "off")
    return publisher


def cached_block_hashes(engine: Engine) -> list[int]:
    """Every block hash resident in the engine's prefix cache (debug view)."""
    # Read straight from the cache's table: a debug view, not part of PrefixCache's API.
    return list(engine.cache._blocks)


def cache_view(engine: Engine) -> dict[str, Any]:
    """One engine's `/sim/cache` body (flushing its pending events first)."""
    publisher = engine.kv_events
    if publisher is not None:
        publisher.flush()
    return {
        "block_size": engine.config.block_size,
        "capacity_blocks": engine.cache.capacity,
        "block_hashes": cached_block_hashes(engine),
        "kv_events": publisher.stats_json() if publisher is not None else None,
    }


def add_debug_routes(app: web.Application, engines: Sequence[Engine]) -> None:
    """`GET /sim/cache`: the prefix cache's block hashes, and the KV events sequence number
    of the last batch describing them (pending events are flushed first), so a test can
    wait until a subscriber has seen that batch and compare.

    With data parallelism (several engines) the body is `{"data_parallel_size": N,
    "ranks": [<that body and "data_parallel_rank"> per rank]}`; `?rank=R` answers global
    rank R's body alone, as a server of one engine does (`data_parallel.rank_view`: a node
    of a larger deployment adds `data_parallel_size_local` and `data_parallel_start_rank`)."""

    async def sim_cache(request: web.Request) -> web.Response:
        try:
            body = rank_view(engines, request.query.get("rank"), cache_view)
        except ValueError as exc:
            return web.Response(status=400, text=str(exc))
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    app.router.add_get("/sim/cache", sim_cache)


__all__ = [
    "DEFAULT_EVENTS_PORT",
    "DEFAULT_REPLAY_PORT",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "KVEventPublisher",
    "KVEventsError",
    "add_debug_routes",
    "block_stored_event",
    "cached_block_hashes",
    "start_kv_events",
    "tcp_endpoint",
]
