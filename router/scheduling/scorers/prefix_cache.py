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

from router.scheduling.approx_index import ApproximatePrefixIndex
from router.scheduling.context import Candidates, PickContext
from router.scheduling.scorers.base import Scorer


def approximate_scores(
    ctx: PickContext, cands: Candidates, index: ApproximatePrefixIndex
) -> list[float]:
    """s_p = m_p / B (the module docstring); also what `precise-prefix-cache` falls back to."""
    hashes = ctx.prompt.approx_hashes()
    total = len(hashes)
    ctx.approx_hashes = total
    if not total:
        ctx.approx_depths = [0] * len(cands)
        return [0.0] * len(cands)
    depths = index.match(cands.keys, hashes)
    ctx.approx_depths = depths
    return [depth / total for depth in depths]


def record_approximate(
    ctx: PickContext, cands: Candidates, chosen: int, index: ApproximatePrefixIndex
) -> None:
    """The prompt's approximate blocks now (likely) sit in the chosen pod's cache."""
    hashes = ctx.prompt.approx_hashes()
    if hashes:
        index.record(cands.keys[chosen], hashes)


class PrefixCacheScorer(Scorer):
    type_name = "prefix-cache"
    affinity = True

    def score(self, ctx: PickContext, cands: Candidates) -> list[float]:
        return approximate_scores(ctx, cands, self.deps.approx)

    def scale_s(self, ctx: PickContext, cands: Candidates) -> float:
        return ctx.prompt.token_count() * ctx.cost.prefill_s_per_token

    def picked(self, ctx: PickContext, cands: Candidates, index: int) -> None:
        record_approximate(ctx, cands, index, self.deps.approx)
