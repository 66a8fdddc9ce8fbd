"""Free loopback ports for processes that cannot be told to pick their own."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the caller must tolerate losing a race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def accepts(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Whether something accepts TCP connections at host:port right now."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
