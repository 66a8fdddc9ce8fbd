"""`LocalChannel`: frames between the workers of one host, as Unix datagrams.

Each worker binds two datagram sockets, one per lane, and sends each frame to every
sibling over a socket connected to that sibling's address for the frame's lane. A
datagram is one frame: no framing, no connection to set up or lose, and the kernel keeps
each sender's frames of one lane in order.

Two lanes, because what wakes a worker is what its sync costs:

- **state** (`config.local_address`): in-flight counts, routed prompts, ejections,
  heartbeats, engine scrapes. The worker reads what is queued (`drain`) when it is about
  to use it (before every pick, through `SyncNode.catch_up`) and otherwise
  `SyncConfig.catch_up_s` after its last read; only a worker that found nothing there
  then waits for a frame with the event loop's reader callback (`watch`). A pick so sees
  every frame sent before it, and a frame costs a `recv` and its apply, not a wake-up of
  the event loop. At 300 requests/s over `--workers 2` every request sent one or two frames
  and each woke the other worker's idle loop: 1.37x one process's CPU a request, against
  1.15x for two processes sharing nothing; read at the pick, 1.19x-1.40x against
  1.19x-1.39x (`benchmarks/results/2026-12-05-sync-lanes/`).
- **urgent** (`config.urgent_address`): the new-prompt questions and answers
  (`node.py`, "New prompts"), read by the loop as they arrive: somebody waits for each.

Why not ZMQ, which the peer channel between replicas uses (`node.py`): between two
processes at 600 frames a second (`python -m benchmarks.sync_channel`: CPU of both
processes net of the pacing loop alone, two runs of three rounds), a PUB/SUB frame over
`ipc://` read through `zmq.asyncio` cost 125-233 µs of CPU (both processes' ZMQ I/O
threads wake for every frame, then the receiving event loop), a datagram 34-70 µs (one
`send`, one wake-up of the receiving loop).

Never waiting: a sibling whose receive queue is full (Linux queues only
`net.unix.max_dgram_qlen` datagrams, 10 by default) makes the send fail at once; the
frame then waits in that sibling's backlog (at most `MAX_BACKLOG_BYTES`, beyond which
frames are dropped and counted) and goes out when the socket is writable again, which is
when the sibling has read its queue. A sibling not up yet, or gone, drops the frame
(counted). A sibling that restarted binds the same address: the send on the old
connection fails, and the frame goes at once over a socket connected afresh. Heartbeats
repair what a drop lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections import deque
from collections.abc import Callable
from typing import Final

from router.sync.config import SyncConfig

#: Largest frame sent (bytes); `node.py` splits a batch that would encode larger. Below
#: the default socket send buffer (`net.core.wmem_default`, 208 KiB), which bounds a
#: Unix datagram.
MAX_FRAME_BYTES: Final = 64 * 1024
#: Bytes of frames held for one sibling whose queue is full; beyond, frames are dropped
#: (a sibling stalled for a second at 300 requests/s leaves well under 1 MiB).
MAX_BACKLOG_BYTES: Final = 4 * 1024 * 1024
#: Frames read in one wake-up (urgent lane) or one `drain` (state lane) at most.
MAX_FRAMES_PER_READ: Final = 256


class _Sibling:
    """One other worker's lane: its address, a socket connected to it, frames waiting."""

    __slots__ = ("address", "backlog", "held_bytes", "sock")

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock: socket.socket | None = None
        self.backlog: deque[bytes] = deque()
        self.held_bytes = 0

    def close(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.sock is not None:
            loop.remove_writer(self.sock.fileno())
            self.sock.close()
            self.sock = None
        self.backlog.clear()
        self.held_bytes = 0


class LocalChannel:
    """This worker's end: `send` to every sibling; frames received go to `on_frame`, the
    urgent lane's as they arrive, the state lane's when `drain` reads them."""

    def __init__(
        self,
        config: SyncConfig,
        on_frame: Callable[[bytes], None],
        on_dropped: Callable[[int], None],
    ) -> None:
        self.config = config
        self.on_frame = on_frame
        #: Called with the number of frames dropped (queue full or sibling absent).
        self.on_dropped = on_dropped
        others = [w for w in range(config.workers) if w != config.worker]
        #: Per lane (urgent or not), one entry per sibling.
        self._siblings = {
            False: [_Sibling(config.local_address(w)) for w in others],
            True: [_Sibling(config.urgent_address(w)) for w in others],
        }
        self._state: socket.socket | None = None
        self._urgent: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _addresses(self) -> tuple[str, str]:
        worker = self.config.worker
        return self.config.local_address(worker), self.config.urgent_address(worker)

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind this worker's sockets and start reading the urgent one."""
        socks = []
        for path in self._addresses():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a socket file left by an earlier process of this name
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.setblocking(False)
            sock.bind(path)
            socks.append(sock)
        self._state, self._urgent = socks
        self._loop = loop
        loop.add_reader(self._urgent.fileno(), self._read, self._urgent)

    def close(self) -> None:
        loop, state, urgent = self._loop, self._state, self._urgent
        if loop is None or state is None or urgent is None:
            return
        loop.remove_reader(urgent.fileno())
        loop.remove_reader(state.fileno())  # if `watch`ed
        for lane in self._siblings.values():
            for sibling in lane:
                sibling.close(loop)
        state.close()
        urgent.close()
        for path in self._addresses():
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._state = self._urgent = self._loop = None

    def send(self, frame: bytes, urgent: bool = False) -> None:
        """Send `frame` on its lane to every sibling now, or queue it behind that sibling's
        backlog."""
        for sibling in self._siblings[urgent]:
            if sibling.backlog:
                self._hold(sibling, frame)
            else:
                self._send_one(sibling, frame)

    def drain(self) -> int:
        """Read the state lane's queued frames (at most `MAX_FRAMES_PER_READ`), each to
        `on_frame`; how many were read."""
        return self._read(self._state)

    def watch(self, on_waiting: Callable[[], None] | None) -> None:
        """Call `on_waiting` from the event loop whenever a state-lane frame waits to be
        read (it should `drain`); None stops it. What `SyncNode` sleeps on when no pick
        has read the lane for a while and nothing was waiting."""
        loop, state = self._loop, self._state
        if loop is None or state is None:
            return
        if on_waiting is None:
            loop.remove_reader(state.fileno())
        else:
            loop.add_reader(state.fileno(), on_waiting)

    def held(self) -> int:
        """Frames waiting for a sibling whose queue was full."""
        return sum(len(s.backlog) for lane in self._siblings.values() for s in lane)

    def _send_one(self, sibling: _Sibling, frame: bytes) -> None:
        """Send `frame` now, hold it when the sibling's queue is full, or drop it when the
        sibling is absent. A socket whose sibling went away is connected afresh once at
        once: a restarted sibling binds the same address."""
        assert self._loop is not None
        for _ in range(2):
            fresh = sibling.sock is None
            try:
                if sibling.sock is None:
                    sibling.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                    sibling.sock.setblocking(False)
                    sibling.sock.connect(sibling.address)
                sibling.sock.send(frame)
                return
            except BlockingIOError:  # the sibling's queue is full: wait for it
                self._hold(sibling, frame)
                return
            except OSError:  # not up yet, gone, or restarted
                sibling.close(self._loop)
                if fresh:
                    break
        self.on_dropped(1)

    def _hold(self, sibling: _Sibling, frame: bytes) -> None:
        if sibling.held_bytes + len(frame) > MAX_BACKLOG_BYTES:
            self.on_dropped(1)
            return
        if not sibling.backlog and sibling.sock is not None and self._loop is not None:
            self._loop.add_writer(sibling.sock.fileno(), self._drain_backlog, sibling)
        sibling.backlog.append(frame)
        sibling.held_bytes += len(frame)

    def _drain_backlog(self, sibling: _Sibling) -> None:
        """The sibling's socket is writable: send its backlog until it fills again."""
        sock, backlog = sibling.sock, sibling.backlog
        assert sock is not None and self._loop is not None
        while backlog:
            try:
                sock.send(backlog[0])
            except BlockingIOError:
                return
            except OSError:
                self.on_dropped(len(backlog))
                sibling.close(self._loop)
                return
            sibling.held_bytes -= len(backlog.popleft())
        self._loop.remove_writer(sock.fileno())

    def _read(self, sock: socket.socket | None) -> int:
        if sock is None:
            return 0
        for read in range(MAX_FRAMES_PER_READ):
            try:
                frame = sock.recv(MAX_FRAME_BYTES)
            except (BlockingIOError, InterruptedError):
                return read
            self.on_frame(frame)
        return MAX_FRAMES_PER_READ
