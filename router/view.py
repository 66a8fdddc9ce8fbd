"""The in-memory view of the cluster that routing reads.

Sources (the YAML directory, the Kubernetes watch) write raw objects into a
`ClusterView`; after each change it rebuilds an immutable `Snapshot` and swaps it in
with one assignment, so a request holds a consistent picture for its whole life and a
change never disturbs requests already in flight. Routing code reads only snapshots, so
it cannot tell which source fed them.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal, TypeVar

from router.data_parallel import LWS_GROUP_KEY_LABEL, DataParallel, data_parallel
from router.resources import (
    KINDS,
    ModelRoute,
    ModelServer,
    Pod,
    Resource,
    kind_of,
    timestamp_key,
)

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: How many recent invalid-object reports a view keeps for the admin API.
MAX_INVALID_RECORDS = 128

Role = Literal["prefill", "decode", "both"]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One ready pod of one ModelServer, in one role; or, on a pod that runs several
    data-parallel ranks, one rank of it (`dp_rank`; see `data_parallel`). Hashable;
    `key` is stable."""

    namespace: str
    pod_name: str
    ip: str
    port: int
    role: Role
    group: str | None = None  # value of the pdGroup.groupKey label
    scheme: str = "http"
    #: The engine's data-parallel rank, on a pod that runs more than one (else None): its
    #: KV events come on the events port + rank, its /metrics series carry `engine=rank`.
    dp_rank: int | None = None
    #: The `X-data-parallel-rank` value that pins a request to this rank: its index among
    #: its API server's engines (the rank itself with one API server for every rank, its
    #: local index with hybrid load balancing); None when the address alone does (an
    #: external rank's own API server).
    rank_pin: str | None = None
    #: Its index among the ranks its pod runs (rank - the pod's first rank; None without
    #: data parallelism): an external rank's API (and Mooncake bootstrap) port offset.
    local_index: int | None = None
    #: Where this rank's engine core runs when that is not its API server's pod (vLLM's
    #: internal load balancing over nodes: a headless pod's rank), "" when no ready pod
    #: is known to run it; None: on this pod. Its KV events come from there.
    engine_ip: str | None = field(default=None, compare=False)
    #: The pod's name, with `/dp<rank>` for one rank of a data-parallel pod (the router's
    #: response headers and traces name it).
    label: str = field(init=False, repr=False, compare=False)
    #: `namespace/label`: made once, read several times by every request.
    key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        rank = self.dp_rank
        label = self.pod_name if rank is None else f"{self.pod_name}/dp{rank}"
        object.__setattr__(self, "label", label)
        object.__setattr__(self, "key", f"{self.namespace}/{label}")

    @property
    def base_url(self) -> str:
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"{self.scheme}://{host}:{self.port}"

    @property
    def engine_host(self) -> str | None:
        """The address of the pod its engine core runs on (and publishes KV events from);
        None when no ready pod is known to run it."""
        if self.engine_ip is None:
            return self.ip
        return self.engine_ip or None


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
    #: Its pods' data-parallel ranks (read from its annotations once a snapshot).
    data_parallel: DataParallel = field(default_factory=DataParallel)

    @property
    def is_pd(self) -> bool:
        return self.server.pd_group is not None

    def endpoints(self) -> list[Endpoint]:
        """Every ready pod of this server: aggregated, then each group's prefill and decode."""
        pods = list(self.aggregated)
        for group in self.groups:
            pods.extend(group.prefill)
            pods.extend(group.decode)
        return pods

    def sharing_server(self, pod: Endpoint) -> list[Endpoint]:
        """The targets one API server answers for: `pod`'s data-parallel ranks behind
        its address (vLLM's internal load balancing), or `pod` alone. When that server
        cannot be reached, none of them can."""
        if pod.dp_rank is None or self.data_parallel.external:
            return [pod]
        url = pod.base_url
        return [e for e in self.endpoints() if e.base_url == url]


@dataclass(frozen=True, slots=True)
class ShadowedRoute:
    """A model name (`modelName` or LoRA adapter) `route` claims that `winner` serves."""

    route: ModelRoute
    model: str
    winner: ModelRoute


@dataclass(frozen=True, slots=True)
class Snapshot:
    """An immutable picture of routes, servers and their ready pods."""

    routes_by_model: dict[str, ModelRoute] = field(default_factory=dict)  # modelName + adapters
    servers: dict[tuple[str, str], ServerPods] = field(default_factory=dict)  # (ns, name)
    ambiguous_pods: int = 0  # matched both role label sets or neither: left out
    generation: int = 0
    ambiguous_pod_keys: tuple[str, ...] = ()  # "ns/name" of the pods counted above, sorted
    #: "ns/name" of data-parallel pods left out because their first rank is unknown or
    #: out of range (`router.data_parallel`), sorted.
    unranked_pod_keys: tuple[str, ...] = ()
    shadowed: tuple[ShadowedRoute, ...] = ()  # names a route claims but an older one serves

    def model_names(self) -> list[str]:
        return sorted(self.routes_by_model)

    def endpoints(self) -> dict[str, Endpoint]:
        """Every ready pod of every server, by key (a pod two servers select appears once)."""
        return {pod.key: pod for server in self.servers.values() for pod in server.endpoints()}


