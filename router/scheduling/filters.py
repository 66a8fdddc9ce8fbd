"""Filters: drop candidates before scoring. Every filter is soft.

A filter that would drop EVERY candidate of a role is skipped for that decision (and
counted in `pdgate_scheduler_filter_fallbacks{filter}`): a degraded answer beats a 503
when, say, every decode pod reports a long queue. Pods in `avoid` (they already failed
this request) are dropped first the same way.

- `ready`: keeps pods that are ready. Pods in the view are ready already (the view
  drops the others), so this is a hook that keeps everything.
- `not-ejected`: drops pods for which the injected `is_ejected(pod key)` is true (the
  reliability layer's outlier ejection; by default nothing is ejected).
- `not-saturated`: drops pods whose engine reports more than `maxWaiting` waiting
  requests (default 32), or a KV cache usage above `maxKvUsage` (default 1.0: off), or
  with more than `maxInFlight` router-side requests (default 0: off). A pod with no fresh
  engine metrics is kept on the engine criteria.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Final

from router.scheduling.context import Candidates, EngineMemo, PickContext, SchedulerDeps
from router.scheduling.scorers.base import Param, check_params


class Filter:
    type_name: ClassVar[str] = ""
    PARAMS: ClassVar[Mapping[str, Param]] = {}
    #: A hook that keeps every candidate: profiles leave it out of the decision path.
    keeps_all: ClassVar[bool] = False

    def __init__(self, deps: SchedulerDeps, params: Mapping[str, Any]) -> None:
        self.deps = deps
        self.params = check_params(f"filter {self.type_name}", self.PARAMS, params)

    def select(self, ctx: PickContext, cands: Candidates) -> list[int] | None:
        """Positions of the candidates kept, or None when every candidate is kept."""
        raise NotImplementedError


def _kept(flags: list[bool]) -> list[int] | None:
    if all(flags):
        return None
    return [i for i, keep in enumerate(flags) if keep]


class ReadyFilter(Filter):
    type_name = "ready"
    keeps_all = True

    def select(self, ctx: PickContext, cands: Candidates) -> list[int] | None:
        return None


def never_ejected(_key: str) -> bool:
    """The default ejection hook: nothing is ejected."""
    return False


class NotEjectedFilter(Filter):
    type_name = "not-ejected"

    def select(self, ctx: PickContext, cands: Candidates) -> list[int] | None:
        ejected = self.deps.is_ejected
        if ejected is never_ejected:
            return None
        return _kept([not ejected(key) for key in cands.keys])


class NotSaturatedFilter(Filter):
    type_name = "not-saturated"
    PARAMS: ClassVar = {
        "maxWaiting": Param(float, 32.0, 0.0),
        "maxKvUsage": Param(float, 1.0, 0.0, 1.0),
        "maxInFlight": Param(int, 0, 0),
    }

    def __init__(self, deps: SchedulerDeps, params: Mapping[str, Any]) -> None:
        super().__init__(deps, params)
        self._max_waiting: float = self.params["maxWaiting"]
        self._max_usage: float = self.params["maxKvUsage"]
        self._max_inflight: int = self.params["maxInFlight"]
        #: The engine-only answer (no `maxInFlight`), per scrape: (kept positions or None,).
        self._memo: EngineMemo[tuple[list[int] | None]] = EngineMemo()

    def select(self, ctx: PickContext, cands: Candidates) -> list[int] | None:
        if not self._max_inflight:
            known = self._memo.get(cands.engine)
            if known is not None:
                return known[0]
        max_waiting = self._max_waiting
        flags = [
            e is None or e.waiting is None or e.waiting <= max_waiting for e in cands.engine
        ]
        if self._max_usage < 1.0:
            max_usage = self._max_usage
            flags = [
                keep and (e is None or e.kv_usage is None or e.kv_usage <= max_usage)
                for keep, e in zip(flags, cands.engine, strict=True)
            ]
        if self._max_inflight:
            limit = self._max_inflight
            flags = [
                keep and n <= limit for keep, n in zip(flags, cands.inflight, strict=True)
            ]
            return _kept(flags)
        return self._memo.put(cands.engine, (_kept(flags),))[0]


FILTERS: Final[dict[str, type[Filter]]] = {
    cls.type_name: cls for cls in (ReadyFilter, NotEjectedFilter, NotSaturatedFilter)
}
