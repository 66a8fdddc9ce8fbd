"""The prefill work each pod still has queued, in predicted seconds (Conductor's queue time).

Mooncake's Conductor predicts a prefill instance's queue time as the prefill time of the
requests already waiting there. The router knows what it sent: each sequential-PD prefill
it dispatches has a predicted service time (the server's calibrated prefill curve of the
uncached tokens, plus the pool pull; `pipeline._prefill_ticket`). Per pod it keeps one
number, the predicted moment the pod will be idle again:

    dispatch of service s at time t:   busy_until = max(busy_until, t) + s
    a prefill now predicted to end at e ends at t:   busy_until += t - e

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
    """pod key -> predicted idle time (the clock's seconds), for sequential-PD prefills.

    Each pod also keeps the sum of the corrections applied so far (`shift`): a prefill's
    end as predicted at dispatch moves with every correction made after it, so `dispatch`
    returns a ticket in unshifted time and `finished` adds the shift back."""

    __slots__ = ("_pods",)

    def __init__(self) -> None:
        self._pods: dict[str, list[float]] = {}  # key -> [busy_until, shift]

    def wait_s(self, key: str, now: float) -> float:
        """Predicted seconds before pod `key` starts a prefill sent now."""
        pod = self._pods.get(key)
        return 0.0 if pod is None or pod[0] <= now else pod[0] - now

    def dispatch(self, key: str, service_s: float, now: float, idle: bool) -> float:
        """Record a prefill of `service_s` sent to `key` now; returns its ticket for
        `finished`. `idle`: the router has nothing else in flight there (start from now)."""
        pod = self._pods.get(key)
        if pod is None:
            if len(self._pods) >= MAX_TRACKED_PODS:
                self._pods.pop(next(iter(self._pods)))
            pod = self._pods[key] = [now, 0.0]
        if idle or pod[0] < now:
            pod[0] = now
        pod[0] += max(0.0, service_s)
        return pod[0] - pod[1]

    def finished(self, key: str, ticket: float, now: float) -> None:
        """The prefill `dispatch` gave `ticket` ended at `now`: shift what follows it."""
        pod = self._pods.get(key)
        if pod is None:
            return
        delta = now - (ticket + pod[1])
        pod[0] = max(now, pod[0] + delta)
        pod[1] += delta

    def retain(self, keys: Iterable[str]) -> None:
        """Forget pods that left the snapshot."""
        keep = set(keys)
        for key in [k for k in self._pods if k not in keep]:
            del self._pods[key]

    def __len__(self) -> int:
        return len(self._pods)
