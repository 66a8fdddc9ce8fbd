"""`prefix-cache`: how much of the prompt the approximate index says a pod already holds.

    s_p = m_p / B

- B   = the prompt's approximate blocks (`block_hash.approximate_block_hashes`; full
        blocks of `blockBytes` rendered bytes, at most `maxPromptBlocks`);
- m_p = leading blocks of the prompt recorded for pod p (`ApproximatePrefixIndex`);
- B = 0 (a prompt shorter than one block): s_p = 0 for every pod (no preference).

ttft scale: T x `prefill_s_per_token`, T = the prompt's tokens (estimated from its
length), so w x scale x (1 - s_p) is the prefill time of the uncached part.

When the request is dispatched, the prompt's blocks are recorded for the chosen pod
(`picked`): the index learns from the router's own decisions.
"""

from __future__ import annotations

from router.scheduling.context import Candidates, PickContext
from router.scheduling.scorers.base import Scorer


class PrefixCacheScorer(Scorer):
    type_name = "prefix-cache"
    affinity = True

    def score(self, ctx: PickContext, cands: Candidates) -> list[float]:
        hashes = ctx.prompt.approx_hashes()
        total = len(hashes)
        ctx.approx_hashes = total
        if not total:
            ctx.approx_depths = [0] * len(cands)
            return [0.0] * len(cands)
        depths = self.deps.approx.match(cands.keys, hashes)
        ctx.approx_depths = depths
        return [depth / total for depth in depths]

    def scale_s(self, ctx: PickContext, cands: Candidates) -> float:
        return ctx.prompt.token_count() * ctx.cost.prefill_s_per_token

    def picked(self, ctx: PickContext, cands: Candidates, index: int) -> None:
        hashes = ctx.prompt.approx_hashes()
        if hashes:
            self.deps.approx.record(cands.keys[index], hashes)