@dataclass(frozen=True, slots=True)
class InvalidRecord:
    """One object a source could not use, kept so operators can see why."""

    kind: str
    name: str  # "namespace/name" when known
    reason: str
    at: float  # time.time() of the report


class ClusterView:
    """Holds the raw objects of every source and publishes snapshots.

    `apply`/`delete` are called by sources; `snapshot` is read by routing. Listeners
    (e.g. the scheduler dropping a removed pod's cache entries) get each new snapshot.
    Not thread-safe: call it from the event loop (sources parse in threads, apply here).
    """

    def __init__(self) -> None:
        self.snapshot = Snapshot()
        self.generation = 0
        self._listeners: list[Callable[[Snapshot], None]] = []
        self._objects: dict[str, dict[tuple[str, str], Resource]] = {k: {} for k in KINDS}
        self._batch_depth = 0
        self._dirty = False
        #: Invalid objects reported by sources, by kind (monotonic; read by metrics).
        self.invalid_counts: dict[str, int] = {}
        #: The most recent reports, oldest first, at most MAX_INVALID_RECORDS.
        self.recent_invalid: deque[InvalidRecord] = deque(maxlen=MAX_INVALID_RECORDS)

    def subscribe(self, listener: Callable[[Snapshot], None]) -> None:
        self._listeners.append(listener)

    def apply(self, obj: Resource) -> None:
        """Add or replace one object (keyed by kind, namespace and name)."""
        store = self._objects[kind_of(obj)]
        key = obj.meta.key
        if store.get(key) == obj:
            return
        store[key] = obj
        self._changed()

    def delete(self, kind: str, namespace: str, name: str) -> None:
        if self._store(kind).pop((namespace, name), None) is not None:
            self._changed()

    def replace_all(self, kind: str, objs: list[Resource], namespace: str | None = None) -> None:
        """Replace every object of `kind` (within `namespace` if given): used after a LIST."""
        store = self._store(kind)
        fresh: dict[tuple[str, str], Resource] = {}
        for obj in objs:
            if kind_of(obj) != kind:
                raise ValueError(f"replace_all({kind!r}) got a {kind_of(obj)}")
            fresh[obj.meta.key] = obj
        if namespace is None:
            new = fresh
        else:
            new = {key: obj for key, obj in store.items() if key[0] != namespace}
            new.update(fresh)
        if new != store:
            self._objects[kind] = new
            self._changed()

    def batch(self) -> AbstractContextManager[None]:
        """Context manager: many apply/delete calls, one rebuild at exit.

        If the block raises, the raw objects roll back to how they were when the
        outermost batch began, so a half-applied edit is never published.
        """
        return self._batch()

    @contextmanager
    def _batch(self) -> Iterator[None]:
        saved = {k: dict(v) for k, v in self._objects.items()} if self._batch_depth == 0 else None
        was_dirty = self._dirty
        self._batch_depth += 1
        try:
            yield
        except BaseException:
            self._batch_depth -= 1
            if saved is not None:
                self._objects = saved
                self._dirty = was_dirty
            raise
        self._batch_depth -= 1
        if self._batch_depth == 0 and self._dirty:
            self._rebuild()

    def objects(self, kind: str) -> Mapping[tuple[str, str], Resource]:
        """The raw objects of one kind, keyed by (namespace, name). Read-only use."""
        return self._store(kind)

    def report_invalid(self, kind: str, name: str, reason: str) -> None:
        """Record an object a source had to skip: counted, kept briefly, and logged."""
        self.invalid_counts[kind] = self.invalid_counts.get(kind, 0) + 1
        self.recent_invalid.append(InvalidRecord(kind, name, reason, time.time()))
        log.warning("invalid %s %s skipped: %s", kind, name, reason)

    def _store(self, kind: str) -> dict[tuple[str, str], Resource]:
        try:
            return self._objects[kind]
        except KeyError:
            raise ValueError(f"unknown kind {kind!r}") from None

    def _changed(self) -> None:
        self._dirty = True
        if self._batch_depth == 0:
            self._rebuild()

    def _rebuild(self) -> None:
        self._dirty = False
        self.generation += 1
        snapshot = build_snapshot(
            routes=_typed(self._objects["ModelRoute"].values(), ModelRoute),
            servers=_typed(self._objects["ModelServer"].values(), ModelServer),
            pods=_typed(self._objects["Pod"].values(), Pod),
            generation=self.generation,
        )
        newly = set(snapshot.unranked_pod_keys) - set(self.snapshot.unranked_pod_keys)
        for key in sorted(newly):  # once a pod, not once a rebuild
            log.warning("pod %s: its first data-parallel rank is unknown or out of range "
                        "(annotation pdgate.io/data-parallel-start-rank, or the label "
                        "leaderworkerset.sigs.k8s.io/worker-index); left out", key)
        self.snapshot = snapshot
        for listener in list(self._listeners):
            try:
                listener(snapshot)
            except Exception:
                log.exception("snapshot listener %r failed", listener)


