"""Free loopback ports, and waiting for a process to serve on one."""

from __future__ import annotations

import random
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

COMMON_PORT_TRIES = 200
#: Ports are drawn from here up to the kernel's ephemeral range (`EPHEMERAL_RANGE_FILE`):
#: above the fixed ports this project's services take by default (the simulator's 5557,
#: 5558 and 8998, Redis 6379, Prometheus 9090, the Mooncake master's 8080 and 9003),
#: below the ports every outgoing connection and
#: every bind to port 0 is given. A port drawn from the ephemeral range is free when
#: drawn, but may be some connection's local port by the time its server binds it (a
#: fresh clone's `pdgate up` test lost its router port that way: `address already in use`).
DRAW_FLOOR = 20_000
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: Random ports tried, at most, for one draw (each a bind).
DRAW_TRIES = 1000


def draw_range() -> range | None:
    """The ports `free_ports` draws from; None where the kernel's ephemeral range leaves
    fewer than a thousand above `DRAW_FLOOR` (or is unknown): then the kernel picks."""
    try:
        low = int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return range(DRAW_FLOOR, low) if low - DRAW_FLOOR >= 1000 else None


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the caller must tolerate losing a race)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports that were free a moment ago, from `draw_range` (random,
    each checked by a bind), or bound all at once where the kernel must pick (`free_port`
    called twice may then return one port twice, the kernel free to hand a just-closed
    port out again)."""
    span = draw_range()
    if span is None:
        return _kernel_ports(count, host)
    ports: list[int] = []
    for _ in range(DRAW_TRIES):
        port = random.randrange(span.start, span.stop)
        if port not in ports and _can_bind(host, port):
            ports.append(port)
            if len(ports) == count:
                return ports
    raise RuntimeError(f"no {count} free ports in {span} on {host}")


def free_port_runs(runs: int, length: int, host: str = "127.0.0.1") -> list[int]:
    """`runs` base ports, each the first of `length` consecutive ports that were free a
    moment ago, no two runs overlapping: the ports of a data-parallel engine, whose rank r
    binds base + r."""
    bases: list[int] = []
    taken: set[int] = set()
    for base in free_ports(64, host):
        span = set(range(base, base + length))
        if span & taken or not all(_can_bind(host, port) for port in span):
            continue
        bases.append(base)
        taken |= span
        if len(bases) == runs:
            return bases
    raise RuntimeError(f"no {runs} runs of {length} free ports on {host}")


def _kernel_ports(count: int, host: str) -> list[int]:
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def accepts(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Whether something accepts TCP connections at host:port right now."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def common_free_port(hosts: Sequence[str] = ("127.0.0.1",)) -> int:
    """A port free on every one of `hosts` right now.

    The pods of one ModelServer share `workloadPort.port`, so simulated pods on distinct
    loopback addresses need one port that is free on all of them.
    """
    for _ in range(COMMON_PORT_TRIES):
        port = free_port(hosts[0])
        if all(_can_bind(host, port) for host in hosts[1:]):
            return port
    raise RuntimeError(f"no port free on all of {list(hosts)}")


def _can_bind(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def wait_http(url: str, timeout_s: float = 30.0, interval_s: float = 0.05) -> None:
    """Poll `url` until it answers 200; raise TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready after {timeout_s:.0f} s")
        time.sleep(interval_s)
