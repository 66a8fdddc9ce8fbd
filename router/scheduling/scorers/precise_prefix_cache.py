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

Fallback: for a ModelServer whose tokens cannot be trusted (no tokenizer, one that failed
to load or is loading, or a failed parity check against the engine's `/tokenize`:
`router.scheduling.fallback`), the score is the approximate `prefix-cache` score
(m_p / B over the approximate index) and the chosen pod is recorded there, so that server
keeps cache-aware routing; `pdgate_precise_fallback` says which servers and why.
"""

from __future__ import annotations

from typing import ClassVar

from router.scheduling.context import Candidates, PickContext
from router.scheduling.kv_events import scope_of
from router.scheduling.scorers.base import Param, Scorer
from router.scheduling.scorers.prefix_cache import approximate_scores, record_approximate


class PrecisePrefixCacheScorer(Scorer):
    type_name = "precise-prefix-cache"
    affinity = True
    PARAMS: ClassVar = {"storeHitFactor": Param(float, 0.7, 0.0, 1.0)}

    def _fallen_back(self, ctx: PickContext) -> bool:
        fallback = self.deps.fallback
        return fallback is not None and fallback.reason(ctx.server.server) is not None

    def score(self, ctx: PickContext, cands: Candidates) -> list[float]:
        if self._fallen_back(ctx):
            return approximate_scores(ctx, cands, self.deps.approx)
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

    def picked(self, ctx: PickContext, cands: Candidates, index: int) -> None:
        if self._fallen_back(ctx):
            record_approximate(ctx, cands, index, self.deps.approx)