def _typed(objs: Iterable[Resource], cls: type[_T]) -> list[_T]:
    return [obj for obj in objs if isinstance(obj, cls)]


def route_age_key(route: ModelRoute) -> tuple[datetime, str, str]:
    """The one order of ModelRoutes claiming the same name: oldest first.

    The oldest `creationTimestamp` wins, then namespace/name (as Kthena does); every
    source and every check (the Kubernetes source's duplicate report, the file source's
    first-seen age) goes through this key, so they cannot disagree on the winner.
    """
    return (timestamp_key(route.meta.creation_timestamp), route.meta.namespace, route.meta.name)


def _routes_by_model(
    routes: list[ModelRoute],
) -> tuple[dict[str, ModelRoute], tuple[ShadowedRoute, ...]]:
    """Map each model name and LoRA adapter to its oldest route; list the losers.

    As in Kthena, a name claimed as some route's `modelName` is looked up there before
    any route's `loraAdapters`; among routes of one kind the oldest wins.
    """
    ordered = sorted(routes, key=route_age_key)
    out: dict[str, ModelRoute] = {}
    shadowed: list[ShadowedRoute] = []
    for route in ordered:
        if route.model_name is not None:
            winner = out.setdefault(route.model_name, route)
            if winner is not route:
                shadowed.append(ShadowedRoute(route, route.model_name, winner))
    for route in ordered:
        for adapter in route.lora_adapters:
            winner = out.setdefault(adapter, route)
            if winner is not route:
                shadowed.append(ShadowedRoute(route, adapter, winner))
    return out, tuple(shadowed)


class _NamespacePods:
    """Ready pods of one namespace, indexed by label so selectors skip most pods."""

    __slots__ = ("all", "by_label")

    def __init__(self) -> None:
        self.all: list[Pod] = []
        self.by_label: dict[tuple[str, str], list[Pod]] = {}

    def add(self, pod: Pod) -> None:
        self.all.append(pod)
        for item in pod.meta.labels.items():
            self.by_label.setdefault(item, []).append(pod)

    def select(self, match: dict[str, str]) -> list[Pod]:
        if not match:
            return self.all
        smallest: list[Pod] | None = None
        for item in match.items():
            found = self.by_label.get(item)
            if not found:
                return []
            if smallest is None or len(found) < len(smallest):
                smallest = found
        assert smallest is not None
        return [pod for pod in smallest if _has_labels(pod.meta.labels, match)]


def _has_labels(labels: dict[str, str], required: dict[str, str]) -> bool:
    """Kthena's matchesLabels: every required pair present (an empty set matches nothing)."""
    if not required:
        return False
    for key, value in required.items():
        if labels.get(key) != value:
            return False
    return True


#: A pod's deployment, to pair a head pod with its headless pods: (role, PD group,
#: LeaderWorkerSet group key).
_Deployment = tuple[Role, str | None, str | None]


def _endpoints(
    pod: Pod, server: ModelServer, dp: DataParallel, role: Role, group: str | None,
    engines: Mapping[int, str] | None = None,
) -> list[Endpoint] | None:
    """The pod as targets: itself, or one a data-parallel rank its API server serves
    (`router.data_parallel`). None when its ranks cannot be known. `engines`: where each
    rank's engine core runs, with headless nodes (`_headless_engines`)."""
    assert pod.ip is not None
    ns, name, ip, scheme = pod.meta.namespace, pod.meta.name, pod.ip, server.protocol
    if dp.size == 1:
        return [Endpoint(ns, name, ip, server.port, role, group, scheme)]
    ranks = dp.pod_ranks(pod)
    if ranks is None:
        return None
    start, served = ranks
    port = server.port
    return [
        Endpoint(ns, name, ip, port + rank - start if dp.external else port, role, group,
                 scheme, dp_rank=rank, rank_pin=dp.rank_pin(rank, start),
                 local_index=rank - start,
                 engine_ip=None if engines is None or rank - start < dp.local_size
                 else engines.get(rank, ""))
        for rank in served
        if not dp.external or port + rank - start < 65536
    ]


