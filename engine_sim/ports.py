"""Free loopback ports, and waiting for a process to serve on one."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

COMMON_PORT_TRIES = 200


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the caller must tolerate losing a race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports that were free a moment ago: bound all at once, so no two
    are the same (`free_port` called twice may return one port twice, the kernel free to
    hand a just-closed port out again)."""
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
