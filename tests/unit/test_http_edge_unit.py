"""The HTTP edge's knobs: defaults, validation, flags, the head bound and the fd limit.

The behaviour on sockets is tested on real processes in
`tests/integration/test_http_edge.py`.
"""

from __future__ import annotations

import argparse
import resource

import pytest

from router.cli import _add_connection_flags, _edge_config
from router.http import ensure_fd_limit
from router.http.config import (
    DEFAULT_IDLE_TIMEOUT_S,
    EdgeConfig,
    head_bytes_bound,
)
from router.security.config import SecurityConfig
from router.upstream import KEEPALIVE_SECONDS


@pytest.mark.parametrize("field", ["header_timeout_s", "body_timeout_s", "idle_timeout_s",
                                   "max_connections", "max_head_bytes"])
def test_bounds_must_be_positive(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EdgeConfig(**{field: 0})


def test_head_bound_leaves_room_for_the_request_line_and_separators() -> None:
    security = SecurityConfig()
    bound = head_bytes_bound(security.max_header_bytes, security.max_headers)
    assert bound == 32 * 1024 + 100 * 4 + 8 * 1024
    assert EdgeConfig().max_head_bytes == bound


def test_idle_timeout_outlives_the_clients_in_front_and_not_the_engines() -> None:
    # Clients and load balancers in front keep idle connections up to 60 s; the router's
    # own upstream client must close before vLLM's 5 s.
    assert DEFAULT_IDLE_TIMEOUT_S > 60
    assert KEEPALIVE_SECONDS < 5


def test_flags_fill_the_config() -> None:
    parser = argparse.ArgumentParser()
    _add_connection_flags(parser)
    args = parser.parse_args(["--header-timeout", "2", "--body-timeout", "3",
                              "--idle-timeout", "4", "--max-connections", "5"])
    config = _edge_config(args, SecurityConfig(max_header_bytes=1000, max_headers=10))
    assert config == EdgeConfig(header_timeout_s=2, body_timeout_s=3, idle_timeout_s=4,
                                max_connections=5, max_head_bytes=1000 + 40 + 8192)
    with pytest.raises(ValueError):
        _edge_config(parser.parse_args(["--max-connections", "0"]), SecurityConfig())


def test_fd_limit_is_raised_within_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        assert ensure_fd_limit(soft) == soft
        want = soft + 10 if hard == resource.RLIM_INFINITY else min(hard, soft + 10)
        assert ensure_fd_limit(soft + 10) == want
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == want
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
