"""`round-robin`: take turns, for baselines (alone, it is round-robin routing).

    s_p = 1 for the candidate at position (c mod N), 0 for every other candidate

- N = the number of candidates left after the filters, in the server's pod order;
- c = the requests this scorer has seen dispatched (its profile's picks, advanced by
  `picked`), so consecutive requests go to consecutive pods.

In a PD profile pair (prefill and decode both `round-robin`, one prefill and one decode
pod per group, or equal numbers) the two counters move together, so position k of the
prefill pods and of the decode pods is the same group: round-robin over groups.

ttft scale: `seconds_per_point`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.scheduling.context import Candidates, PickContext, SchedulerDeps
from router.scheduling.scorers.base import Scorer


class RoundRobinScorer(Scorer):
    type_name = "round-robin"

    def __init__(self, weight: float, deps: SchedulerDeps, params: Mapping[str, Any]) -> None:
        super().__init__(weight, deps, params)
        self._turn = 0

    def score(self, ctx: PickContext, cands: Candidates) -> list[float]:
        n = len(cands)
        scores = [0.0] * n
        if n:
            scores[self._turn % n] = 1.0
        return scores

    def picked(self, ctx: PickContext, cands: Candidates, index: int) -> None:
        self._turn += 1
