"""The prefill work each pod still has queued, in predicted seconds (Conductor's queue time).

Mooncake's Conductor predicts a prefill instance's queue time as the prefill time of the
requests already waiting there. The router knows what it sent: each sequential-PD prefill
it dispatches has a predicted service time (the server's calibrated prefill curve of the
uncached tokens, plus the pool pull; `pipeline._prefill_ticket`). Per pod it keeps one
number, the predicted moment the pod will be idle again:

    dispatch of service s at time t:   busy_until = max(busy_until, t) + s
    a prefill predicted to end at e ends at t:   busy_until += t - e

so the wait ahead of a new request is `max(0, busy_until - now)`. This is exact for a pod
that prefills one request at a time in arrival order and a good estimate for a batching
engine (a token budget per step is a work-conserving server). The correction on every
completion keeps errors from adding up; a dispatch to a pod with nothing in flight starts
from `now` (so a prefill that failed and never reported cannot leave a phantom backlog).
Requests counted by the engine but not sent by this router (another router) are not here:
the `queue` scorer and the synced in-flight counts cover them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

#: Bound on the pods tracked (the snapshot's pods are retained; this caps a pathological
#: churn between snapshots).
MAX_TRACKED_PODS: Final = 65_536


class PrefillBacklog:
    """pod key -> predicted idle time (the clock's seconds), for sequential-PD prefills."""

    __slots__ = ("_until",)

    def __init__(self) -> None:
        self._until: dict[str, float] = {}

    def wait_s(self, key: str, now: float) -> float:
        """Predicted seconds before pod `key` starts a prefill sent now."""
        until = self._until.get(key)
        return 0.0 if until is None or until <= now else until - now

    def dispatch(self, key: str, service_s: float, now: float, idle: bool) -> float:
        """Record a prefill of `service_s` sent to `key` now; returns its predicted end.
        `idle`: the router has nothing else in flight there (start from `now`)."""
        until = self._until.get(key, now)
        if idle or until < now:
            until = now
        end = until + max(0.0, service_s)
        if key not in self._until and len(self._until) >= MAX_TRACKED_PODS:
            self._until.pop(next(iter(self._until)))
        self._until[key] = end
        return end

    def finished(self, key: str, predicted_end: float, now: float) -> None:
        """A prefill predicted to end at `predicted_end` ended at `now`: shift what follows."""
        until = self._until.get(key)
        if until is not None:
            self._until[key] = max(now, until + (now - predicted_end))

    def retain(self, keys: Iterable[str]) -> None:
        """Forget pods that left the snapshot."""
        keep = set(keys)
        for key in [k for k in self._until if k not in keep]:
            del self._until[key]
