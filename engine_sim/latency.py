"""How long simulated work takes: a few flags that shape TTFT and inter-token latency.

Prefill grows with the tokens the prefix cache (or the KV store) did not supply, and a
pod computes one prompt's tokens at a time (`compute.ComputeLine`); decode slows as the
running batch grows. `--fast` zeroes everything so that tests and
router-overhead benchmarks measure the router, not the engine. Sleeps are asyncio sleeps.

Moving KV (a prefix loaded from the Mooncake Store, a prefill-to-decode transfer) costs
simulated time from the hardware, not from the simulator's own CPU: tokens x
`kv_bytes_per_token` / `kv_bandwidth_bytes_per_s`. The bytes the simulator really puts in
the store are only proof that the right blocks moved (`--kv-block-bytes`, small), so the
CPU spent copying them is not what a benchmark measures.

`kv_bytes_per_token` depends on the model. The default, 70,272 bytes, is DeepSeek-V3's and
Kimi K2's (the model behind Mooncake's traces): both use multi-head latent attention with
61 layers, each caching one latent of `kv_lora_rank` 512 plus `qk_rope_head_dim` 64
values per token, in bf16: 61 x 576 x 2. (A GQA model caches 2 x layers x kv_heads x
head_dim x 2 bytes instead: Llama-3-70B, 80 x 8 x 128 x 4 = 327,680.) The default
bandwidth, 12.5 GB/s, is one 100 Gb/s RDMA NIC; Mooncake's prefill nodes have several.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Final

#: DeepSeek-V3 / Kimi K2 (MLA) KV bytes per token: 61 layers x (512 + 64) x 2 bytes.
MLA_KV_BYTES_PER_TOKEN: Final = 61 * (512 + 64) * 2
#: One 100 Gb/s RDMA NIC, in bytes per second.
DEFAULT_KV_BANDWIDTH_BYTES_PER_S: Final = 12.5e9


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """Durations in seconds."""

    prefill_overhead_s: float = 0.005
    prefill_per_token_s: float = 0.0001
    itl_base_s: float = 0.010
    itl_per_running_s: float = 0.0002
    kv_bytes_per_token: int = MLA_KV_BYTES_PER_TOKEN
    kv_bandwidth_bytes_per_s: float = DEFAULT_KV_BANDWIDTH_BYTES_PER_S

    @classmethod
    def fast(cls) -> LatencyModel:
        """No simulated time at all."""
        return cls(0.0, 0.0, 0.0, 0.0, 0, DEFAULT_KV_BANDWIDTH_BYTES_PER_S)

    def kv_transfer_seconds(self, tokens: int) -> float:
        """Moving `tokens` tokens of KV over the network: bytes / bandwidth."""
        if tokens <= 0 or self.kv_bandwidth_bytes_per_s <= 0:
            return 0.0
        return tokens * self.kv_bytes_per_token / self.kv_bandwidth_bytes_per_s

    def compute_seconds(self, uncached_tokens: int) -> float:
        """uncached tokens x per-token cost: the part of a prefill that holds the pod's
        compute (`compute.ComputeLine`); on an idle pod a prefill takes this plus
        `prefill_overhead_s`."""
        return max(0, uncached_tokens) * self.prefill_per_token_s

    def inter_token_seconds(self, running: int) -> float:
        """base + per-running-request growth x running batch."""
        return self.itl_base_s + max(0, running) * self.itl_per_running_s


async def pause(seconds: float) -> None:
    """Sleep without blocking the loop; skip the loop round-trip when there is nothing to wait."""
    if seconds > 0:
        await asyncio.sleep(seconds)
