"""`router.sync.local`: the workers' datagram channel over real Unix sockets: order, a full
receive queue (held, never dropped or waited on), an absent or restarted sibling, and the
two lanes (state frames wait for a `drain`, urgent ones arrive by themselves)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from router.sync import SyncConfig
from router.sync import local as local_mod
from router.sync.local import LocalChannel


class Worker:
    """One worker's channel with what it received and how many frames it dropped."""

    def __init__(self, run_dir: Path, worker: int, workers: int = 2) -> None:
        self.config = SyncConfig(host_id="h", worker=worker, workers=workers,
                                 run_dir=str(run_dir))
        self.received: list[bytes] = []
        self.arrived = asyncio.Event()
        self.dropped = 0
        self.channel = LocalChannel(self.config, self._receive, self._drop)

    def _receive(self, frame: bytes) -> None:
        self.received.append(frame)
        self.arrived.set()

    def _drop(self, frames: int) -> None:
        self.dropped += frames

    async def until(self, check: Callable[[], bool]) -> None:
        """Read the state lane each loop turn until `check` holds (at most 2 s), as a
        worker that picks all the time would."""
        async with asyncio.timeout(2.0):
            while not check():
                self.channel.drain()
                await asyncio.sleep(0)

    def open(self) -> Worker:
        self.channel.open(asyncio.get_running_loop())
        return self


def _socket_files(run_dir: Path) -> list[Path]:
    return list(run_dir.glob("*.sock"))


async def test_frames_arrive_in_order_and_never_wait_on_a_full_queue(tmp_path: Path) -> None:
    a, b = Worker(tmp_path, 0).open(), Worker(tmp_path, 1).open()
    try:
        # Sent without yielding, so b reads nothing meanwhile: Linux queues only
        # net.unix.max_dgram_qlen (10 by default) datagrams; the rest wait in a's backlog.
        frames = [b"frame %d" % i for i in range(300)]
        for frame in frames:
            a.channel.send(frame)
        assert a.dropped == 0 and a.channel.held() > 0
        await b.until(lambda: len(b.received) == len(frames))
        assert a.channel.held() == 0
        assert b.received == frames
        b.channel.send(b"back")
        await a.until(lambda: a.received == [b"back"])
    finally:
        a.channel.close()
        b.channel.close()


async def test_a_full_backlog_drops_and_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_mod, "MAX_BACKLOG_BYTES", 5 * 8)  # five 8-byte frames
    a, b = Worker(tmp_path, 0).open(), Worker(tmp_path, 1).open()
    try:
        for i in range(100):
            a.channel.send(b"%08d" % i)
        assert a.dropped > 0
        await b.until(lambda: len(b.received) == 100 - a.dropped)
        numbers = [int(f) for f in b.received]
        assert numbers == sorted(numbers) and numbers[0] == 0  # the newest were dropped
    finally:
        a.channel.close()
        b.channel.close()


async def test_an_absent_sibling_drops_and_a_restarted_one_is_reached_again(
    tmp_path: Path,
) -> None:
    a = Worker(tmp_path, 0).open()
    try:
        a.channel.send(b"nobody yet")
        assert a.dropped == 1
        b = Worker(tmp_path, 1).open()
        a.channel.send(b"one")
        await b.until(lambda: b.received == [b"one"])
        b.channel.close()  # the worker exits; its successor binds the same address
        b2 = Worker(tmp_path, 1).open()
        a.channel.send(b"two")
        await b2.until(lambda: b2.received == [b"two"])
        assert a.dropped == 1
        b2.channel.close()
    finally:
        a.channel.close()
    assert not _socket_files(tmp_path)  # each worker removes its socket file


def _got(worker: Worker, frames: set[bytes]) -> Callable[[], bool]:
    return lambda: set(worker.received) == frames


async def test_three_workers_each_reach_both_siblings(tmp_path: Path) -> None:
    workers = [Worker(tmp_path, i, workers=3).open() for i in range(3)]
    try:
        for w in workers:
            w.channel.send(b"from %d" % w.config.worker)
        for w in workers:
            expected = {b"from %d" % i for i in range(3) if i != w.config.worker}
            await w.until(_got(w, expected))
        assert sum(w.dropped for w in workers) == 0
    finally:
        for w in workers:
            w.channel.close()


async def test_state_frames_wait_for_a_drain_and_urgent_ones_arrive_by_themselves(
    tmp_path: Path,
) -> None:
    a, b = Worker(tmp_path, 0).open(), Worker(tmp_path, 1).open()
    try:
        a.channel.send(b"count")
        a.channel.send(b"ask", urgent=True)
        async with asyncio.timeout(2.0):
            await b.arrived.wait()  # the event loop read the urgent lane
        assert b.received == [b"ask"]
        for _ in range(10):
            await asyncio.sleep(0)
        assert b.received == [b"ask"]  # the state frame did not wake the loop
        assert b.channel.drain() == 1
        assert b.received == [b"ask", b"count"]
        assert b.channel.drain() == 0
    finally:
        a.channel.close()
        b.channel.close()
    assert not _socket_files(tmp_path)
