"""`least-request`: fewer router-side requests in flight is better.

    s_p = (n_max - n_p) / n_max          (s_p = 1 for every pod when n_max = 0)

- n_p   = requests the router has in flight on pod p (`router.load.InFlight`: counted
          when the proxy commits a request to the pod, released on every exit path), so
          two requests arriving together never both see an idle pod;
- n_max = the largest n among the candidates.

ttft scale: n_max x r, so w x scale x (1 - s_p) = n_p x r, the queue wait ahead of the
request. r = the wait one request adds: the running mean prefill time on a prefill pod,
that x `aggregated_load_factor` on an aggregated pod, `decode_admission_s` on a decode pod.
"""

from __future__ import annotations

from router.scheduling.context import Candidates, PickContext
from router.scheduling.scorers.base import Scorer


class LeastRequestScorer(Scorer):
    type_name = "least-request"

    def score(self, ctx: PickContext, cands: Candidates) -> list[float]:
        counts = cands.inflight
        top = max(counts) if counts else 0
        if top <= 0:
            return [1.0] * len(counts)
        return [(top - n) / top for n in counts]

    def scale_s(self, ctx: PickContext, cands: Candidates) -> float:
        top = max(cands.inflight) if cands.inflight else 0
        return top * ctx.per_request_s()