def _headless_engines(
    placed: list[tuple[Pod, Role, str | None]], dp: DataParallel
) -> dict[_Deployment, dict[int, str]]:
    """With internal load balancing over nodes: for each deployment, the pod running each
    rank's engine core (a rank two pods claim is "": known to neither). A pod's own ranks
    run on it whatever this says (`_endpoints`)."""
    out: dict[_Deployment, dict[int, str]] = {}
    for pod, role, group in placed:
        assert pod.ip is not None
        engines = out.setdefault(_deployment(pod, role, group), {})
        for rank in dp.engine_ranks(pod):
            engines[rank] = pod.ip if engines.get(rank, pod.ip) == pod.ip else ""
    return out


def _deployment(pod: Pod, role: Role, group: str | None) -> _Deployment:
    return role, group, pod.meta.labels.get(LWS_GROUP_KEY_LABEL)


def _placed(
    server: ModelServer, pods: list[Pod], left_out: set[str]
) -> list[tuple[Pod, Role, str | None]]:
    """Each pod with its role and PD group (aggregated servers: "both", None); a pod of
    a PD server with no group or not exactly one role is left out."""
    pd = server.pd_group
    if pd is None:
        return [(pod, "both", None) for pod in pods]
    out: list[tuple[Pod, Role, str | None]] = []
    for pod in pods:
        labels = pod.meta.labels
        group = labels.get(pd.group_key)
        is_prefill = _has_labels(labels, pd.prefill_labels)
        is_decode = _has_labels(labels, pd.decode_labels)
        if not group or is_prefill == is_decode:
            left_out.add(f"{pod.meta.namespace}/{pod.meta.name}")
            continue
        out.append((pod, "prefill" if is_prefill else "decode", group))
    return out


def _server_pods(
    server: ModelServer, pods: list[Pod], left_out: set[str], unranked: set[str]
) -> ServerPods:
    dp = data_parallel(server)
    placed = _placed(server, pods, left_out)
    headless = _headless_engines(placed, dp) if dp.headless_nodes else None
    aggregated: list[Endpoint] = []
    groups: dict[str, tuple[list[Endpoint], list[Endpoint]]] = {}
    for pod, role, group in placed:
        engines = None if headless is None else headless[_deployment(pod, role, group)]
        targets = _endpoints(pod, server, dp, role, group, engines)
        if targets is None:
            unranked.add(f"{pod.meta.namespace}/{pod.meta.name}")
        elif group is None:
            aggregated.extend(targets)
        else:
            prefill, decode = groups.setdefault(group, ([], []))
            (prefill if role == "prefill" else decode).extend(targets)
    if server.pd_group is None:
        return ServerPods(server=server, aggregated=tuple(aggregated), data_parallel=dp)
    return ServerPods(
        server=server,
        groups=tuple(
            PDGroupPods(group=name, prefill=tuple(prefill), decode=tuple(decode))
            for name, (prefill, decode) in sorted(groups.items())
            if prefill and decode
        ),
        data_parallel=dp,
    )


def build_snapshot(
    routes: list[ModelRoute], servers: list[ModelServer], pods: list[Pod], generation: int = 0
) -> Snapshot:
    """Compute a snapshot from raw objects: a pure function, so it is easy to test.

    Pods are indexed once by namespace and label, so a rebuild costs about
    O(pods + servers x selected pods) rather than O(pods x servers).
    """
    by_namespace: dict[str, _NamespacePods] = {}
    for pod in sorted(pods, key=lambda p: p.meta.key):
        if pod.ready and pod.ip:
            ns = by_namespace.get(pod.meta.namespace)
            if ns is None:
                ns = by_namespace[pod.meta.namespace] = _NamespacePods()
            ns.add(pod)
    left_out: set[str] = set()
    unranked: set[str] = set()
    server_pods: dict[tuple[str, str], ServerPods] = {}
    empty = _NamespacePods()
    for server in sorted(servers, key=lambda s: s.meta.key):
        selected = by_namespace.get(server.meta.namespace, empty).select(server.match_labels)
        server_pods[server.meta.key] = _server_pods(server, selected, left_out, unranked)
    routes_by_model, shadowed = _routes_by_model(routes)
    return Snapshot(
        routes_by_model=routes_by_model,
        servers=server_pods,
        ambiguous_pods=len(left_out),
        generation=generation,
        ambiguous_pod_keys=tuple(sorted(left_out)),
        shadowed=shadowed,
        unranked_pod_keys=tuple(sorted(unranked)),
    )


__all__ = [
    "ClusterView",
    "DataParallel",
    "Endpoint",
    "InvalidRecord",
    "ModelRoute",
    "ModelServer",
    "PDGroupPods",
    "Pod",
    "Role",
    "ServerPods",
    "ShadowedRoute",
    "Snapshot",
    "build_snapshot",
    "data_parallel",
    "route_age_key",
]
