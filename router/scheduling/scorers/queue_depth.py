"""`queue`: a shorter engine waiting queue is better.

    s_p = 1 - min(q_p, Q) / Q

- q_p = the engine's waiting requests (`vllm:num_requests_waiting`,
        `sglang:num_queue_reqs`) from the latest fresh scrape;
- Q   = `threshold` (default 32): a queue this long or longer scores 0;
- q_p unknown (no fresh scrape): s_p = the mean score of the candidates whose queue is
  known (1 if none is), so a pod is neither favoured nor punished for a missed scrape.

ttft scale: Q x r (r: see `least-request`), so w x scale x (1 - s_p) = min(q_p, Q) x r.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from router.scheduling.context import Candidates, EngineMemo, PickContext, SchedulerDeps
from router.scheduling.scorers.base import Param, Scorer, fill_unknown


class QueueScorer(Scorer):
    type_name = "queue"
    PARAMS: ClassVar = {"threshold": Param(float, 32.0, 1.0)}

    def __init__(self, weight: float, deps: SchedulerDeps, params: Mapping[str, Any]) -> None:
        super().__init__(weight, deps, params)
        self._memo: EngineMemo[list[float]] = EngineMemo()  # per scrape, not per decision

    def score(self, ctx: PickContext, cands: Candidates) -> list[float]:
        known = self._memo.get(cands.engine)
        if known is not None:
            return known
        limit: float = self.params["threshold"]
        scores: list[float | None] = [
            None
            if e is None or e.waiting is None
            else (0.0 if e.waiting >= limit else 1.0 - e.waiting / limit)
            for e in cands.engine
        ]
        return self._memo.put(cands.engine, fill_unknown(scores))

    def scale_s(self, ctx: PickContext, cands: Candidates) -> float:
        limit: float = self.params["threshold"]
        return limit * ctx.per_request_s()
