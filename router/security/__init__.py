"""The security layer one router holds: API keys, token rate limits, request limits.

`Security` is built once by `AppState`; its `run()` is the background work (API key
reloads) and `close()` releases the Redis clients.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from router.security.api_keys import APIKeys
from router.security.config import SecurityConfig
from router.security.ratelimit import TokenRateLimiter
from router.view import ClusterView


class Security:
    def __init__(
        self, config: SecurityConfig, view: ClusterView, registry: CollectorRegistry | None = None
    ) -> None:
        self.config = config
        self.api_keys = (
            APIKeys(config.api_keys, config.api_keys_reload_s, registry)
            if config.api_keys is not None else None
        )
        self.rate_limiter = TokenRateLimiter(config.redis_timeout_s, registry)
        view.subscribe(self.rate_limiter.on_snapshot)

    async def run(self) -> None:
        """Reload API keys as they change (returns at once when there are none)."""
        if self.api_keys is not None:
            await self.api_keys.run()

    async def close(self) -> None:
        await self.rate_limiter.close()


__all__ = ["APIKeys", "Security", "SecurityConfig", "TokenRateLimiter"]
