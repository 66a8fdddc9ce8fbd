"""Busy polling (router/busy_poll.py): the loop polls while requests are in flight and
for the linger after, and goes quiet when the router is idle."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from router.busy_poll import IDLE_CHECK_S, BusyPoll

ROOT = Path(__file__).resolve().parents[2]


class Requests:
    """A stand-in for the drain's count of data requests in flight."""

    def __init__(self) -> None:
        self.in_flight = 0

    def __call__(self) -> int:
        return self.in_flight


@contextlib.asynccontextmanager
async def polling(poller: BusyPoll) -> AsyncIterator[None]:
    task = asyncio.get_running_loop().create_task(poller.run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def turns_over(poller: BusyPoll, yields: int) -> int:
    """How many turns the poller took while this task handed the loop back `yields` times."""
    before = poller.turns
    for _ in range(yields):
        await asyncio.sleep(0)
    return poller.turns - before


async def test_off_by_default_and_returns_at_once() -> None:
    poller = BusyPoll(0.0, Requests())
    assert not poller.enabled
    await asyncio.wait_for(poller.run(), timeout=1.0)
    assert poller.turns == 0


def test_negative_linger_is_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        BusyPoll(-0.001, Requests())


async def test_polls_at_every_turn_while_a_request_is_in_flight() -> None:
    requests = Requests()
    requests.in_flight = 1
    poller = BusyPoll(0.002, requests)
    async with polling(poller):
        # Every time this task yields, the poller runs once: the loop always has a
        # callback ready, so it never sleeps waiting for sockets.
        assert await turns_over(poller, 50) >= 49


async def test_keeps_polling_for_the_linger_then_goes_quiet() -> None:
    requests = Requests()
    requests.in_flight = 1
    poller = BusyPoll(0.05, requests)
    async with polling(poller):
        await turns_over(poller, 5)
        requests.in_flight = 0  # the last request ended: the linger starts
        assert await turns_over(poller, 20) >= 19
        await asyncio.sleep(0.05 + 4 * IDLE_CHECK_S)  # past the linger
        assert await turns_over(poller, 20) == 0
        quiet = poller.turns
        await asyncio.sleep(10 * IDLE_CHECK_S)
        assert poller.turns == quiet  # idle: it only looks, every IDLE_CHECK_S


async def test_a_request_after_a_quiet_spell_starts_polling_again() -> None:
    requests = Requests()
    poller = BusyPoll(0.002, requests)
    async with polling(poller):
        await asyncio.sleep(4 * IDLE_CHECK_S)
        assert poller.turns == 0  # nothing in flight since it started
        requests.in_flight = 2
        await asyncio.sleep(2 * IDLE_CHECK_S)  # its next look sees them
        assert await turns_over(poller, 20) >= 19


def test_serve_refuses_a_negative_busy_poll(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "router", "serve", "--config", str(tmp_path),
         "--busy-poll", "-1"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2
    assert "--busy-poll must not be negative" in done.stderr
