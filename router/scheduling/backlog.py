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
Other router processes (`router.sync`: workers of this host, peer replicas) report their
own backlog per pod, as seconds left; a pod's wait is this process's plus theirs. Each
process's part is the work it sent that it predicts is not done, as if the pod served
its requests alone: when two processes' requests interleave on a pod, each one's part
runs down while its request waits behind the other's, so the sum underestimates by at
most the work overlapping them, and never counts one request twice (a prefill that
waited ends late, and that correction moves only what its own process sent after it).
Requests sent by a router outside the sync are not here: the `queue` scorer (the
engine's waiting requests) covers them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Final

#: Bound on the pods tracked (the snapshot's pods are retained; this caps a pathological
#: churn between snapshots), for this process's backlog and for the others' reports.
MAX_TRACKED_PODS: Final = 65_536


class PrefillBacklog:
    """pod key -> predicted idle time (the clock's seconds), for sequential-PD prefills.

    Each pod also keeps the sum of the corrections applied so far (`shift`): a prefill's
    end as predicted at dispatch moves with every correction made after it, so `dispatch`
    returns a ticket in unshifted time and `finished` adds the shift back."""

    __slots__ = ("_pods", "_remote", "listener")

    def __init__(self) -> None:
        self._pods: dict[str, list[float]] = {}  # key -> [busy_until, shift]
        #: key -> origin -> when that origin's reported backlog there runs out.
        self._remote: dict[str, dict[str, float]] = {}
        #: Called with a pod's key whenever this process's own backlog there changed
        #: (`router.sync` reports it).
        self.listener: Callable[[str], None] | None = None

    def wait_s(self, key: str, now: float) -> float:
        """Predicted seconds before pod `key` starts a prefill sent now: this process's
        backlog there plus what the other router processes reported."""
        wait = self.own_wait_s(key, now)
        remote = self._remote.get(key)
        if remote:
            for until in remote.values():
                if until > now:
                    wait += until - now
        return wait

    def own_wait_s(self, key: str, now: float) -> float:
        """The part of `wait_s` this process sent (what it reports to the others)."""
        pod = self._pods.get(key)
        return 0.0 if pod is None or pod[0] <= now else pod[0] - now

    def dispatch(self, key: str, service_s: float, now: float, idle: bool) -> float:
        """Record a prefill of `service_s` sent to `key` now; returns its ticket for
        `finished`. `idle`: no router has anything else in flight there (start from now)."""
        pod = self._pods.get(key)
        if pod is None:
            if len(self._pods) >= MAX_TRACKED_PODS:
                self._pods.pop(next(iter(self._pods)))
            pod = self._pods[key] = [now, 0.0]
        if idle or pod[0] < now:
            pod[0] = now
        pod[0] += max(0.0, service_s)
        if self.listener is not None:
            self.listener(key)
        return pod[0] - pod[1]

    def finished(self, key: str, ticket: float, now: float) -> None:
        """The prefill `dispatch` gave `ticket` ended at `now`: shift what follows it."""
        pod = self._pods.get(key)
        if pod is None:
            return
        delta = now - (ticket + pod[1])
        pod[0] = max(now, pod[0] + delta)
        pod[1] += delta
        if self.listener is not None:
            self.listener(key)

    def set_remote(self, origin: str, key: str, wait_s: float, now: float) -> None:
        """`origin` (another router process) reports `wait_s` seconds of its prefills
        left on pod `key` as of `now` (this process's clock, when the report arrived)."""
        remote = self._remote.get(key)
        if wait_s <= 0.0:
            if remote is not None:
                remote.pop(origin, None)
                if not remote:
                    del self._remote[key]
            return
        if remote is None:
            if len(self._remote) >= MAX_TRACKED_PODS:
                self._remote.pop(next(iter(self._remote)))
            remote = self._remote[key] = {}
        remote[origin] = now + wait_s

    def add_remote(self, origin: str, key: str, service_s: float, now: float) -> None:
        """Queue a prefill of `service_s` on pod `key` as `origin`'s before it reports it
        (a new prompt this process placed for it, `router.sync`); its next report of `key`
        sets its true backlog there. Without it, this process's own next pick would see
        the pod as idle as before the placement, and send a second new prompt there."""
        remote = self._remote.get(key)
        until = now if remote is None else max(now, remote.get(origin, now))
        self.set_remote(origin, key, until + service_s - now, now)

    def replace_remote(self, origin: str, waits: dict[str, float], now: float) -> None:
        """`origin`'s whole report (its heartbeat): pods it does not name have none of its
        backlog left."""
        for key in [k for k, remote in self._remote.items() if origin in remote
                    and k not in waits]:
            self.set_remote(origin, key, 0.0, now)
        for key, wait_s in waits.items():
            self.set_remote(origin, key, float(wait_s), now)

    def drop_origin(self, origin: str) -> None:
        """`origin` went silent or restarted: its reports no longer weigh on any pod."""
        for key in [k for k, remote in self._remote.items() if origin in remote]:
            self.set_remote(origin, key, 0.0, 0.0)

    def retain(self, keys: Iterable[str]) -> None:
        """Forget pods that left the snapshot."""
        keep = set(keys)
        for key in [k for k in self._pods if k not in keep]:
            del self._pods[key]
        for key in [k for k in self._remote if k not in keep]:
            del self._remote[key]

    def __len__(self) -> int:
        return len(self._pods)
