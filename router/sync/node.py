"""`SyncNode`: one router process's end of the state sync (see the package docstring).

Channels (neither ever blocks the sender: a frame that cannot go is dropped, and the
receiver sees the gap in the sender's sequence):

- with `--workers N`, the workers of a host send each other Unix datagrams
  (`local.py`: two sockets per worker in `run_dir`; a quarter of what ZMQ over `ipc://`
  cost per frame). What a worker's siblings changed is read when it is about to pick
  (`catch_up`, hooked into the scheduler), or `catch_up_s` after its last read when it
  picks nothing (`_on_backstop`; a worker with nothing to read sleeps on the socket
  until a frame comes): the frames of a worker that picks never wake its event loop.
  Only new-prompt questions and answers go on the urgent lane, which the loop reads as
  they arrive;
- with peer replicas, worker 0 alone also binds a ZMQ PUB on `tcp://*:<sync_port>` and
  SUBscribes to each peer's (ZMQ drops at the high-water mark). It relays: frames of this
  host's workers go out to the peers, frames from the peers go on to this host's workers
  (unchanged bytes: origin and sequence stay the sender's). So each host has one peer
  connection per peer host.

Publishing never waits: a local change (in-flight count, routed prompt, ejection, engine
scrape) is queued and the queue goes out as ONE frame. A decision another process must
see before its next pick (a routed or prefilling prompt, an ejection, a pod this process
had nothing on turning busy) is flushed at the next turn of the event loop; other counts
and scrapes go with the frame of this process's next pick (`catch_up` sends them at the
next turn, where the pick's own changes join them) or after `flush_interval_s` (5 ms),
whichever comes first, so every request of that window shares one send and in-flight
counts are coalesced per pod (only the latest count is sent). Flushing everything at the
next turn sent a frame on almost every turn under load (acquire and release of prefill and
decode happen on different turns): one send, and one wake-up of every other process, each
time. (A 20 ms window, so that a busy process would send nearly all of them with a pick
and wake for none, saved no CPU the scale-out bench could see, for counts up to 20 ms
staler: not kept.) A batch that would encode larger than `MAX_FRAME_BYTES` goes out as
several frames. A heartbeat every `heartbeat_s` carries the whole in-flight report (counts
and prefill backlogs), so a dropped message is repaired within one heartbeat.

New prompts: where a prompt no pod holds starts is decided by one process, the leader
(the lowest origin among this process and its live peers). Two routers that receive one
new prompt within the sync's latency would otherwise each place it before hearing of the
other (it is then computed twice), and would both send their different new prompts to
the same emptiest pod, which one process never does: it sees its first pick before its
second. Another process asks the leader (PLACE, with the request's body), the leader picks
as for its own request, counts the asker's request on the pods at once, and its prefill
in the pod's backlog (the asker's own report replaces both within `flush_interval_s` of
its dispatch), and answers (PLACED); the asker dispatches there. Questions and answers
are frames of their own, unsequenced, on the workers' urgent lane; the leader catches up
on the asker's state before it picks. An answer later than `place_timeout_s` (a busy,
lost or partitioned leader) is not waited for: the asker places the prompt itself, as
every process does with `place_timeout_s` 0. A prompt whose body does not fit one frame
is placed where it arrived. The cost: a round trip to the leader for each new prompt
another process receives, and one more pick at the leader
(`pdgate_sync_placements_total`). That pick is recorded in the leader's own index but
neither broadcast nor counted in its decision metrics: the asker records, broadcasts and
counts its own pick when it dispatches, so each request is counted once, and the asker
does not see its own new prompt as cached (which would price its cold prefill as a hit).

Liveness: an origin silent for `ttl_s` is lost: its in-flight counts stop weighing on
any pod at once, and the router carries on with what it knows itself. Prompts it routed
stay in the approximate index (they describe the engines' caches, which outlive the
router that filled them; the index's LRU ages them out). Ejections it announced stay
until this process's own probe readmits the pod.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, cast

import zmq
from prometheus_client import CollectorRegistry

from router.load import InFlight
from router.resilience.ejection import OutlierDetector
from router.scheduling.approx_index import ApproximatePrefixIndex
from router.scheduling.backlog import PrefillBacklog
from router.scheduling.inflight_prefixes import InFlightPrefixes
from router.scheduling.metrics_scraper import EngineLoad, EngineMetricsStore, MetricsScraper
from router.sync import messages as m
from router.sync.config import SyncConfig
from router.sync.local import MAX_FRAME_BYTES, LocalChannel
from router.sync.metrics import SyncMetrics
from router.sync.peers import PeerDiscovery
from router.view import ClusterView, Endpoint, Snapshot

log = logging.getLogger("pdgate.sync")

#: Frames a PUB socket queues per subscriber before it drops (ZMQ's SNDHWM).
SEND_HWM_FRAMES: Final = 10_000
#: Frames a SUB socket queues before the transport drops (ZMQ's RCVHWM).
RECV_HWM_FRAMES: Final = 10_000
#: Messages waiting for the next flush; beyond, new ones are dropped (and counted).
MAX_PENDING_MESSAGES: Final = 10_000
#: Origins remembered (live or lost); the longest-lost are forgotten first.
MAX_PEERS: Final = 1024
#: A peer's latest sequenced frames remembered (by hash), to tell a frame that came
#: twice (two paths to one peer) from the origin's restart.
RECENT_FRAMES: Final = 16
#: Bytes of pod keys a heartbeat message names itself (with each key's count and
#: backlog, under half a frame, `MAX_FRAME_BYTES`); the rest of its pods follow it as
#: in-flight messages, so that no single message outgrows a frame.
HEARTBEAT_KEY_BYTES: Final = 16 * 1024
#: Frames read in one go before yielding to the event loop.
MAX_FRAMES_PER_WAKEUP: Final = 256
#: Sequence number of frames meant for this host's workers only (not counted for gaps).
UNSEQUENCED: Final = 0
#: New prompts waiting for the leader's placement at once; beyond, placed here.
MAX_PENDING_PLACEMENTS: Final = 1024

#: The leader's side of a placement: (asker, server key, model, path, flow, body) -> the
#: pod keys it chose (and now counts for the asker), or None.
Placer = Callable[[str, str, str, str, str, Mapping[str, Any]], tuple[str, ...] | None]


@dataclass(slots=True)
class _Peer:
    """Another router process, as far as this one knows."""

    seq: int
    last_heard: float
    live: bool = True
    #: Hashes of its latest sequenced frames (`RECENT_FRAMES`).
    recent: deque[int] = field(default_factory=lambda: deque(maxlen=RECENT_FRAMES))


class SyncNode:
    """Hooks into the router's state, publishes its changes, applies everyone else's."""

    def __init__(
        self,
        config: SyncConfig,
        *,
        inflight: InFlight,
        backlog: PrefillBacklog,
        outliers: OutlierDetector,
        approx: ApproximatePrefixIndex,
        engines: EngineMetricsStore,
        scraper: MetricsScraper,
        view: ClusterView,
        registry: CollectorRegistry,
        prefilling: InFlightPrefixes | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        config.validate()
        self.config = config
        self.origin = config.origin
        self.inflight = inflight
        self.backlog = backlog
        self.outliers = outliers
        self.approx = approx
        self.prefilling = prefilling
        self.engines = engines
        self.metrics = SyncMetrics(registry)
        self.metrics.info.labels(origin=self.origin).set(1)
        self._clock = clock
        self._peers: dict[str, _Peer] = {}
        self._unread_warned = False  # a message that could not be applied was logged
        self._endpoints: dict[str, Endpoint] = {}
        self._pending: list[m.Message] = []
        self._pending_inflight: dict[str, int] = {}
        self._pending_host: list[m.Message] = []
        self._soon = False  # a flush at the next loop turn is scheduled
        self._timer: asyncio.TimerHandle | None = None  # a flush in `flush_interval_s`
        self._loop: asyncio.AbstractEventLoop | None = None
        self._seq = 0
        self._local: LocalChannel | None = None
        self._peer_pub: zmq.Socket[bytes] | None = None
        self._peer_sub: zmq.Socket[bytes] | None = None
        self._seen_pods: set[str] = set()
        self._catching_up = False
        #: The state lane's backstop: a timer, or (`_watching`) a reader on the socket.
        self._backstop: asyncio.TimerHandle | None = None
        self._watching = False
        self._asks: dict[int, asyncio.Future[tuple[str, ...] | None]] = {}
        self._ask_ids = itertools.count(1)
        #: Places another process's new prompt when this one leads (set by the app).
        self.placer: Placer | None = None
        inflight.listener = self._on_inflight
        backlog.listener = self._on_backlog
        approx.listener = self._on_route
        if prefilling is not None:
            prefilling.listener = self._on_prefilling
        outliers.listener = self._on_eject
        if config.workers > 1:
            if config.leader:
                engines.listener = self._on_engine
            else:
                scraper.passive = True  # worker 0 scrapes for the host
        view.subscribe(self._on_snapshot)
        self._on_snapshot(view.snapshot)

    # -- what this process changed --------------------------------------------------------

    def _on_snapshot(self, snapshot: Snapshot) -> None:
        self._endpoints = snapshot.endpoints()

    def _on_inflight(self, key: str, count: int, rose: bool) -> None:
        """A count changed. A pod this process had nothing on turning busy goes out at the
        next turn: to the others it looks idle until then, and an idle pod is where their
        next pick goes (a scale-out pick log showed it: at the opening burst a warm request
        left its prompt's pod for one the other worker had just sent a request to, that
        count still waiting out `flush_interval_s`, and the prompt was computed twice).
        Every other change waits for the window."""
        self._pending_inflight[key] = count
        self._schedule(soon=rose and count == 1)

    def _on_backlog(self, key: str) -> None:
        """This process's prefill backlog on a pod changed (a dispatch, or a prefill's
        end correcting it): it goes out with the pod's count, in the window."""
        self._pending_inflight[key] = self.inflight.local(key)
        self._schedule()

    def _on_route(self, key: str, hashes: Sequence[int]) -> None:
        self._queue(self._pending, (m.ROUTE, key, list(hashes)), soon=True)

    def _on_prefilling(self, key: str, hashes: list[int], ready_in_s: float) -> None:
        self._queue(self._pending, (m.PREFILLING, key, hashes, ready_in_s), soon=True)

    def _on_eject(self, key: str, backoff: float) -> None:
        self._queue(self._pending, (m.EJECT, key, backoff), soon=True)

    def _on_engine(self, key: str, load: EngineLoad) -> None:
        self._queue(self._pending_host, (
            m.ENGINE, key, load.running, load.waiting, load.kv_usage, load.capacity_tokens,
            load.at,
        ))

    def _queue(self, queue: list[m.Message], message: m.Message, soon: bool = False) -> None:
        if len(queue) >= MAX_PENDING_MESSAGES:
            self.metrics.message["dropped"].inc()
            return
        queue.append(message)
        self._schedule(soon)

    def _schedule(self, soon: bool = False) -> None:
        """Flush at the next loop turn (`soon`: a decision) or within `flush_interval_s`."""
        loop = self._loop
        if loop is None or self._soon:
            return
        if soon:
            self._soon = True
            loop.call_soon(self.flush)
        elif self._timer is None:
            self._timer = loop.call_later(self.config.flush_interval_s, self.flush)

    def flush(self) -> None:
        """Send what is queued: one frame (plus one host frame)."""
        self._soon = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._pending or self._pending_inflight:
            batch = self._pending
            wait, now = self.backlog.own_wait_s, self._clock()
            batch.extend((m.INFLIGHT, k, c, wait(k, now))
                         for k, c in self._pending_inflight.items())
            self._pending = []
            self._pending_inflight = {}
            self._send_batch(batch, host_only=False)
        if self._pending_host:
            batch, self._pending_host = self._pending_host, []
            self._send_batch(batch, host_only=True)

    def _send_batch(self, batch: list[m.Message], host_only: bool, urgent: bool = False) -> None:
        """Encode `batch` as one frame, or as several when one would exceed
        `MAX_FRAME_BYTES` (halved until each fits; a single message that does not fit
        is dropped), and send each. Host-only and urgent frames carry no sequence number
        (an urgent frame may overtake the sequence on the state lane)."""
        seq = UNSEQUENCED if host_only or urgent else self._seq + 1
        frame = m.encode(self.origin, self.config.host_id, seq, batch)
        if len(frame) <= MAX_FRAME_BYTES:
            self._seq = max(self._seq, seq)
            self._send_frame(frame, len(batch), host_only, urgent)
        elif len(batch) == 1:
            log.warning("sync: a message of %d bytes is too large to send", len(frame))
            self.metrics.message["dropped"].inc()
        else:
            half = len(batch) // 2
            self._send_batch(batch[:half], host_only, urgent)
            self._send_batch(batch[half:], host_only, urgent)

    def _send_frame(self, frame: bytes, count: int, host_only: bool, urgent: bool) -> None:
        """One frame (`count` messages) to this host's workers (on the lane `urgent` says)
        and, unless `host_only`, the peer replicas; counted sent once."""
        if self._local is not None:
            self._local.send(frame, urgent)
        if not host_only and self._peer_pub is not None:
            try:
                self._peer_pub.send(frame, zmq.NOBLOCK)
            except zmq.Again:  # no PUB blocks, but be sure: a full queue drops, never waits
                self.metrics.message["dropped"].inc(count)
                return
        if self._local is not None or self._peer_pub is not None:
            self.metrics.message["sent"].inc(count)

    def _frames_dropped(self, frames: int) -> None:
        self.metrics.message["dropped"].inc(frames)

    # -- new prompts ----------------------------------------------------------------------

    def leader(self) -> str:
        """The origin that places new prompts: the lowest of this one and its live peers."""
        live = [origin for origin, peer in self._peers.items() if peer.live]
        return min([self.origin, *live])

    async def place(
        self, server: str, model: str, path: str, flow: str, body: Mapping[str, Any]
    ) -> tuple[str, ...] | None:
        """The pods the leader chose for this new prompt's request; None: place it here
        (this process leads, placement is off, the body is too large for one frame, too
        many asks wait, or the leader did not answer within `place_timeout_s`)."""
        timeout = self.config.place_timeout_s
        loop = self._loop
        leader = self.leader()
        if not timeout or loop is None or leader == self.origin:
            return None
        if len(self._asks) >= MAX_PENDING_PLACEMENTS:
            return None
        ask = next(self._ask_ids)
        message = (m.PLACE, leader, ask, server, model, path, flow, body)
        if len(m.encode(self.origin, self.config.host_id, 0, [message])) > MAX_FRAME_BYTES:
            return None
        future: asyncio.Future[tuple[str, ...] | None] = loop.create_future()
        self._asks[ask] = future
        self.flush()  # what the leader should know first (the state lane: read before)
        self._send_batch([message], host_only=False, urgent=True)
        outcomes = self.metrics.placement
        try:
            async with asyncio.timeout(timeout):
                pods = await future
        except TimeoutError:
            outcomes["timeout"].inc()
            return None
        finally:
            self._asks.pop(ask, None)
        outcomes["answered" if pods else "none"].inc()
        return pods

    def _on_place(self, asker: str, message: list[Any]) -> None:
        """Another process asks this one, the leader, to place a new prompt: answer now."""
        _, leader, ask, server, model, path, flow, body = message
        if leader != self.origin or self.placer is None:
            return
        # Read the asker's routes and counts sent before its question, and send this
        # process's waiting changes ahead of the answer (the asker reads them before it
        # picks).
        self.catch_up()
        try:
            pods = self.placer(asker, server, model, path, flow, body)
        except Exception:  # the asker then places it itself; the frame's other messages apply
            log.exception("sync: placing a new prompt for %s failed", asker)
            pods = None
        self.flush()
        self.metrics.placement["served"].inc()
        self._send_batch([(m.PLACED, asker, ask, list(pods or ()))], host_only=False,
                         urgent=True)

    def _on_placed(self, message: list[Any]) -> None:
        _, asker, ask, pods = message
        future = self._asks.get(ask) if asker == self.origin else None
        if future is not None and not future.done():
            future.set_result(tuple(pods) or None)

    def heartbeat(self) -> None:
        """The whole report: counts, and the prefill backlog on each pod counted (a lost
        frame's backlog is repaired as its count is)."""
        counts = self.inflight.local_counts()
        wait, now = self.backlog.own_wait_s, self._clock()
        backlogs = {key: left for key in counts if (left := wait(key, now)) > 0.0}
        keys = list(counts)
        size, named = 0, len(keys)
        for index, key in enumerate(keys):
            size += len(key) + 24  # a key, its count and its backlog, encoded
            if size > HEARTBEAT_KEY_BYTES:
                named = index
                break
        if named == len(keys):
            self._queue(self._pending, (m.HEARTBEAT, counts, backlogs))
            return
        # Too many pods for one message: the heartbeat names the first ones (and zeroes
        # the rest at the receiver), the messages after it in the same batch set the rest.
        first = {key: counts[key] for key in keys[:named]}
        self._queue(self._pending, (m.HEARTBEAT, first,
                                    {k: v for k, v in backlogs.items() if k in first}))
        for key in keys[named:]:
            self._queue(self._pending, (m.INFLIGHT, key, counts[key], backlogs.get(key, 0.0)))

    # -- what the others changed ----------------------------------------------------------

    def catch_up(self) -> None:
        """Before a pick: apply what this host's other workers sent on the state lane and
        this one has not read yet, and send what this process changed and has not sent at
        the next turn of the loop, in one frame with what the pick changes (sent now, it
        made a frame of its own: two a request). Moves the backstop (`_on_backstop`) on."""
        if self._pending or self._pending_inflight:
            self._schedule(soon=True)
        self._read_state()
        self._keep_backstop()

    def _read_state(self) -> int:
        """Apply the state lane's queued frames; how many were read."""
        if self._local is None or self._catching_up:
            return 0
        self._catching_up = True
        try:
            return self._local.drain()
        except Exception:  # a pick goes on with what was applied
            log.exception("sync: applying a sibling's frame failed")
            return 0
        finally:
            self._catching_up = False

    def _keep_backstop(self) -> None:
        """A catch-up happened: the backstop is due `catch_up_s` after it. The timer is
        moved only once it is less than half that ahead, so picks closer than that never
        let it fire, and move it once per half interval, not at every pick."""
        loop, local = self._loop, self._local
        if loop is None or local is None:
            return
        if self._watching:
            local.watch(None)
            self._watching = False
        timer, interval = self._backstop, self.config.catch_up_s
        if timer is not None:
            if timer.when() >= loop.time() + interval / 2:
                return
            timer.cancel()
        self._backstop = loop.call_later(interval, self._on_backstop)

    def _on_backstop(self) -> None:
        """No catch-up for `catch_up_s` (nobody picks here): read what waits. If anything
        did, look again in `catch_up_s`; if nothing did, sleep on the socket until a frame
        comes (`LocalChannel.watch`) instead of waking every `catch_up_s` to find none: an
        idle `--workers 2` woke about 217 times a second against 100 for two processes
        sharing nothing, and used 4% of a core against 3% (`benchmarks/HISTORY.md`)."""
        self._backstop = None
        if self._read_state():
            self._keep_backstop()
        elif self._local is not None and self._loop is not None:
            self._local.watch(self.catch_up)
            self._watching = True

    def apply(self, frame: bytes, from_peers: bool = False) -> bool:
        """Apply one frame; False if it is this process's (or, `from_peers`, this host's) own.

        Frames from peer replicas (`from_peers`) that carry this host's id are our own,
        come back because a static peer list may name this replica too.
        """
        return self._apply(frame, from_peers) is not None

    def _apply(self, frame: bytes, from_peers: bool) -> int | None:
        """`apply`: the frame's sequence number, or None when it was not applied."""
        try:
            origin, host_id, seq, batch = m.decode(frame)
        except ValueError:
            self.metrics.message["dropped"].inc()
            return None
        if origin == self.origin or (from_peers and host_id == self.config.host_id):
            return None
        now = self._clock()
        # Frames that may come by two paths: sequenced ones, and any from peer replicas.
        digest = hash(frame) if seq != UNSEQUENCED or from_peers else None
        peer = self._peers.get(origin)
        if peer is None:
            peer = _Peer(seq, now)
            self._remember(origin, peer)
            log.info("sync: peer %s joined", origin)
        else:
            if digest is not None and digest in peer.recent:
                self.metrics.message["duplicate"].inc()  # the same frame by another path
                return None
            if seq != UNSEQUENCED:
                if seq <= peer.seq:  # the origin restarted: what it said before is void
                    self._drop_state(origin)
                elif seq > peer.seq + 1:
                    self.metrics.message["dropped"].inc(seq - peer.seq - 1)
                peer.seq = seq
            peer.last_heard = now
            if not peer.live:
                peer.live = True
                log.warning("sync: peer %s is back", origin)
        if digest is not None:
            peer.recent.append(digest)
        same_host = host_id == self.config.host_id
        unread = 0
        for message in batch:
            try:
                self._apply_one(origin, same_host, message, now)
            except (IndexError, KeyError, TypeError, ValueError):
                # A message of a shape this version does not know (a peer of another
                # version during a rolling upgrade): dropped, the rest still applies.
                unread += 1
                log.debug("sync: a message from %s not applied", origin, exc_info=True)
                if not self._unread_warned:
                    self._unread_warned = True
                    log.warning("sync: a message from %s could not be applied (a peer of "
                                "another version?); such messages are dropped and counted",
                                origin, exc_info=True)
        if unread:
            self.metrics.message["dropped"].inc(unread)
        self.metrics.message["received"].inc(len(batch) - unread)
        return seq

    def _apply_one(self, origin: str, same_host: bool, message: list[Any], now: float) -> None:
        kind = message[0]
        if kind == m.INFLIGHT:
            self.inflight.set_remote(origin, message[1], int(message[2]))
            if len(message) > 3:
                self.backlog.set_remote(origin, message[1], float(message[3]), now)
        elif kind == m.ROUTE:
            if message[1] in self._endpoints:
                self.approx.apply_remote(message[1], message[2])
        elif kind == m.PREFILLING:
            if self.prefilling is not None and message[1] in self._endpoints:
                self.prefilling.apply_remote(message[1], message[2], float(message[3]), now)
        elif kind == m.HEARTBEAT:
            self.inflight.replace_remote(origin, dict(message[1]))
            if len(message) > 2:  # a sender from before backlogs were in the heartbeat
                self.backlog.replace_remote(origin, dict(message[2]), now)
        elif kind == m.PLACE:
            self._on_place(origin, message)
        elif kind == m.PLACED:
            self._on_placed(message)
        elif kind == m.EJECT:
            key, backoff = message[1], float(message[2])
            if backoff > 0:
                endpoint = self._endpoints.get(key)
                if endpoint is not None:
                    self.outliers.apply_remote_eject(endpoint, backoff)
            else:
                self.outliers.apply_remote_readmit(key)
        elif kind == m.ENGINE and same_host:
            key = message[1]
            if key not in self._endpoints:
                return
            self.engines.apply_remote(key, EngineLoad(*message[2:7]))
            # Unchanged capacities cost a lookup there; a pod that left the view and came
            # back gets its capacity again (a copy kept here outlived the index's entry).
            self.approx.set_capacity_tokens(key, message[5])

    def _remember(self, origin: str, peer: _Peer) -> None:
        if len(self._peers) >= MAX_PEERS:
            lost = [o for o, p in self._peers.items() if not p.live]
            victim = min(lost or self._peers, key=lambda o: self._peers[o].last_heard)
            self._forget(victim)
        self._peers[origin] = peer

    def _drop_state(self, origin: str) -> None:
        """What `origin` reported no longer weighs on any pod (lost, restarted, forgotten)."""
        self.inflight.drop_origin(origin)
        self.backlog.drop_origin(origin)

    def _forget(self, origin: str) -> None:
        self._peers.pop(origin, None)
        self._drop_state(origin)
        with contextlib.suppress(KeyError):
            self.metrics.last_heard.remove(origin)

    def expire(self) -> None:
        """Mark origins silent for longer than the TTL lost; drop their in-flight counts."""
        now = self._clock()
        live = lost = 0
        for origin, peer in self._peers.items():
            age = now - peer.last_heard
            if peer.live and age > self.config.ttl_s:
                peer.live = False
                self._drop_state(origin)
                log.warning("sync: peer %s lost (silent %.2f s); its in-flight counts expire",
                            origin, age)
            if peer.live:
                live += 1
            else:
                lost += 1
            self.metrics.last_heard.labels(peer=origin).set(age)
        self.metrics.peer_state["live"].set(live)
        self.metrics.peer_state["lost"].set(lost)
        seen, gauge = self.inflight.seen(), self.metrics.seen_inflight
        for key in self._seen_pods - seen.keys():
            if key in self._endpoints:
                gauge.labels(pod=key).set(0)
            else:  # gone from the view: its series goes too (one per pod ever seen stayed)
                with contextlib.suppress(KeyError):
                    gauge.remove(key)
        for key, count in seen.items():
            gauge.labels(pod=key).set(count)
        self._seen_pods = (self._seen_pods & self._endpoints.keys()) | seen.keys()

    def peers(self) -> dict[str, bool]:
        """origin -> live, for every origin this process has heard."""
        return {origin: peer.live for origin, peer in self._peers.items()}

    # -- sockets --------------------------------------------------------------------------

    async def run(self) -> None:
        """Bind, connect, relay and keep time until cancelled."""
        config = self.config
        self._loop = asyncio.get_running_loop()
        # Plain sockets: a PUB send never blocks (it queues or drops), and the SUB is read
        # from the event loop's own reader callback (`_read_peers`).
        context = zmq.Context()
        sockets: list[zmq.Socket[Any]] = []

        def pub() -> zmq.Socket[bytes]:
            s: zmq.Socket[bytes] = context.socket(zmq.PUB)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, SEND_HWM_FRAMES)
            sockets.append(s)
            return s

        def sub() -> zmq.Socket[bytes]:
            s: zmq.Socket[bytes] = context.socket(zmq.SUB)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVHWM, RECV_HWM_FRAMES)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            sockets.append(s)
            return s

        tasks: list[asyncio.Task[None]] = []
        local: LocalChannel | None = None
        peer_fd: int | None = None
        try:
            if config.leader and config.sync_port is not None:
                self._peer_pub = pub()
                self._peer_pub.bind(f"tcp://{config.sync_host}:{config.sync_port}")
                peer_sub = self._peer_sub = sub()
                loop = self._loop
                discovery = PeerDiscovery(
                    config, peer_sub, lambda: loop.call_soon(self._read_peers, peer_sub)
                )
                tasks.append(asyncio.create_task(discovery.run()))
                peer_fd = cast(int, peer_sub.getsockopt(zmq.FD))
                loop.add_reader(peer_fd, self._read_peers, peer_sub)
                loop.call_soon(self._read_peers, peer_sub)  # anything queued before
            if config.workers > 1:
                local = LocalChannel(config, self._on_local_frame, self._frames_dropped)
                local.open(self._loop)
                self._local = local
                self.catch_up()  # what came before, and the backstop's first timer
            tasks.append(asyncio.create_task(self._tick()))
            self._schedule()
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            for origin in list(self._peers):  # heard no more: local state only
                self._forget(origin)
            if self._backstop is not None:
                self._backstop.cancel()
                self._backstop = None
            self._watching = False  # `local.close` stops the reader
            if local is not None:
                local.close()
            if peer_fd is not None:
                self._loop.remove_reader(peer_fd)
            self._local = self._peer_pub = self._peer_sub = None
            for s in sockets:
                s.close(linger=0)
            context.term()

    def _on_local_frame(self, frame: bytes) -> None:
        """A sibling worker's frame: apply it; the leader relays it to the peer replicas."""
        if self.apply(frame) and self._peer_pub is not None:
            with contextlib.suppress(zmq.Again):
                self._peer_pub.send(frame, zmq.NOBLOCK)
                self.metrics.message["relayed"].inc()

    def _read_peers(self, sub: zmq.Socket[bytes]) -> None:
        """Peer replicas' frames: apply each, relay it to this host's other workers.

        Read from the loop's reader callback on the socket's `ZMQ_FD` rather than through
        `zmq.asyncio` (a future and a poll per frame): the receiving end of a frame cost
        about 70 µs of CPU against 165 µs (`benchmarks.sync_channel`'s set-up, measured
        beside it). `ZMQ_FD` signals edges, not levels, so what is queued is read until
        `ZMQ_EVENTS` says none is left; past `MAX_FRAMES_PER_WAKEUP` the rest waits for
        the next loop turn instead of a signal that would not come. Another call on the
        socket (a peer connected) can consume an edge: discovery asks for a read after
        each change, and the heartbeat tick reads too, so a frame waits one tick at most.
        """
        relayed = self.metrics.message["relayed"]
        for _ in range(MAX_FRAMES_PER_WAKEUP):
            try:
                if not cast(int, sub.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    return
                frame = sub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:  # the socket closed under a callback already scheduled
                return
            seq = self._apply(frame, from_peers=True)
            if seq is not None and self._local is not None:
                # Unsequenced frames from peers are placements (host frames stay home).
                self._local.send(frame, urgent=seq == UNSEQUENCED)
                relayed.inc()
        if self._loop is not None:
            self._loop.call_soon(self._read_peers, sub)

    async def _tick(self) -> None:
        while True:
            self._read_state()  # a sibling's heartbeat before ages are checked
            self.heartbeat()
            self.expire()
            if self._peer_sub is not None:
                self._read_peers(self._peer_sub)  # a missed edge waits one tick at most
            await asyncio.sleep(self.config.heartbeat_s)
