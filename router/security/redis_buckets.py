"""Token buckets in Redis: one limit shared by every router replica (`rateLimit.global`).

The same bucket arithmetic as `buckets.py`, done atomically by one Lua script per call, on
Redis's clock (replicas' clocks may disagree). A bucket is a hash `{tokens, ts, cap}` that
expires once it would have refilled anyway. Clients are kept per address, each with a
bounded blocking connection pool and short timeouts: the caller decides what a Redis
failure means (the rate limiter lets the request through and counts the error).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import redis.asyncio as aioredis

#: Bound on Redis clients (one per distinct `global.redis.address`).
MAX_REDIS_CLIENTS = 16
#: Bound on connections per Redis address.
MAX_REDIS_CONNECTIONS = 64
KEY_PREFIX = "pdgate:ratelimit:"

# ARGV: rate (tokens/s), capacity, n, mode ("take" | "credit" | "charge"). Returns the wait
# in seconds as a string (0 = allowed); Lua numbers would be truncated to integers.
_SCRIPT = """
local rate = tonumber(ARGV[1])
local cap = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local mode = ARGV[4]
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts', 'cap')
local tokens = tonumber(state[1])
local ts = tonumber(state[2])
local oldcap = tonumber(state[3])
if tokens == nil or ts == nil or oldcap == nil then
  tokens = cap
  ts = now
  oldcap = cap
end
if oldcap ~= cap then
  tokens = cap - (oldcap - tokens)
end
if now > ts then
  tokens = math.min(cap, tokens + (now - ts) * rate)
end
local wait = 0
if mode == 'take' then
  if tokens >= n then tokens = tokens - n else wait = (n - tokens) / rate end
elseif mode == 'credit' then
  if tokens <= 0 then wait = (1 - tokens) / rate end
else
  tokens = tokens - n
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now), 'cap', tostring(cap))
redis.call('PEXPIRE', KEYS[1], math.ceil(cap / rate * 1000) + 60000)
return tostring(wait)
"""


class RedisBuckets:
    """Buckets in the Redis server at each address (see the module docstring)."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._clients: dict[str, tuple[aioredis.Redis, Any]] = {}
        self._closing: set[asyncio.Task[None]] = set()  # at most MAX_REDIS_CLIENTS evictions

    def _client(self, address: str) -> tuple[aioredis.Redis, Any]:
        entry = self._clients.get(address)
        if entry is None:
            if len(self._clients) >= MAX_REDIS_CLIENTS:
                old, _ = self._clients.pop(next(iter(self._clients)))
                task = asyncio.get_running_loop().create_task(old.aclose())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
            host, _, port = address.rpartition(":")
            pool = aioredis.BlockingConnectionPool(
                host=host.strip("[]") or address,
                port=int(port) if port.isdecimal() else 6379,
                max_connections=MAX_REDIS_CONNECTIONS,
                timeout=self._timeout_s,
                socket_timeout=self._timeout_s,
                socket_connect_timeout=self._timeout_s,
            )
            client = aioredis.Redis(connection_pool=pool)
            entry = self._clients[address] = (client, client.register_script(_SCRIPT))
        return entry

    async def _call(self, address: str, key: str, rate: float, capacity: float, n: float,
                    mode: str) -> float:
        _, script = self._client(address)
        result = await script(keys=[KEY_PREFIX + key], args=[repr(rate), repr(capacity),
                                                             repr(n), mode])
        wait = float(result.decode() if isinstance(result, bytes) else result)
        return 0.0 if math.isnan(wait) else wait

    async def take(self, address: str, key: str, rate: float, capacity: float, n: float
                   ) -> float:
        return await self._call(address, key, rate, capacity, n, "take")

    async def credit_wait(self, address: str, key: str, rate: float, capacity: float) -> float:
        return await self._call(address, key, rate, capacity, 0, "credit")

    async def charge(self, address: str, key: str, rate: float, capacity: float, n: float
                     ) -> None:
        await self._call(address, key, rate, capacity, n, "charge")

    async def close(self) -> None:
        clients, self._clients = self._clients, {}
        for client, _ in clients.values():
            await client.aclose()
