"""Loud configuration faults: what a new snapshot stopped serving, logged and counted.

The view routes around a bad configuration silently by design (the oldest route keeps a
model name; a ModelServer without ready pods answers 503), so this watcher compares
each snapshot with the previous one and tells the operator what changed:

- a ModelServer went from N ready pods to none (its selector matches nothing, its pods
  file was deleted or emptied, every pod turned unready), and when it has pods again;
- a ModelRoute lost a model name to an older route (a second route with the same
  `modelName` or LoRA adapter), and when it no longer does.

Each transition is one warning line and one count. Source-agnostic: the YAML directory
and the Kubernetes watch feed the same view. Until the sources have synced, snapshots are
partial (Kubernetes lists ModelServers before their Pods), so the first comparison is made
against the first synced snapshot and nothing before it is reported.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from router.view import ClusterView, ServerPods, Snapshot

log = logging.getLogger("pdgate.config")

#: How often `run()` checks whether the sources have synced (only until they have).
SYNC_POLL_S = 0.1

_Key = tuple[str, str]  # (namespace, name)


def _ready(server: ServerPods) -> int:
    """Ready pods (a pod with several data-parallel ranks is several targets, one pod)."""
    return len({pod.pod_name for pod in server.endpoints()})


class ConfigWatchMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.ready_pods = Gauge(
            "pdgate_model_server_ready_pods",
            "Ready pods a ModelServer selects (PD servers: pods of complete groups only).",
            ["namespace", "name"], registry=registry,
        )
        self.transitions = Counter(
            "pdgate_model_server_transitions",
            "A ModelServer lost its last ready pod (to=empty) or got one back (to=serving).",
            ["namespace", "name", "to"], registry=registry,
        )
        self.shadowed = Gauge(
            "pdgate_routes_shadowed",
            "Model names a ModelRoute claims that an older ModelRoute serves "
            "(the younger route gets no traffic for them).",
            ["namespace", "name"], registry=registry,
        )


class ConfigWatch:
    """Subscribes to a view; `run()` takes the baseline once `synced()` turns true."""

    def __init__(
        self, view: ClusterView, registry: CollectorRegistry, synced: Callable[[], bool]
    ) -> None:
        self._view = view
        self._synced = synced
        self._metrics = ConfigWatchMetrics(registry)
        self._baseline = False
        self._ready: dict[_Key, int] = {}  # ready pods of every server, last snapshot
        self._had: dict[_Key, int] = {}  # the last non-zero count, for the log line
        self._shadowed: dict[_Key, dict[str, str]] = {}  # route -> {model: winner}
        view.subscribe(self.observe)

    async def run(self) -> None:
        """Wait for the sources to sync, then compare against that snapshot.

        Sources tell `synced` as a property, not an event, and the snapshot that completes
        the sync may be published just before the property turns true: hence a short poll,
        which ends at the sync.
        """
        while not self._synced():  # noqa: ASYNC110 - no event to wait on (see above)
            await asyncio.sleep(SYNC_POLL_S)
        self.observe(self._view.snapshot)

    def observe(self, snapshot: Snapshot) -> None:
        """Update the gauges; log and count transitions once the sources have synced."""
        report = self._baseline or self._synced()
        first = report and not self._baseline  # compare with nothing: report every fault
        self._baseline = report
        self._servers(snapshot, report, first)
        self._routes(snapshot, report, first)

    def _servers(self, snapshot: Snapshot, report: bool, first: bool) -> None:
        metrics = self._metrics
        current: dict[_Key, int] = {}
        for key, server in snapshot.servers.items():
            count = current[key] = _ready(server)
            metrics.ready_pods.labels(*key).set(count)
            before = None if first else self._ready.get(key)
            if report and count == 0 and before != 0:
                had = self._had.get(key, 0)
                what = f"had {had}" if had else "its selector matches none"
                log.warning("ModelServer %s/%s has no ready pods (%s): its models answer "
                            "503", *key, what)
                metrics.transitions.labels(*key, "empty").inc()
            elif report and count and before == 0:
                log.warning("ModelServer %s/%s has %d ready pods again", *key, count)
                metrics.transitions.labels(*key, "serving").inc()
            if count:
                self._had[key] = count
        for key in self._ready.keys() - current.keys():  # deleted: its series go too
            metrics.ready_pods.remove(*key)
            for to in ("empty", "serving"):
                metrics.transitions.remove(*key, to)
            self._had.pop(key, None)
        self._ready = current

    def _routes(self, snapshot: Snapshot, report: bool, first: bool) -> None:
        current: dict[_Key, dict[str, str]] = {}
        for lost in snapshot.shadowed:
            owner = lost.winner.meta
            current.setdefault(lost.route.meta.key, {})[lost.model] = (
                f"{owner.namespace}/{owner.name}"
            )
        gauge = self._metrics.shadowed
        for key, models in current.items():
            gauge.labels(*key).set(len(models))
            known = {} if first else self._shadowed.get(key, {})
            for model, winner in sorted(models.items()):
                if report and known.get(model) != winner:
                    log.warning("ModelRoute %s/%s is shadowed for model %r by the older "
                                "ModelRoute %s: it gets no traffic for it", *key, model, winner)
        for key in self._shadowed.keys() - current.keys():
            gauge.remove(*key)
            if report and not first:
                log.warning("ModelRoute %s/%s is no longer shadowed", *key)
        self._shadowed = current


__all__ = ["ConfigWatch", "ConfigWatchMetrics"]
