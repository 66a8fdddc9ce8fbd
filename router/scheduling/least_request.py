"""The simplest load-aware choice: fewest router-side requests in flight.

Pair score = in_flight(prefill) + in_flight(decode), over every (prefill, decode) pair
inside one PD group; the lowest wins, ties broken at random (never by list order, which
would herd every idle-time request onto the first pod). Pods in `avoid` are used only
when nothing else is left.
"""

from __future__ import annotations

import random

from router.load import InFlight
from router.scheduling import Pick, ScheduleRequest
from router.view import Endpoint, ServerPods


class LeastRequestScheduler:
    def __init__(self, inflight: InFlight, rng: random.Random | None = None) -> None:
        self._inflight = inflight
        self._rng = rng or random.Random()

    def pick(
        self, server: ServerPods, request: ScheduleRequest, avoid: frozenset[str]
    ) -> Pick | None:
        if not server.is_pd:
            pod = self._least(server.aggregated, avoid)
            return None if pod is None else Pick(decode=pod)
        return self._pick_pair(server, avoid)

    def _least(self, pods: tuple[Endpoint, ...], avoid: frozenset[str]) -> Endpoint | None:
        usable = [p for p in pods if p.key not in avoid] or list(pods)
        if not usable:
            return None
        load = self._inflight.get
        best = min(load(p) for p in usable)
        return self._rng.choice([p for p in usable if load(p) == best])

    def _pick_pair(self, server: ServerPods, avoid: frozenset[str]) -> Pick | None:
        load = self._inflight.get
        best_pairs: list[Pick] = []
        best_score: tuple[int, int] | None = None
        for group in server.groups:
            for prefill in group.prefill:
                for decode in group.decode:
                    avoided = (prefill.key in avoid) + (decode.key in avoid)
                    score = (avoided, load(prefill) + load(decode))
                    if best_score is None or score < best_score:
                        best_score, best_pairs = score, [Pick(decode=decode, prefill=prefill)]
                    elif score == best_score:
                        best_pairs.append(Pick(decode=decode, prefill=prefill))
        return self._rng.choice(best_pairs) if best_pairs else None
