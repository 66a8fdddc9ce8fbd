"""`benchmarks.sync_channel`: each channel, run briefly between two real processes,
delivers every frame it sends and reports the CPU it took."""

from __future__ import annotations

import pytest

from benchmarks.sync_channel import run_pair


@pytest.mark.parametrize("channel", ["zmq asyncio", "zmq reader", "datagram",
                                     "datagram state lane"])
def test_every_frame_sent_arrives(channel: str) -> None:
    sender, receiver, sent, received = run_pair(channel, rate=200.0, seconds=0.3)
    assert sent > 10
    assert received == sent
    assert sender > 0 and receiver >= 0
