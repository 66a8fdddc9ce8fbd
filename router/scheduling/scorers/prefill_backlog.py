"""`prefill-backlog`: less prefill work queued on a pod is better (Conductor's queue time).

    s_p = (b_max - b_p) / b_max          (s_p = 1 for every pod when b_max = 0)

- b_p   = seconds of prefill the router has sent to pod p and predicts it has not done
          yet (`router.scheduling.backlog.PrefillBacklog`: each sequential-PD prefill's
          predicted service time, corrected when it ends);
- b_max = the largest b among the candidates.

ttft scale: b_max, so w x scale x (1 - s_p) = b_p: the predicted wait before pod p starts
this request's prefill. Unlike `least-request` (requests x the mean prefill), a pod busy
with one long prompt is not mistaken for a pod with one short one.
"""

from __future__ import annotations

from router.scheduling.context import Candidates, PickContext
from router.scheduling.scorers.base import Scorer


class PrefillBacklogScorer(Scorer):
    type_name = "prefill-backlog"

    def score(self, ctx: PickContext, cands: Candidates) -> list[float]:
        backlog, now = self.deps.backlog, ctx.now
        waits = [backlog.wait_s(key, now) for key in cands.keys]
        ctx.backlog_s = waits
        top = max(waits) if waits else 0.0
        if top <= 0.0:
            return [1.0] * len(waits)
        return [(top - b) / top for b in waits]

    def scale_s(self, ctx: PickContext, cands: Candidates) -> float:
        waits = ctx.backlog_s
        return max(waits) if waits else 0.0
