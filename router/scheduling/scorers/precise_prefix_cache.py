"""`precise-prefix-cache`: how much of the prompt the engine itself says a pod holds.

    ttft unit:   cost_p = min(P(T - L_p), P(T - R_p) + (R_p - L_p) x pull)  - P(0)
    score unit:  s_p = (L_p + f x (R_p - L_p)) / B

- B   = the prompt's engine blocks (`block_hash.PreciseHasher`: the engine's tokens, keyed
        in the ModelServer's key space: vLLM's block hashes or token keys, see
        `router.kvhash.keyspace`); keys are computed only up to the first block no pod and
        no pool holds (`PreciseHasher.leading_hashes`), the rest of B and T estimated;
- L_p = leading blocks pod p holds itself (GPU, or a local offload medium such as CPU),
        from its KV events (`PrecisePrefixIndex`);
- R_p = leading blocks pod p holds itself OR finds in the shared store pool of the
        ModelServer: blocks a pod published with a store medium (`cpu`: Mooncake Store), and,
        when the ModelServer declares a pool (`pool_view.py`) and its engines publish no
        store events, the blocks its prefill pods stored (their connector writes each to
        the store), so they are not blind;
- L_p also counts, until the engine's events for them arrive, the blocks a prompt the
        router sent to p shares with this one (`inflight_prefixes.py`): the engine
        publishes a block only once its prefill stored it;
- T   = the prompt's tokens; L_p, R_p in tokens are blocks x the block size;
- P, pull: the server's calibrated prefill curve and pool pull cost, as in `prefix-cache`
        (Mooncake's Conductor: the pool pays only when pulling beats recomputing);
- f   = `storeHitFactor` (default 0.7, in [0, 1]): score unit, the weight of a pool hit;
        ttft unit, 0 means the engines cannot read the pool (no credit), any other value
        lets the Conductor cost decide;
- B = 0: s_p = 0 for every pod.

ttft scale: P(T) - P(0), so w x scale x (1 - s_p) = cost_p.

Fallback: for a ModelServer whose tokens cannot be trusted (no tokenizer, one that failed
to load or is loading, or a failed parity check against the engine's `/tokenize`:
`router.scheduling.fallback`), the scorer is `prefix-cache` (approximate index, pool view
and Conductor cost alike) and the chosen pod is recorded there, so that server keeps
cache-aware routing; `pdgate_precise_fallback` says which servers and why.
"""

from __future__ import annotations

from typing import ClassVar

from router.kvhash.keyspace import KeySpace
from router.scheduling.context import Candidates, PickContext, SchedulerDeps
from router.scheduling.kv_events import scope_of
from router.scheduling.scorers.base import Param, Scorer
from router.scheduling.scorers.prefix_cache import (
    approximate_scale_s,
    approximate_scores,
    record_approximate,
)


def engine_block_size(space: KeySpace | None, deps: SchedulerDeps) -> int:
    """Tokens per engine block in a server's key space (`PrecisePrefixIndex.space`), the
    hasher's default before the server has one: what the precise blocks are counted in."""
    return space.block_size if space is not None else deps.hasher.space.block_size


class PrecisePrefixCacheScorer(Scorer):
    type_name = "precise-prefix-cache"
    affinity = True
    PARAMS: ClassVar = {"storeHitFactor": Param(float, 0.7, 0.0, 1.0)}

    def _fallen_back(self, ctx: PickContext) -> bool:
        return self.deps.precise_fallen_back(ctx.server.server)

    def score(self, ctx: PickContext, cands: Candidates) -> list[float]:
        if self._fallen_back(ctx):
            return approximate_scores(ctx, cands, self.deps, self.params["storeHitFactor"])
        scope = scope_of(ctx.server)
        precise = self.deps.precise
        space = precise.space(scope)
        hashes = ctx.prompt.leading_hashes(space, precise.known(scope))
        block = engine_block_size(space, self.deps)
        total = max(len(hashes), ctx.prompt.token_count() // block)
        factor: float = self.params["storeHitFactor"]
        ctx.precise_hashes = total
        ctx.store_factor = factor
        if not total:
            zeros = [0] * len(cands)
            ctx.precise_local, ctx.precise_reach = zeros, zeros
            ctx.precise_held = None
            ctx.compute_tokens = None
            return [0.0] * len(cands)
        local, reach = precise.match(cands.keys, scope, hashes)
        ctx.precise_local, ctx.precise_reach = local, reach
        soon = self._in_flight(ctx, cands, block, total)
        if soon is not None:
            local = [max(held, s) for held, s in zip(local, soon, strict=True)]
            reach = [max(both, held) for both, held in zip(reach, local, strict=True)]
        ctx.precise_held = local
        if not ctx.ttft_unit:
            return [
                (held + factor * (both - held)) / total
                for held, both in zip(local, reach, strict=True)
            ]
        size = float(block)
        if factor == 0:
            reach = local  # the engines cannot read the store: no pool credit at all
        return ctx.prefix_scores(
            float(ctx.prompt.token_count()), [n * size for n in local], [n * size for n in reach]
        )

    def _in_flight(
        self, ctx: PickContext, cands: Candidates, block: int, total: int
    ) -> list[int] | None:
        """Per candidate, the leading blocks of the prompt a prompt still on its way into
        that pod's cache will have stored (`inflight_prefixes.py`), in engine blocks."""
        depths = self.deps.inflight_prefixes.depths(
            cands.keys, ctx.prompt.approx_hashes(), ctx.now
        )
        if depths is None:
            return None
        per_block = ctx.prompt.tokens_per_approx_block() / block
        return [min(total, int(d * per_block)) for d in depths]

    def scale_s(self, ctx: PickContext, cands: Candidates) -> float:
        return approximate_scale_s(ctx)

    def picked(self, ctx: PickContext, cands: Candidates, index: int) -> None:
        # The precise index learns what the pods (and the pool, `pool_view.py`) hold from
        # the engines' own events; until they come, the prompt is in flight to the pod.
        if self._fallen_back(ctx):
            record_approximate(ctx, cands, index, self.deps)
            return
        self.deps.inflight_prefixes.record(
            cands.keys[index], ctx.prompt.approx_hashes(), ctx.ready_at, ctx.now,
            ctx.request.counted,
        )
