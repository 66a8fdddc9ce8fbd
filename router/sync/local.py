"""`LocalChannel`: frames between the workers of one host, as Unix datagrams.

Each worker binds a datagram socket at `SyncConfig.local_address(worker)` and sends
every frame to each sibling over a socket connected to the sibling's address. A datagram
is one frame: no framing, no connection to set up or lose, and the kernel keeps each
sender's frames in order.

Why not ZMQ, which the peer channel between replicas uses (`node.py`): between two
processes at 600 frames a second (`python -m benchmarks.sync_channel`: CPU of both
processes net of the pacing loop alone, two runs of three rounds), a PUB/SUB frame over
`ipc://` read through `zmq.asyncio` cost 125-233 µs of CPU (both processes' ZMQ I/O
threads wake for every frame, then the receiving event loop), a datagram 34-70 µs (one
`send`, one wake-up of the receiving loop). Workers exchange one or two frames per
request: at 300 requests/s this was what `--workers 2` cost beyond two processes that
share nothing (`benchmarks/results/2026-12-04-scale-out-datagram/`).

Never waiting: a sibling whose receive queue is full (Linux queues only
`net.unix.max_dgram_qlen` datagrams, 10 by default) makes the send fail at once; the
frame then waits in that sibling's backlog (at most `MAX_BACKLOG_BYTES`, beyond which
frames are dropped and counted) and goes out when the socket is writable again. A sibling
not up yet, or gone, drops the frame (counted). A sibling that restarted binds the same
address: the send on the old connection fails, and the frame goes at once over a socket
connected afresh. Heartbeats repair what a drop lost.
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
#: Frames read in one wake-up before yielding to the event loop.
MAX_FRAMES_PER_WAKEUP: Final = 256


class _Sibling:
    """One other worker: its address, a socket connected to it, frames waiting for it."""

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
    """This worker's end: `send` to every sibling, `on_frame` for each frame received."""

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
        self._siblings = [
            _Sibling(config.local_address(w)) for w in range(config.workers) if w != config.worker
        ]
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind this worker's socket and start reading it."""
        path = self.config.local_address(self.config.worker)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a socket file left by an earlier process of this name
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        sock.bind(path)
        self._sock, self._loop = sock, loop
        loop.add_reader(sock.fileno(), self._read)

    def close(self) -> None:
        loop, sock = self._loop, self._sock
        if loop is None or sock is None:
            return
        loop.remove_reader(sock.fileno())
        for sibling in self._siblings:
            sibling.close(loop)
        sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.config.local_address(self.config.worker))
        self._sock = self._loop = None

    def send(self, frame: bytes) -> None:
        """Send `frame` to every sibling now, or queue it behind that sibling's backlog."""
        for sibling in self._siblings:
            if sibling.backlog:
                self._hold(sibling, frame)
            else:
                self._send_one(sibling, frame)

    def held(self) -> int:
        """Frames waiting for a sibling whose queue was full."""
        return sum(len(sibling.backlog) for sibling in self._siblings)

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
            self._loop.add_writer(sibling.sock.fileno(), self._drain, sibling)
        sibling.backlog.append(frame)
        sibling.held_bytes += len(frame)

    def _drain(self, sibling: _Sibling) -> None:
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

    def _read(self) -> None:
        sock = self._sock
        if sock is None:
            return
        for _ in range(MAX_FRAMES_PER_WAKEUP):
            try:
                frame = sock.recv(MAX_FRAME_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            self.on_frame(frame)
