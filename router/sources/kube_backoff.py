"""Reconnect delays for the Kubernetes informers, shaped like client-go's.

client-go's reflector waits 800 ms after a failure, doubles up to 30 s, adds jitter so
that many routers restarted together do not hammer a recovering API server in step, and
starts again from 800 ms once nothing has failed for two minutes.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BackoffPolicy:
    initial_s: float = 0.8
    cap_s: float = 30.0
    factor: float = 2.0
    jitter: float = 0.2  # each delay is stretched by up to this fraction, then capped
    reset_after_s: float = 120.0  # healthy this long -> next failure starts from initial_s


class Backoff:
    """Hands out growing delays; forgets past failures after `reset_after_s` of quiet."""

    def __init__(
        self,
        policy: BackoffPolicy,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._policy = policy
        self._rng = rng or random.Random()
        self._clock = clock
        self._base = policy.initial_s
        self._last_failure: float | None = None

    def next_delay(self) -> float:
        """The delay before the next attempt, after one more failure."""
        now = self._clock()
        policy = self._policy
        if self._last_failure is not None and now - self._last_failure >= policy.reset_after_s:
            self._base = policy.initial_s
        self._last_failure = now
        delay = min(policy.cap_s, self._base * (1.0 + policy.jitter * self._rng.random()))
        self._base = min(policy.cap_s, self._base * policy.factor)
        return delay
