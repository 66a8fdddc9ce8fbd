"""`prefix-cache`: how much of the prompt the approximate index says a pod already holds.

    ttft unit:   cost_p = min(P(T - L_p), P(T - R_p) + (R_p - L_p) x pull)  - P(0)
    score unit:  s_p = (m_p + f x (r_p - m_p)) / B

- B   = the prompt's approximate blocks (`block_hash.approximate_block_hashes`; full
        blocks of `blockBytes` rendered bytes, at most `maxPromptBlocks`);
- m_p = leading blocks of the prompt recorded for pod p (`ApproximatePrefixIndex`);
- r_p = max(m_p, leading blocks in the server's shared KV pool), when the ModelServer
        declares one (`pool_view.py`: its prefill writes every block to Mooncake Store,
        so any prefill pod can load what any other computed); else m_p;
- T, L_p, R_p = the same in tokens (T estimated from the prompt's length; a block holds
        T x `blockBytes` / rendered bytes tokens, so a full match leaves the tail);
- P   = the server's prefill curve (`ttft_model.py`, calibrated from measured prefills),
        pull = seconds to load one token of KV from the pool (`ServerCosts`): Mooncake's
        Conductor cost, the pool pays only when pulling beats recomputing;
- f   = `storeHitFactor` (default 0.7): score unit, the weight of a pool hit; ttft unit,
        0 turns the pool credit off, any other value lets the Conductor cost decide;
- B = 0 (a prompt shorter than one block): s_p = 0 for every pod (no preference).

ttft scale: P(T) - P(0), so w x scale x (1 - s_p) = cost_p.

When the request is dispatched, the prompt's blocks are recorded for the chosen pod
(`picked`), and in the server's pool view when it has a pool: the index learns from the
router's own decisions.
"""

from __future__ import annotations

from typing import ClassVar

from router.scheduling.context import Candidates, PickContext, SchedulerDeps
from router.scheduling.scorers.base import Param, Scorer


def approximate_scores(
    ctx: PickContext, cands: Candidates, deps: SchedulerDeps, factor: float
) -> list[float]:
    """The module docstring's score per candidate (`factor` = f); also what
    `precise-prefix-cache` scores with for a server it falls back on."""
    hashes = ctx.prompt.approx_hashes()
    total = len(hashes)
    ctx.approx_hashes = total
    if not total:
        ctx.approx_depths = [0] * len(cands)
        ctx.compute_tokens = None
        return [0.0] * len(cands)
    depths = deps.approx.match(cands.keys, hashes)
    ctx.approx_depths = depths
    costs = ctx.server_costs
    pooled = deps.pools.depth(costs.scope, hashes) if costs.pool.enabled and factor else 0
    if not ctx.ttft_unit:
        return [(d + factor * max(0, pooled - d)) / total for d in depths]
    tokens = float(ctx.prompt.token_count())
    # A full match still leaves the prompt's tail (the bytes after its last full block) to
    # compute, so a hit is never counted as free.
    per_block = ctx.prompt.tokens_per_approx_block()
    local = [d * per_block for d in depths]
    reach = [max(d, pooled) * per_block for d in depths] if pooled else local
    return ctx.prefix_scores(tokens, local, reach)


def record_approximate(
    ctx: PickContext, cands: Candidates, chosen: int, deps: SchedulerDeps
) -> None:
    """The prompt's approximate blocks now (likely) sit in the chosen pod's cache, and in
    the server's pool (from the prefill's predicted end) when it has one."""
    hashes = ctx.prompt.approx_hashes()
    if not hashes:
        return
    approx = deps.approx
    approx.record(cands.keys[chosen], hashes, ctx.request.counted)
    pool = ctx.server_costs.pool
    if pool.enabled:
        per_block = approx.block_bytes / max(approx.chars_per_token, 1e-9)
        pools, scope = deps.pools, ctx.server_costs.scope
        blocks = pool.capacity_blocks(per_block)
        deps.pending.defer(ctx.ready_at, lambda: pools.record(scope, hashes, blocks),
                           len(hashes))


def approximate_scale_s(ctx: PickContext) -> float:
    """What a score of 0 costs (ttft unit): P(T) - P(0) when the Conductor cost ran."""
    if ctx.compute_tokens is not None:
        return ctx.prefix_scale_s
    return ctx.prompt.token_count() * ctx.cost.prefill_s_per_token


class PrefixCacheScorer(Scorer):
    type_name = "prefix-cache"
    affinity = True
    PARAMS: ClassVar = {"storeHitFactor": Param(float, 0.7, 0.0, 1.0)}

    def score(self, ctx: PickContext, cands: Candidates) -> list[float]:
        return approximate_scores(ctx, cands, self.deps, self.params["storeHitFactor"])

    def scale_s(self, ctx: PickContext, cands: Candidates) -> float:
        return approximate_scale_s(ctx)

    def picked(self, ctx: PickContext, cands: Candidates, index: int) -> None:
        record_approximate(ctx, cands, index, self.deps)
