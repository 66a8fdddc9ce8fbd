"""`random`: a uniform random score, for baselines (alone, it is random routing).

    s_p ~ U[0, 1), drawn from the scheduler's injected `random.Random` (seedable)

ttft scale: `seconds_per_point`.
"""

from __future__ import annotations

from router.scheduling.context import Candidates, PickContext
from router.scheduling.scorers.base import Scorer


class RandomScorer(Scorer):
    type_name = "random"

    def score(self, ctx: PickContext, cands: Candidates) -> list[float]:
        draw = self.deps.rng.random
        return [draw() for _ in range(len(cands))]
