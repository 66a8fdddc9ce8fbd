"""vLLM KV events over ZMQ: the wire format, and one subscription per pod.

Wire format (vLLM `vllm/distributed/kv_events.py`, `ZmqEventPublisher`)
-----------------------------------------------------------------------
The engine binds a ZMQ PUB socket (vLLM default `tcp://*:5557`) and sends each batch as
one multipart message of three frames:

    frame 0  topic: UTF-8 bytes (vLLM default "": subscribers use prefix "" to get all)
    frame 1  sequence: 8-byte big-endian unsigned int, 0, 1, 2, ... per publisher
             (restarts at 0 when the engine restarts)
    frame 2  payload: msgpack of a KVEventBatch

A KVEventBatch is a msgspec Struct `[ts: float, events: list, data_parallel_rank: int |
None]`, encoded as a positional msgpack array (older vLLM, `array_like=True`; a
`data_parallel_rank` of None may be omitted) or as a map with those field names. Each
event is a msgspec tagged Struct, encoded either

- as a positional array whose first element is the tag (vLLM up to vllm#42892):
      ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
       medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
       kv_cache_spec_sliding_window]     (trailing fields may be absent)
      ["BlockRemoved", block_hashes, medium, group_idx]
      ["AllBlocksCleared"]
- or as a map with the tag under "type" and the same field names (newer vLLM).

`block_hashes` / `parent_block_hash` are 64-bit unsigned ints by default
(`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`), or bytes (taken as a big-endian integer, low 64
bits, which is how vLLM converts them). One KV cache group is indexed per engine: the
lowest of a full-attention kind its `BlockStored`s name (`kv_cache_spec_kind`; a hybrid
model's group 0 may be sliding-window or Mamba), else group 0 (`group_idx` absent, None or
0; `kv_wire.GroupChoice`).

Replay: the engine may bind a ZMQ ROUTER socket (vLLM `replay_endpoint`, e.g.
`tcp://*:5558`). A client sends `[b"", start_seq as 8-byte big-endian]`, and the engine
answers with one message `[b"", seq (8 bytes), payload]` per buffered batch whose
seq >= start, then `[b"", (-1 as 8-byte big-endian signed), b""]`. The client here is a
DEALER socket: vLLM's example subscriber uses REQ, which accepts only the first of those
reply messages.

`medium`: "GPU" (or absent) is the pod's own cache; another medium that is not a store
medium (e.g. "CPU" offload) is also the pod's own; a store medium (config
`preciseIndex.storeMedia`, default "cpu", as vLLM's MooncakeStoreConnector spells it) is
a shared KV store: such blocks count for every prefill pod of the same ModelServer
(`precise_index.py`).

Decoding (both encodings, each on a typed fast path) is `kv_wire`'s job.

Subscriber behaviour (`PodEventStream`)
---------------------------------------
- In-order batches are applied to the `PrecisePrefixIndex`.
- A gap (seq > last + 1) asks the replay socket for `last + 1` onwards and applies what
  comes back; if the answer stalls (no message within `replay_timeout_s`), or the
  replayed range has a hole (the engine's buffer no longer holds it), the pod's entries
  are cleared and the index rebuilds from the events that follow (it under-reports until
  then, never over-reports).
- Joining late (the first seq seen is > 0): replays from 0 when `replay_on_join`, so the
  blocks stored before the router started are known too; a replay that ends short of
  the first seq seen clears the pod as a gap does (the batches it missed may remove).
- A sequence that goes backwards (outside the window a replay just covered) means the
  engine restarted: its entries are cleared.
- The pod's entries are dropped when it leaves the view.

Endpoint per pod: `tcp://<pod ip>:<port>`, port 5557 unless the ModelServer's annotation
`pdgate.io/kv-events-port` says otherwise; replay on `pdgate.io/kv-events-replay-port`
(default 5558; "0" or "none" disables replay); topic `pdgate.io/kv-events-topic`
(default "", every topic); `pdgate.io/kv-events: "false"` disables the subscription.
Data-parallel rank r of a pod (`router.data_parallel`) publishes on both ports + r (its
global rank, on whichever pod of a multi-node deployment it runs), as vLLM offsets a
rank's endpoints, and is a stream (and an index entry) of its own. Under vLLM's internal
load balancing over nodes the head pod's API server serves a headless pod's ranks, whose
events come from that pod's address (`Endpoint.engine_host`; a rank no ready pod is known
to run has no stream). Where a pod's ranks'
two runs of ports overlap (the defaults do: 5557 + 1 is 5558) the engines cannot have
replay sockets, so none is asked.
Only prefill and aggregated pods are subscribed (decode pods are not scored by prefix).

Keys: each ModelServer gets a `KeySpace` (`key_spaces`: the `preciseIndex` defaults and
the annotations `pdgate.io/precise-index-keys`, `pdgate.io/prefix-caching-hash-algo`,
`pdgate.io/python-hash-seed`, `pdgate.io/block-size`; see `router.kvhash.keyspace`), so a
`BlockStored` is indexed under the engine's hashes or under router keys recomputed from
its `token_ids`, `block_size`, `parent_block_hash`, `extra_keys` and `lora_name`. When a
ModelServer's key space changes, its pods' streams restart from an empty index.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import zmq
import zmq.asyncio

from router.kvhash.keyspace import KeySettings, KeySpace
from router.scheduling.kv_wire import (
    Cleared,
    DecodeError,
    GroupChoice,
    RankMismatch,
    Removed,
    Stored,
    apply_events,
    decode_batch,
)
from router.scheduling.metrics import SchedulerMetrics
from router.scheduling.precise_index import PrecisePrefixIndex
from router.view import Endpoint, ServerPods, Snapshot

log = logging.getLogger("pdgate.scheduling.kv_events")

DEFAULT_EVENTS_PORT: Final = 5557
DEFAULT_REPLAY_PORT: Final = 5558
PORT_ANNOTATION: Final = "pdgate.io/kv-events-port"
REPLAY_PORT_ANNOTATION: Final = "pdgate.io/kv-events-replay-port"
TOPIC_ANNOTATION: Final = "pdgate.io/kv-events-topic"
ENABLE_ANNOTATION: Final = "pdgate.io/kv-events"
#: ZMQ receive high-water mark of one pod's SUB socket (messages).
SUB_RCVHWM: Final = 100_000
#: Bound on the batches accepted from one replay answer.
MAX_REPLAY_BATCHES: Final = 100_000
#: Replayed batches applied between two turns of the event loop: a queued answer is
#: read without waiting, so a long one (10,000 batches: about 0.9 s) held the loop.
REPLAY_BATCHES_PER_TURN: Final = 64
END_SEQ: Final = -1
MAX_PORT: Final = 65535


# -- one pod's stream ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StreamTarget:
    """Where one pod's events come from, and which store pool they belong to."""

    key: str
    endpoint: str
    replay_endpoint: str | None
    topic: str
    scope: str
    space: int = 0  # the scope's KeySpace.ident: a change restarts the stream from scratch
    #: The engine's data-parallel rank: a batch naming another is refused (None: any).
    rank: int | None = None


