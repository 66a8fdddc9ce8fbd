"""The in-memory view of the cluster that routing reads.

Sources (the YAML directory, the Kubernetes watch) write raw objects into a
`ClusterView`; after each change it rebuilds an immutable `Snapshot` and swaps it in
with one assignment, so a request holds a consistent picture for its whole life and a
change never disturbs requests already in flight. Routing code reads only snapshots, so
it cannot tell which source fed them.

INTERFACE CONTRACT (helpers implement; names and fields are fixed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from router.resources import ModelRoute, ModelServer, Pod, Resource

Role = Literal["prefill", "decode", "both"]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One ready pod of one ModelServer, in one role. Hashable; `key` is stable."""

    namespace: str
    pod_name: str
    ip: str
    port: int
    role: Role
    group: str | None = None  # value of the pdGroup.groupKey label
    scheme: str = "http"

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.pod_name}"

    @property
    def base_url(self) -> str:
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"{self.scheme}://{host}:{self.port}"


@dataclass(frozen=True, slots=True)
class PDGroupPods:
    """The ready pods of one PD group: a pair is only ever made inside one of these."""

    group: str
    prefill: tuple[Endpoint, ...]
    decode: tuple[Endpoint, ...]


@dataclass(frozen=True, slots=True)
class ServerPods:
    """A ModelServer with its ready pods, split by role.

    Aggregated servers (no pdGroup) fill `aggregated`; PD servers fill `groups` with only
    the groups that have at least one prefill and one decode pod.
    """

    server: ModelServer
    aggregated: tuple[Endpoint, ...] = ()
    groups: tuple[PDGroupPods, ...] = ()

    @property
    def is_pd(self) -> bool:
        return self.server.pd_group is not None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """An immutable picture of routes, servers and their ready pods."""

    routes_by_model: dict[str, ModelRoute] = field(default_factory=dict)  # modelName + adapters
    servers: dict[tuple[str, str], ServerPods] = field(default_factory=dict)  # (ns, name)
    ambiguous_pods: int = 0  # matched both role label sets or neither: left out
    generation: int = 0

    def model_names(self) -> list[str]:
        return sorted(self.routes_by_model)


class ClusterView:
    """Holds the raw objects of every source and publishes snapshots.

    `apply`/`delete` are called by sources; `snapshot` is read by routing. Listeners
    (e.g. the scheduler dropping a removed pod's cache entries) get each new snapshot.
    """

    def __init__(self) -> None:
        self.snapshot = Snapshot()
        self._listeners: list[Callable[[Snapshot], None]] = []

    def subscribe(self, listener: Callable[[Snapshot], None]) -> None:
        self._listeners.append(listener)

    def apply(self, obj: Resource) -> None:
        raise NotImplementedError

    def delete(self, kind: str, namespace: str, name: str) -> None:
        raise NotImplementedError

    def replace_all(self, kind: str, objs: list[Resource], namespace: str | None = None) -> None:
        """Replace every object of `kind` (within `namespace` if given): used after a LIST."""
        raise NotImplementedError

    def batch(self) -> object:
        """Context manager: many apply/delete calls, one rebuild at exit."""
        raise NotImplementedError


__all__ = [
    "ClusterView",
    "Endpoint",
    "ModelRoute",
    "ModelServer",
    "PDGroupPods",
    "Pod",
    "Role",
    "ServerPods",
    "Snapshot",
]
