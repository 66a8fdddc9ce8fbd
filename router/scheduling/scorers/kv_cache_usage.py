"""`kv-cache-usage`: more free KV cache (headroom) is better.

    s_p = 1 - u_p

- u_p = the engine's KV cache usage in [0, 1] (`vllm:kv_cache_usage_perc`, older
        `vllm:gpu_cache_usage_perc`, `sglang:token_usage`) from the latest fresh scrape;
- u_p unknown: s_p = the mean score of the candidates whose usage is known (1 if none).

ttft scale: `kv_full_penalty_s`: a full cache stalls admission (or preempts), costing
about that much; w x scale x (1 - s_p) = u_p x kv_full_penalty_s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.scheduling.context import Candidates, EngineMemo, PickContext, SchedulerDeps
from router.scheduling.scorers.base import Scorer, fill_unknown


class KVCacheUsageScorer(Scorer):
    type_name = "kv-cache-usage"

    def __init__(self, weight: float, deps: SchedulerDeps, params: Mapping[str, Any]) -> None:
        super().__init__(weight, deps, params)
        self._memo: EngineMemo[list[float]] = EngineMemo()  # per scrape, not per decision

    def score(self, ctx: PickContext, cands: Candidates) -> list[float]:
        known = self._memo.get(cands.engine)
        if known is not None:
            return known
        # Usage is clamped to [0, 1] when scraped.
        scores: list[float | None] = [
            None if e is None or e.kv_usage is None else 1.0 - e.kv_usage for e in cands.engine
        ]
        return self._memo.put(cands.engine, fill_unknown(scores))

    def scale_s(self, ctx: PickContext, cands: Candidates) -> float:
        return ctx.cost.kv_full_penalty_s
