"""How long simulated work takes: a few flags that shape TTFT and inter-token latency.

Prefill grows with the tokens the prefix cache (or the KV store) did not supply; decode
slows as the running batch grows. `--fast` zeroes everything so that tests and
router-overhead benchmarks measure the router, not the engine. Sleeps are asyncio sleeps.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """Durations in seconds."""

    prefill_overhead_s: float = 0.005
    prefill_per_token_s: float = 0.0001
    itl_base_s: float = 0.010
    itl_per_running_s: float = 0.0002

    @classmethod
    def fast(cls) -> LatencyModel:
        """No simulated time at all."""
        return cls(0.0, 0.0, 0.0, 0.0)

    def prefill_seconds(self, uncached_tokens: int) -> float:
        """overhead + uncached tokens x per-token cost."""
        return self.prefill_overhead_s + max(0, uncached_tokens) * self.prefill_per_token_s

    def inter_token_seconds(self, running: int) -> float:
        """base + per-running-request growth x running batch."""
        return self.itl_base_s + max(0, running) * self.itl_per_running_s


async def pause(seconds: float) -> None:
    """Sleep without blocking the loop; skip the loop round-trip when there is nothing to wait."""
    if seconds > 0:
        await asyncio.sleep(seconds)