@dataclass(slots=True)
class StreamSettings:
    replay_timeout_s: float = 0.5
    replay_on_join: bool = True


class PodEventStream:
    """Subscribes to one pod's KV events and keeps its part of the index exact."""

    def __init__(
        self,
        target: StreamTarget,
        index: PrecisePrefixIndex,
        context: zmq.asyncio.Context,
        metrics: SchedulerMetrics,
        settings: StreamSettings,
    ) -> None:
        self.target = target
        self._index = index
        self._context = context
        self._metrics = metrics
        self._settings = settings
        self.last_seq: int | None = None
        self._dup_from = 0
        self._dup_upto = -1
        self._replay: zmq.asyncio.Socket | None = None
        self.batches = 0
        self._groups = GroupChoice()  # which KV cache group of this engine is indexed
        self._rank_warned = False

    async def run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, SUB_RCVHWM)
        sub.setsockopt(zmq.RECONNECT_IVL, 100)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        sub.setsockopt(zmq.SUBSCRIBE, self.target.topic.encode())
        sub.connect(self.target.endpoint)
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    self._metrics.kv_event_errors.inc()
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                await self.handle(seq, frames[2])
        finally:
            sub.close(linger=0)
            self._close_replay()

    def _apply(self, payload: bytes) -> None:
        started = time.thread_time()  # the CPU the index costs (one clock read a batch)
        try:
            events = decode_batch(payload, self._groups, self.target.rank)
        except RankMismatch as exc:
            self._metrics.kv_event_errors.inc()
            if not self._rank_warned:  # every batch would say it: once a stream
                self._rank_warned = True
                log.warning("kv events from %s: %s (is the events port right?); its "
                            "batches are dropped", self.target.key, exc)
        except DecodeError as exc:
            self._metrics.kv_event_errors.inc()
            log.warning("kv events from %s: undecodable batch: %s", self.target.key, exc)
        else:
            groups = self._groups
            if groups.switched:  # another group is the full-attention one: start over
                groups.switched = False
                self._index.cleared(self.target.key)
            apply_events(self._index, self.target.key, self.target.scope, events)
            self.batches += 1
            self._metrics.kv_event_batches.inc()
        self._metrics.kv_events_cpu.inc(time.thread_time() - started)

    def _clear(self, how: str) -> None:
        self._index.cleared(self.target.key)
        if how == "restart":  # a new engine process: its groups are learnt again
            self._groups = GroupChoice()
        self._metrics.kv_event_resyncs.labels(how=how).inc()

    async def handle(self, seq: int, payload: bytes) -> None:
        """One message from the SUB socket (public so tests can drive it directly)."""
        last = self.last_seq
        if last is None:
            if seq > 0 and self._settings.replay_on_join and self.target.replay_endpoint:
                self.last_seq = -1
                await self._replay_then(0, seq, payload)
                return
            self._apply(payload)
            self.last_seq = seq
            return
        if seq == last + 1:
            self._apply(payload)
            self.last_seq = seq
            return
        if seq > last + 1:
            self._metrics.kv_event_gaps.inc()
            log.info("kv events from %s: gap %d..%d", self.target.key, last + 1, seq - 1)
            await self._replay_then(last + 1, seq, payload)
            return
        if self._dup_from <= seq <= self._dup_upto:
            return  # a batch the replay already delivered, arriving on the SUB socket
        log.info("kv events from %s: sequence went back to %d: engine restart",
                 self.target.key, seq)
        self._clear("restart")
        self._apply(payload)
        self.last_seq = seq

    async def _replay_then(self, start: int, seq: int, payload: bytes) -> None:
        """Replay from `start`, then apply batch `seq` (`payload`) unless the replay
        delivered it; a replay that ended short of it clears the pod first (the batches
        it missed may remove blocks). A replay on join that delivered nothing leaves
        nothing to clear: the pod has nothing indexed yet."""
        await self._replay_from(start, seq)
        got = self.last_seq
        if got is not None and got >= seq:
            return  # the replay already delivered it
        if got is not None and got + 1 < seq:
            self._clear("clear")
        self._apply(payload)
        self.last_seq = seq

    async def _replay_from(self, start: int, until: int) -> None:
        """Ask the replay socket for `start` onwards; apply what extends `last_seq` in order."""
        endpoint = self.target.replay_endpoint
        if endpoint is None:
            return
        if self._replay is None:
            self._replay = self._context.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            # vLLM's replay ROUTER sends its whole buffer (10,000 batches) at once with
            # the default send bound and drops what does not fit: this side's bound is
            # not what loses them (a loss still ends the replay short: the pod is cleared).
            self._replay.setsockopt(zmq.RCVHWM, 0)
            self._replay.connect(endpoint)
        sock = self._replay
        wait_s = self._settings.replay_timeout_s
        begin = self.last_seq if self.last_seq is not None else -1
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            for count in range(MAX_REPLAY_BATCHES):
                # The wait bounds each message, not the answer: a long replay takes
                # longer to apply than to send (10,000 batches of 60 blocks: 0.9 s).
                if count % REPLAY_BATCHES_PER_TURN == REPLAY_BATCHES_PER_TURN - 1:
                    await asyncio.sleep(0)  # requests go on while it is applied
                async with asyncio.timeout(wait_s):
                    frames = await sock.recv_multipart()
                if len(frames) != 3:
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == END_SEQ:
                    break
                current = self.last_seq if self.last_seq is not None else -1
                if seq <= current:
                    continue
                if seq != current + 1:
                    self._clear("clear")  # the engine's buffer lost part of the range
                self._apply(frames[2])
                self.last_seq = seq
            else:
                raise TimeoutError
        except TimeoutError:
            log.info("kv events from %s: replay from %d got no complete answer",
                     self.target.key, start)
            self._close_replay()  # a late answer must not confuse the next request
        else:
            self._metrics.kv_event_resyncs.labels(how="replay").inc()
        end = self.last_seq if self.last_seq is not None else -1
        if end >= until:
            self._dup_from, self._dup_upto = until, end
        if self.last_seq == -1:
            self.last_seq = None if begin == -1 else begin

    def _close_replay(self) -> None:
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None


