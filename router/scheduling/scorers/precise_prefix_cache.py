"""`precise-prefix-cache`: how much of the prompt the engine itself says a pod holds.

    s_p = (L_p + f x (R_p - L_p)) / B

- B   = the prompt's engine blocks (`block_hash.PreciseHasher`: the engine's tokens, keyed
        in the ModelServer's key space: vLLM's block hashes or token keys, see
        `router.kvhash.keyspace`);
- L_p = leading blocks pod p holds itself (GPU, or a local offload medium such as CPU),
        from its KV events (`PrecisePrefixIndex`);
- R_p = leading blocks pod p holds itself OR finds in the shared store pool of the
        ModelServer (blocks a pod published with a store medium, e.g. MOONCAKE): any
        prefill pod can load those (Mooncake Store awareness);
- f   = `storeHitFactor` (default 0.7, in [0, 1]): a store hit saves the prefill compute
        but costs the transfer from the store, so it is worth less than a local hit;
- B = 0: s_p = 0 for every pod.

ttft scale: T x `prefill_s_per_token` (T = the prompt's tokens, exact here), so the
weighted shortfall is the prefill time of the uncached part, store hits charged (1 - f).
"""

from __future__ import annotations

from typing import ClassVar

from router.scheduling.context import Candidates, PickContext
from router.scheduling.kv_events import scope_of
from router.scheduling.scorers.base import Param, Scorer


class PrecisePrefixCacheScorer(Scorer):
    type_name = "precise-prefix-cache"
    affinity = True
    PARAMS: ClassVar = {"storeHitFactor": Param(float, 0.7, 0.0, 1.0)}

    def score(self, ctx: PickContext, cands: Candidates) -> list[float]:
        scope = scope_of(ctx.server)
        hashes = ctx.prompt.precise_hashes(self.deps.precise.space(scope))
        total = len(hashes)
        factor: float = self.params["storeHitFactor"]
        ctx.precise_hashes = total
        ctx.store_factor = factor
        if not total:
            zeros = [0] * len(cands)
            ctx.precise_local, ctx.precise_reach = zeros, zeros
            return [0.0] * len(cands)
        local, reach = self.deps.precise.match(cands.keys, scope, hashes)
        ctx.precise_local, ctx.precise_reach = local, reach
        return [
            (held + factor * (both - held)) / total for held, both in zip(local, reach, strict=True)
        ]

    def scale_s(self, ctx: PickContext, cands: Candidates) -> float:
        return ctx.prompt.token_count() * ctx.cost.prefill_s_per_token
