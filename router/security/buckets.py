"""Token buckets in this process: the local backend of token rate limiting.

A bucket holds up to `capacity` tokens and refills at `rate` tokens a second. `take`
removes tokens only when all are there; `charge` removes them regardless (the bucket may go
into debt: output tokens are charged after the fact); `credit_wait` says how long until the
bucket is out of debt. A changed limit keeps what was already spent, so lowering a limit
cannot hand out a fresh burst and raising one frees room at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: Bound on local buckets (two per rate-limited route).
MAX_LOCAL_BUCKETS = 4096


class TokenBucket:
    __slots__ = ("capacity", "rate", "stamp", "tokens")

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self.tokens = capacity
        self.stamp = now

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now

    def reshape(self, rate: float, capacity: float, now: float) -> None:
        """Apply a changed limit, keeping the tokens already spent."""
        self._refill(now)
        spent = self.capacity - self.tokens
        self.rate = rate
        self.capacity = capacity
        self.tokens = capacity - spent

    def take(self, n: float, now: float) -> float:
        """Remove `n` tokens and return 0, or return the seconds until they are there."""
        self._refill(now)
        if self.tokens >= n:
            self.tokens -= n
            return 0.0
        return (n - self.tokens) / self.rate

    def credit_wait(self, now: float) -> float:
        """0 while the bucket holds tokens, else the seconds until it does."""
        self._refill(now)
        return 0.0 if self.tokens > 0 else (1.0 - self.tokens) / self.rate

    def charge(self, n: float, now: float) -> None:
        self._refill(now)
        self.tokens -= n


class LocalBuckets:
    """Buckets by key; `limit` is (rate, capacity) and may change between calls."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}

    def __len__(self) -> int:
        return len(self._buckets)

    def _bucket(self, key: str, rate: float, capacity: float, now: float) -> TokenBucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= MAX_LOCAL_BUCKETS:
                self._buckets.pop(next(iter(self._buckets)))
            bucket = self._buckets[key] = TokenBucket(rate, capacity, now)
        elif bucket.rate != rate or bucket.capacity != capacity:
            bucket.reshape(rate, capacity, now)
        return bucket

    def take(self, key: str, rate: float, capacity: float, n: float) -> float:
        now = self._clock()
        return self._bucket(key, rate, capacity, now).take(n, now)

    def credit_wait(self, key: str, rate: float, capacity: float) -> float:
        now = self._clock()
        return self._bucket(key, rate, capacity, now).credit_wait(now)

    def charge(self, key: str, rate: float, capacity: float, n: float) -> None:
        now = self._clock()
        self._bucket(key, rate, capacity, now).charge(n, now)

    def retain(self, keys: set[str]) -> None:
        """Forget buckets whose key is not in `keys` (routes removed or unlimited)."""
        for key in [k for k in self._buckets if k not in keys]:
            del self._buckets[key]
