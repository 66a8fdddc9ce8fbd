"""Token rate limiting per ModelRoute `rateLimit`, as Kthena's router does it.

Before a request goes upstream: if the route limits output tokens, its output bucket must
not be in debt; if it limits input tokens, the prompt's estimated tokens are taken from the
input bucket. Either failing is a 429 with `Retry-After`. After the answer, the output
tokens the engine reports (`usage.completion_tokens`) are charged, which may put the bucket
into debt until it refills. A bucket holds one unit's worth (`*TokensPerUnit`) and refills
evenly over the unit (a month counts 30 days).

The limit is read from the route on every request, so a removed or changed `rateLimit`
takes effect at once (a changed limit keeps what was already spent). Buckets live in this
process unless the route names `global.redis.address`; then they live in Redis and every
replica shares them. When Redis cannot be reached the request goes through (counted in
`pdgate_ratelimit_backend_errors_total`): rate limiting protects capacity, it must not
take the API down with it.

Prompt tokens are the ModelServer's own token count when it names a tokenizer
(`pdgate.io/tokenizer`): the proxy tokenizes the request once before admission
(`ParsedRequest.prompt_tokens`) and the scheduler reuses those ids. Without a tokenizer
(or for a body it cannot tokenize) they are estimated: UTF-8 characters of the prompt
text over `CHARS_PER_TOKEN`, at least one. Routes without a `rateLimit` cost one
attribute test.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter
from redis.exceptions import RedisError

from router.errors import APIError
from router.request import CHAT_PATH, ParsedRequest
from router.resources import ModelRoute, RateLimit
from router.security.buckets import LocalBuckets
from router.security.redis_buckets import RedisBuckets
from router.view import Snapshot

log = logging.getLogger("pdgate.ratelimit")

UNIT_SECONDS: Final = {
    "second": 1.0, "minute": 60.0, "hour": 3600.0, "day": 86400.0, "month": 30 * 86400.0,
}
CHARS_PER_TOKEN: Final = 4
#: Bound on Redis output charges still running (more are dropped and counted).
MAX_PENDING_CHARGES: Final = 1024
#: At most one "Redis unreachable" log line per this many seconds.
ERROR_LOG_INTERVAL_S: Final = 30.0


def rate_limited(kind: str, wait_s: float, message: str | None = None) -> APIError:
    return APIError(
        429, message or f"{kind} token rate limit exceeded",
        type="tokens", code="rate_limit_exceeded",
        headers={"retry-after": str(max(1, math.ceil(wait_s)))},
    )


def estimate_prompt_tokens(parsed: ParsedRequest) -> int:
    """The tokenizer's count when known, else characters of prompt text / CHARS_PER_TOKEN
    (token-id prompts count exactly)."""
    if parsed.prompt_tokens is not None:
        return max(1, parsed.prompt_tokens)
    body = parsed.body
    chars = 0
    if parsed.path == CHAT_PATH:
        for message in body.get("messages") or ():
            chars += _text_chars(message.get("content") if isinstance(message, dict) else None)
    else:
        prompt = body.get("prompt", body.get("input"))  # input: embeddings, responses
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return len(prompt)
        chars = _text_chars(prompt)
    return max(1, -(-chars // CHARS_PER_TOKEN))


def _text_chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        total = 0
        for part in value:
            if isinstance(part, str):
                total += len(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                total += len(part["text"])
        return total
    return 0


def route_key(route: ModelRoute) -> str:
    return f"{route.meta.namespace}/{route.meta.name}"


class TokenRateLimiter:
    """Admission by token budget and output charging (see the module docstring)."""

    def __init__(
        self,
        redis_timeout_s: float = 0.25,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.local = LocalBuckets(clock)
        self.redis = RedisBuckets(redis_timeout_s)
        self._clock = clock
        self._last_error_log = -math.inf
        self._pending: set[asyncio.Task[None]] = set()
        self._limited: Counter | None = None
        self._errors: Counter | None = None
        if registry is not None:
            self._limited = Counter(
                "pdgate_rate_limited", "Requests refused by token rate limits, by token kind.",
                ["kind"], registry=registry,
            )
            self._errors = Counter(
                "pdgate_ratelimit_backend_errors",
                "Rate-limit calls to Redis that failed (the request went through).",
                registry=registry,
            )

    async def admit(self, route: ModelRoute, parsed: ParsedRequest) -> None:
        """Raise a 429 `APIError` when the route's budget cannot take this request."""
        limit = route.rate_limit
        if limit is None:
            return
        key = route_key(route)
        unit = UNIT_SECONDS[limit.unit]
        if limit.output_tokens_per_unit:
            capacity = float(limit.output_tokens_per_unit)
            wait = await self._run(limit, "credit", key + ":out", capacity / unit, capacity, 0)
            if wait > 0:
                raise self._refuse("output", wait)
        if limit.input_tokens_per_unit:
            capacity = float(limit.input_tokens_per_unit)
            tokens = estimate_prompt_tokens(parsed)
            if tokens > capacity:
                raise self._refuse("input", unit, (
                    f"input token rate limit exceeded: the prompt's ~{tokens} tokens exceed "
                    f"the limit of {limit.input_tokens_per_unit} per {limit.unit}"))
            wait = await self._run(limit, "take", key + ":in", capacity / unit, capacity, tokens)
            if wait > 0:
                raise self._refuse("input", wait)

    def settle_output(self, route: ModelRoute, tokens: int) -> None:
        """Charge an answer's output tokens without waiting (safe in a `finally`).

        Local buckets are charged at once; a Redis charge runs as a task of its own so a
        request that ends (or is cancelled) never waits on Redis for it.
        """
        limit = route.rate_limit
        if limit is None or not limit.output_tokens_per_unit or tokens <= 0:
            return
        if limit.redis_address is None:
            capacity = float(limit.output_tokens_per_unit)
            self.local.charge(route_key(route) + ":out", capacity / UNIT_SECONDS[limit.unit],
                              capacity, tokens)
            return
        if len(self._pending) >= MAX_PENDING_CHARGES:
            self._backend_error(OverflowError("too many pending charges"))
            return
        task = asyncio.get_running_loop().create_task(self.charge_output(route, tokens))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def charge_output(self, route: ModelRoute, tokens: int) -> None:
        """Charge the output tokens an answer really used."""
        limit = route.rate_limit
        if limit is None or not limit.output_tokens_per_unit or tokens <= 0:
            return
        capacity = float(limit.output_tokens_per_unit)
        rate = capacity / UNIT_SECONDS[limit.unit]
        await self._run(limit, "charge", route_key(route) + ":out", rate, capacity, tokens)

    async def _run(self, limit: RateLimit, mode: str, key: str, rate: float, capacity: float,
                   n: float) -> float:
        address = limit.redis_address
        if address is None:
            local = self.local
            if mode == "take":
                return local.take(key, rate, capacity, n)
            if mode == "credit":
                return local.credit_wait(key, rate, capacity)
            local.charge(key, rate, capacity, n)
            return 0.0
        try:
            if mode == "take":
                return await self.redis.take(address, key, rate, capacity, n)
            if mode == "credit":
                return await self.redis.credit_wait(address, key, rate, capacity)
            await self.redis.charge(address, key, rate, capacity, n)
        except (RedisError, OSError, TimeoutError, ValueError) as exc:
            self._backend_error(exc)
        return 0.0

    def _refuse(self, kind: str, wait_s: float, message: str | None = None) -> APIError:
        if self._limited is not None:
            self._limited.labels(kind=kind).inc()
        return rate_limited(kind, wait_s, message)

    def _backend_error(self, exc: Exception) -> None:
        if self._errors is not None:
            self._errors.inc()
        now = self._clock()
        if now - self._last_error_log >= ERROR_LOG_INTERVAL_S:
            self._last_error_log = now
            log.error("rate limit backend unavailable, letting requests through: %s",
                      type(exc).__name__)

    def on_snapshot(self, snapshot: Snapshot) -> None:
        """Forget local buckets of routes that are gone or no longer limited."""
        keep: set[str] = set()
        for route in snapshot.routes_by_model.values():
            if route.rate_limit is not None:
                key = route_key(route)
                keep.update((key + ":in", key + ":out"))
        self.local.retain(keep)

    async def close(self) -> None:
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=1.0)
        await self.redis.close()
