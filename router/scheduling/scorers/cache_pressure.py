"""`cache-pressure`: a pod that would evict less cached prefix to take the prompt is better.

    E_p = max(0, U_p + (B - m_p) - C_p) x t x e          (blocks evicted, in seconds)
    s_p = (E_max - E_p) / (E_max - E_min)                 (s_p = 1 for every pod when equal)

- B   = the prompt's approximate blocks, m_p = those pod p already holds (`prefix-cache`);
- U_p, C_p = blocks pod p's approximate index holds and its bound (`ApproximatePrefixIndex`,
        sized from the engine's KV capacity): a pod at its bound evicts one block, the
        least recently used, for every block a prompt adds;
- t   = tokens a block covers (`PromptInfo.tokens_per_approx_block`, as `prefix-cache`);
- e   = seconds to get an evicted token back: the prefill curve's cost per token, or the
        pull from the server's shared KV pool when it has one and that is faster.

ttft scale: E_max - E_min, so w x scale x (1 - s_p) = E_p - E_min: the recompute a pick
causes beyond the least any candidate causes. A cold prompt on pods that are all full
costs every candidate the same (no preference); a warm prompt costs its own pod only its
tail and any other pod the whole prompt's worth of someone else's cache. That is what
the other scorers do not see: moving a warm prompt to an idle pod to save a queue wait
leaves it cached twice, and the copy's evictions come back as misses of other prompts
(benchmarks/HISTORY.md, "Shared-prefix: a group kept on two pods").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.scheduling.context import Candidates, PickContext, SchedulerDeps
from router.scheduling.scorers.base import Scorer


class CachePressureScorer(Scorer):
    type_name = "cache-pressure"

    def __init__(self, weight: float, deps: SchedulerDeps, params: Mapping[str, Any]) -> None:
        super().__init__(weight, deps, params)
        #: E_max - E_min of the last `score` (a pick runs score then scale_s, no await).
        self._span_s = 0.0

    def score(self, ctx: PickContext, cands: Candidates) -> list[float]:
        self._span_s = 0.0
        hashes = ctx.prompt.approx_hashes()
        total = len(hashes)
        if not total:
            return [1.0] * len(cands.keys)
        approx = self.deps.approx
        depths = ctx.approx_depths
        if depths is None or len(depths) != len(cands.keys):
            depths = approx.match(cands.keys, hashes)
        evicted = approx.overflow(cands.keys, total, depths)
        low, high = min(evicted), max(evicted)
        if high == low:  # the common case: no pod at its bound, or all evict as much
            return [1.0] * len(evicted)
        per_block = ctx.prompt.tokens_per_approx_block()
        per_token = ctx.fit.coefficients.b
        costs = ctx.server_costs
        if costs.pool.enabled:
            per_token = min(per_token, costs.pull_s_per_token)
        self._span_s = (high - low) * per_block * per_token
        span = float(high - low)
        return [(high - e) / span for e in evicted]

    def scale_s(self, ctx: PickContext, cands: Candidates) -> float:
        return self._span_s