# -- every pod's stream ----------------------------------------------------------------------


def _port(annotations: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = annotations.get(name)
    if raw is None:
        return default
    text = raw.strip().lower()
    if text in ("", "0", "none", "off", "false"):
        return None
    try:
        port = int(text)
    except ValueError:
        log.warning("annotation %s=%r is not a port; using %s", name, raw, default)
        return default
    return port if 0 < port < 65536 else default


def _tcp(ip: str, port: int) -> str:
    host = f"[{ip}]" if ":" in ip else ip
    return f"tcp://{host}:{port}"


def key_spaces(snapshot: Snapshot, defaults: KeySettings) -> dict[str, KeySpace]:
    """Each ModelServer's key space (scope -> KeySpace): the defaults overridden by its
    annotations (`router.kvhash.keyspace`)."""
    out: dict[str, KeySpace] = {}
    for server in snapshot.servers.values():
        scope = scope_of(server)
        settings = defaults.with_annotations(server.server.meta.annotations, scope)
        out[scope] = KeySpace(settings)
    return out


def stream_targets(
    snapshot: Snapshot, events_port: int = DEFAULT_EVENTS_PORT,
    replay_port: int | None = DEFAULT_REPLAY_PORT,
    spaces: Mapping[str, KeySpace] | None = None,
) -> dict[str, StreamTarget]:
    """The KV event streams the router should read, by pod key (see the module docstring)."""
    out: dict[str, StreamTarget] = {}
    for server in snapshot.servers.values():
        annotations = server.server.meta.annotations
        if annotations.get(ENABLE_ANNOTATION, "true").strip().lower() in ("false", "off", "0"):
            continue
        port = _port(annotations, PORT_ANNOTATION, events_port)
        if port is None:
            continue
        replay = _port(annotations, REPLAY_PORT_ANNOTATION, replay_port)
        ranks = server.data_parallel.local_size  # a pod's ranks bind one run of each
        if replay is not None and abs(replay - port) < ranks:
            replay = None  # the ranks' runs of ports overlap: the engines cannot replay
        topic = annotations.get(TOPIC_ANNOTATION, "")
        scope = scope_of(server)
        space = spaces.get(scope) if spaces is not None else None
        for pod in _scored_pods(server):
            rank = pod.dp_rank or 0  # vLLM's rank r binds the configured ports + r
            host = pod.engine_host  # a headless node's rank publishes from its own pod
            if pod.key in out or host is None or port + rank > MAX_PORT:
                continue
            out[pod.key] = StreamTarget(
                key=pod.key,
                endpoint=_tcp(host, port + rank),
                replay_endpoint=(
                    None if replay is None or replay + rank > MAX_PORT
                    else _tcp(host, replay + rank)
                ),
                topic=topic,
                scope=scope,
                space=space.ident if space is not None else 0,
                rank=pod.dp_rank,
            )
    return out


def scope_of(server: ServerPods) -> str:
    """The store pool a ModelServer's pods share: "namespace/name" of the ModelServer."""
    meta = server.server.meta
    return f"{meta.namespace}/{meta.name}"


def _scored_pods(server: ServerPods) -> list[Endpoint]:
    pods = list(server.aggregated)
    for group in server.groups:
        pods.extend(group.prefill)
    return pods


class KVEventsManager:
    """Keeps one `PodEventStream` task per prefill/aggregated pod of the current view."""

    def __init__(
        self,
        index: PrecisePrefixIndex,
        metrics: SchedulerMetrics,
        settings: StreamSettings | None = None,
        events_port: int = DEFAULT_EVENTS_PORT,
        replay_port: int | None = DEFAULT_REPLAY_PORT,
        enabled: bool = True,
        key_defaults: KeySettings | None = None,
    ) -> None:
        self._index = index
        self.key_defaults = key_defaults or KeySettings()
        self._metrics = metrics
        self.settings = settings or StreamSettings()
        self.events_port = events_port
        self.replay_port = replay_port
        self.enabled = enabled
        self._snapshot: Snapshot | None = None
        self._wanted: dict[str, StreamTarget] = {}
        self._tasks: dict[str, tuple[StreamTarget, asyncio.Task[None]]] = {}
        self._changed: asyncio.Event | None = None
        self._streams: dict[str, PodEventStream] = {}
        self._retiring: set[asyncio.Task[None]] = set()

    def on_snapshot(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot
        self._refresh()

    def set_key_defaults(self, defaults: KeySettings) -> None:
        if defaults != self.key_defaults:
            self.key_defaults = defaults
            self._refresh()

    def set_enabled(self, enabled: bool) -> None:
        if enabled != self.enabled:
            self.enabled = enabled
            self._refresh()

    def _refresh(self) -> None:
        if self._snapshot is None:
            return
        spaces = key_spaces(self._snapshot, self.key_defaults)
        self._index.set_spaces(spaces)
        targets = stream_targets(self._snapshot, self.events_port, self.replay_port, spaces)
        self._wanted = targets if self.enabled else {}
        self._index.retain_scopes({t.scope for t in targets.values()})
        if self._changed is not None:
            self._changed.set()

    def stream(self, key: str) -> PodEventStream | None:
        return self._streams.get(key)

    async def run(self) -> None:
        self._changed = asyncio.Event()
        context = zmq.asyncio.Context()
        try:
            while True:
                self._reconcile(context)
                await self._changed.wait()
                self._changed.clear()
        finally:
            tasks = [task for _, task in self._tasks.values()] + list(self._retiring)
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            self._tasks.clear()
            self._streams.clear()
            context.term()

    def _reconcile(self, context: zmq.asyncio.Context) -> None:
        for key, (target, task) in list(self._tasks.items()):
            wanted = self._wanted.get(key)
            if wanted != target or task.done():
                # Retire synchronously: the old task must not race the new one's entries.
                task.cancel()
                self._retiring.add(task)  # awaited at shutdown: its sockets must close
                task.add_done_callback(self._retiring.discard)
                del self._tasks[key]
                self._streams.pop(key, None)
                if wanted is None:
                    self._index.remove_pod(key)
                else:
                    self._index.cleared(key)
        for key, target in self._wanted.items():
            if key not in self._tasks:
                stream = PodEventStream(target, self._index, context, self._metrics,
                                        self.settings)
                task = asyncio.create_task(self._guarded(stream), name=f"kv-events {key}")
                self._tasks[key] = (target, task)
                self._streams[key] = stream

    async def _guarded(self, stream: PodEventStream) -> None:
        try:
            await stream.run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("kv events from %s failed; resubscribing", stream.target.key)
            self._metrics.kv_event_errors.inc()
            self._index.cleared(stream.target.key)
            await asyncio.sleep(1.0)
            if self._changed is not None:
                self._changed.set()


__all__ = [
    "Cleared",
    "DecodeError",
    "KVEventsManager",
    "PodEventStream",
    "Removed",
    "Stored",
    "StreamSettings",
    "StreamTarget",
    "apply_events",
    "decode_batch",
    "key_spaces",
    "scope_of",
    "stream_targets",
]
