"""Free loopback ports: several at once are distinct (a Mooncake master whose RPC and
metrics ports were drawn as one port passed its readiness check, then shut down)."""

from __future__ import annotations

import socket

import pytest

from engine_sim.mooncake_master import MooncakeMaster
from engine_sim.ports import draw_range, free_port, free_ports


def test_ports_drawn_together_are_distinct_and_free() -> None:
    ports = free_ports(16)
    assert len(set(ports)) == 16
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_master_picks_three_distinct_ports_and_keeps_the_ones_given() -> None:
    for _ in range(50):
        master = MooncakeMaster()
        master._pick_ports()
        assert len({master.rpc_port, master.metadata_port, master.metrics_port}) == 3
    given = MooncakeMaster(rpc_port=free_ports(1)[0])
    given._pick_ports()
    assert given.rpc_port == given._want[0]
    assert len({given.rpc_port, given.metadata_port, given.metrics_port}) == 3


def test_ports_are_drawn_below_the_kernels_ephemeral_range() -> None:
    """An outgoing connection's local port comes from the ephemeral range: a port drawn
    there could be taken before its server binds it."""
    span = draw_range()
    if span is None:
        pytest.skip("no room below this kernel's ephemeral range")
    assert all(port in span for port in [*free_ports(16), free_port()])
