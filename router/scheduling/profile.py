"""One role's profile: its filters, its scorers combined into one cost per candidate, and
the guard (steps 1-3 of `pipeline`'s decision; `pipeline` pairs PD sides, breaks ties
and records the choice).

Compiled (router/build.py) with the pipeline, which calls it for every role of every
decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from router.scheduling.config import ProfileConfig, SchedulerConfig
from router.scheduling.context import Candidates, EngineMemo, PickContext, SchedulerDeps
from router.scheduling.filters import FILTERS, Filter
from router.scheduling.scorers import SCORERS, Scorer

#: Added to the cost of a candidate the guard excludes: it loses to any other candidate,
#: yet a group with one guarded side still beats a group with two.
GUARD_PENALTY: Final = 1e12

#: The scorers whose part of a ttft cost is the prompt's compute (and pull) seconds.
_PREFIX_SCORERS: Final = frozenset(("prefix-cache", "precise-prefix-cache"))


class Profile:
    """One role's filters, scorers and picker settings, built from a `ProfileConfig`."""

    __slots__ = (
        "_waiting",
        "config",
        "filters",
        "guard_absolute",
        "guard_relative",
        "name",
        "recorders",
        "scorers",
        "similarity",
        "tie_tolerance",
        "total_weight",
        "ttft",
        "uses_backlog",
        "work",
        "work_weight",
    )

    def __init__(self, name: str, config: ProfileConfig, deps: SchedulerDeps) -> None:
        self.name = name
        self.config = config
        filters = [FILTERS[s.type](deps, s.params) for s in config.filters]
        self.filters: list[Filter] = [f for f in filters if not f.keeps_all]
        self.scorers: list[Scorer] = [
            SCORERS[s.type](s.weight, deps, s.params) for s in config.scorers if s.weight > 0
        ]
        #: The scorers that remember the chosen pod (the others' `picked` does nothing).
        self.recorders = [s for s in self.scorers if type(s).picked is not Scorer.picked]
        #: Whether the prefill backlog (`backlog.py`) must hear of this profile's picks.
        self.uses_backlog = any(s.type_name == "prefill-backlog" for s in self.scorers)
        self.ttft = config.unit == "ttft"
        self.total_weight = 0.0
        for scorer in self.scorers:  # summed in scorer order, as `costs` always did
            self.total_weight += scorer.weight
        picker = config.picker
        self.tie_tolerance = picker.tie_tolerance
        self.similarity = picker.cache_similarity
        #: The compute weight of the choice (`PickerConfig.work_weight`): the PD prefill
        #: profile in ttft unit only (no other profile's choice reads it).
        self.work_weight = picker.work_weight if self.ttft and name == "prefill" else 0.0
        #: The prefix scorer's part of the last `costs`: each candidate's compute (and
        #: pull) seconds; None without a prefix scorer or a work weight.
        self.work: list[float] | None = None
        self.guard_absolute = picker.guard.absolute
        self.guard_relative = picker.guard.relative
        self._waiting: EngineMemo[list[float]] = EngineMemo()  # the guard's, per scrape

    def costs(self, ctx: PickContext, cands: Candidates) -> list[float]:
        """Combined cost per candidate (lower is better); see `scorers.base`."""
        n = len(cands.keys)
        cost: list[float] | None = None  # the sum so far, from 0.0 (None: still 0.0)
        similarity = self.similarity if n > 1 else 0.0
        ttft = self.ttft
        ctx.ttft_unit = ttft
        ctx.compute_tokens = ctx.pull_tokens = None
        self.work = None
        for scorer in self.scorers:
            scores = scorer.score(ctx, cands)
            if similarity > 0 and scorer.affinity:
                best = max(scores)
                floor = best - similarity
                scores = [best if s >= floor else s for s in scores]
            weight = scorer.weight * (scorer.scale_s(ctx, cands) if ttft else 1.0)
            if not weight:
                continue
            if self.work_weight and scorer.type_name in _PREFIX_SCORERS:
                self.work = [weight * (1.0 - s) for s in scores]
            if cost is None:
                cost = [0.0 + weight * (1.0 - s) for s in scores]
            else:  # one score per candidate (no strict zip: it costs a fifth of this line)
                cost = [c + weight * (1.0 - s) for c, s in zip(cost, scores)]  # noqa: B905
        if cost is None:
            return [0.0] * n
        if not ttft and self.total_weight > 0:
            total_weight = self.total_weight
            cost = [c / total_weight for c in cost]
        return cost

    def choice_costs(self, costs: list[float]) -> list[float]:
        """What the choice compares: `costs` plus `work_weight` x each candidate's compute
        seconds from the last `costs` (the costs themselves stay the predicted TTFT)."""
        work, weight = self.work, self.work_weight
        if work is None or not weight:
            return costs
        return [c + weight * w for c, w in zip(costs, work)]  # noqa: B905

    def tolerance(self, ctx: PickContext) -> float:
        return self.tie_tolerance * (ctx.mean_prefill_s if self.ttft else 1.0)

    def guard(self, cands: Candidates, costs: list[float]) -> bool:
        """Exclude far busier candidates (+GUARD_PENALTY); True if that changed the winner."""
        n = len(cands)
        if n < 2 or self.guard_absolute <= 0 or self.guard_relative <= 0:
            return False
        loads = cands.loads(self._waiting)
        low = min(loads)
        limit = max(low + self.guard_absolute, self.guard_relative * max(low, 1.0))
        if max(loads) < limit:
            return False
        winner = costs.index(min(costs))
        for i in range(n):
            if loads[i] >= limit:
                costs[i] += GUARD_PENALTY
        return loads[winner] >= limit


@dataclass(frozen=True, slots=True)
class Profiles:
    """Everything a reload replaces, swapped in with one assignment."""

    config: SchedulerConfig
    prefill: Profile
    decode: Profile
    aggregated: Profile
    precise: bool  # `config.precise_enabled`, read once per request on the hot path


def build_profiles(config: SchedulerConfig, deps: SchedulerDeps) -> Profiles:
    return Profiles(
        config=config,
        prefill=Profile("prefill", config.profile("prefill"), deps),
        decode=Profile("decode", config.profile("decode"), deps),
        aggregated=Profile("aggregated", config.profile("aggregated"), deps),
        precise=config.precise_enabled,
    )
