"""An in-process Kubernetes API server speaking the wire protocol pdgate relies on.

Served by aiohttp on 127.0.0.1 so the real kubernetes-asyncio client talks to it through a
generated kubeconfig. What it implements, as the real API server does:

- LIST with `metadata.resourceVersion` (one global counter, as a string), `limit` and
  `continue`, `labelSelector` (`k=v`, `k==v`, `k!=v`, `k in (a,b)`, `k notin (a,b)`, `k`,
  `!k`); items of built-in kinds carry no `kind`/`apiVersion`, as in Kubernetes.
- WATCH (`watch=true|True|1`) as a chunked stream of JSON lines, starting after the given
  resourceVersion from a bounded history (too old: HTTP 200 and one `ERROR` event with a
  `Status` of code 410, reason Expired); `allowWatchBookmarks` (periodic BOOKMARKs);
  `timeoutSeconds` (the stream ends cleanly); selector transitions (an object leaving a
  watch's selector arrives as DELETED, entering as ADDED).
- Namespaced and cluster-wide paths for pods and the two custom resources; POST of core
  Events; optional bearer-token auth.

Test controls: create/update/delete objects, compact the history (so old
resourceVersions expire), expire or drop every open watch, hold back delivery to open
watches (a silent partition), inject a raw line, stop and restart on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import re
import socket
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import yaml
from aiohttp import web

GROUP = "networking.serving.volcano.sh"
CRD_VERSION = "v1alpha1"


@dataclass(frozen=True)
class ResourceInfo:
    plural: str
    kind: str
    api_version: str
    core: bool


RESOURCES: dict[str, ResourceInfo] = {
    "pods": ResourceInfo("pods", "Pod", "v1", core=True),
    "modelroutes": ResourceInfo("modelroutes", "ModelRoute", f"{GROUP}/{CRD_VERSION}", False),
    "modelservers": ResourceInfo("modelservers", "ModelServer", f"{GROUP}/{CRD_VERSION}", False),
}
PLURAL_OF_KIND = {info.kind: info.plural for info in RESOURCES.values()}

# ------------------------------------------------------------------ label selectors

Requirement = Callable[[dict[str, str]], bool]
_SET_TERM = re.compile(r"^\s*([^\s!=,()]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")
_EQ_TERM = re.compile(r"^\s*([^\s!=,()]+)\s*(==|=|!=)\s*([^\s,()]*)\s*$")
_EXISTS_TERM = re.compile(r"^\s*(!?)\s*([^\s!=,()]+)\s*$")


class SelectorError(ValueError):
    pass


def _split_terms(text: str) -> list[str]:
    terms, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 0:
            terms.append(text[start:i])
            start = i + 1
    terms.append(text[start:])
    return [t for t in terms if t.strip()]


def parse_selector(text: str | None) -> Requirement:
    """Compile a label selector; an empty one matches everything."""
    if not text or not text.strip():
        return lambda labels: True
    checks: list[Requirement] = []
    for term in _split_terms(text):
        if m := _SET_TERM.match(term):
            key, op = m.group(1), m.group(2)
            values = {v.strip() for v in m.group(3).split(",") if v.strip()}
            if not values:
                raise SelectorError(f"empty value set in {term!r}")
            if op == "in":
                checks.append(lambda lb, k=key, vs=values: lb.get(k) in vs)
            else:
                checks.append(lambda lb, k=key, vs=values: lb.get(k) not in vs)
        elif m := _EQ_TERM.match(term):
            key, op, value = m.groups()
            if op == "!=":
                checks.append(lambda lb, k=key, v=value: lb.get(k) != v)
            else:
                checks.append(lambda lb, k=key, v=value: lb.get(k) == v)
        elif m := _EXISTS_TERM.match(term):
            negate, key = m.groups()
            if negate:
                checks.append(lambda lb, k=key: k not in lb)
            else:
                checks.append(lambda lb, k=key: k in lb)
        else:
            raise SelectorError(f"unparseable selector term {term!r}")
    return lambda labels: all(check(labels) for check in checks)


# ------------------------------------------------------------------ state


@dataclass
class Change:
    rv: int
    plural: str
    type: str  # ADDED | MODIFIED | DELETED
    obj: dict[str, Any]
    old: dict[str, Any] | None


@dataclass
class RequestRecord:
    method: str
    path: str
    query: dict[str, str]


@dataclass(eq=False)
class _Watcher:
    info: ResourceInfo
    namespace: str | None
    matches: Requirement
    request: web.Request
    queue: asyncio.Queue[dict[str, Any] | bytes | None] = field(
        default_factory=lambda: asyncio.Queue(maxsize=10_000)
    )

    def wants(self, obj: dict[str, Any] | None) -> bool:
        if obj is None:
            return False
        meta = obj.get("metadata", {})
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        return self.matches(meta.get("labels") or {})

    def event_for(self, change: Change) -> dict[str, Any] | None:
        """The event this watch sees for a change, with selector transitions."""
        now, before = self.wants(change.obj), self.wants(change.old)
        if change.type == "DELETED":
            return {"type": "DELETED", "object": change.obj} if now else None
        if now and before:
            return {"type": "MODIFIED", "object": change.obj}
        if now:
            return {"type": "ADDED", "object": change.obj}
        if before:
            return {"type": "DELETED", "object": change.obj}
        return None


def _truthy(value: str | None) -> bool:
    return (value or "").lower() in ("true", "1")


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeApiServer:
    """See the module docstring. Methods that change objects return the stored copy."""

    def __init__(
        self,
        *,
        history: int = 1000,
        bookmark_interval: float = 1.0,
        token: str | None = "fake-token",
        max_timeout_seconds: int = 1800,
    ) -> None:
        self.token = token
        self.bookmark_interval = bookmark_interval
        self.max_timeout_seconds = max_timeout_seconds
        self.port = 0
        self.events: list[dict[str, Any]] = []  # POSTed core Events
        self.requests: deque[RequestRecord] = deque(maxlen=2000)
        self._rv = itertools.count(1000)
        self.resource_version = next(self._rv)
        self._objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {
            plural: {} for plural in RESOURCES
        }
        self._history: deque[Change] = deque(maxlen=history)
        self._floor = self.resource_version  # watches from below this are too old
        self._watchers: set[_Watcher] = set()
        self._frozen: set[_Watcher] = set()  # cut off silently by partition()
        self._continues: dict[str, list[dict[str, Any]]] = {}
        self._runner: web.AppRunner | None = None

    # ---------------------------------------------------------------- lifecycle

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._runner is not None

    async def start(self) -> None:
        """Listen on 127.0.0.1 (the same port as before after a stop)."""
        app = web.Application()
        app.router.add_get("/api/v1/pods", self._collection)
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._collection)
        app.router.add_post("/api/v1/namespaces/{namespace}/events", self._post_event)
        app.router.add_get("/apis/{group}/{version}/{plural}", self._collection)
        app.router.add_get(
            "/apis/{group}/{version}/namespaces/{namespace}/{plural}", self._collection
        )
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        self._runner = runner

    async def stop(self) -> None:
        """Kill the server: open watches are cut, the port refuses connections."""
        self.drop_watches()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        user: dict[str, Any] = {"token": self.token} if self.token else {}
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": user}],
            "contexts": [
                {
                    "name": "fake",
                    "context": {"cluster": "fake", "user": "fake", "namespace": namespace},
                }
            ],
            "current-context": "fake",
        }
        path.write_text(yaml.safe_dump(config))
        return path

    # ---------------------------------------------------------------- object controls

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        info = self._info_of(obj)
        stored = copy.deepcopy(obj)
        meta = stored.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        key = (meta["namespace"], meta["name"])
        if key in self._objects[info.plural]:
            raise KeyError(f"{info.kind} {key} exists")
        stored["kind"], stored["apiVersion"] = info.kind, info.api_version
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", _now())
        meta["generation"] = 1
        return self._commit(info, key, "ADDED", stored, None)

    def update(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Replace an object (uid and creationTimestamp kept)."""
        info = self._info_of(obj)
        stored = copy.deepcopy(obj)
        meta = stored.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        key = (meta["namespace"], meta["name"])
        old = self._objects[info.plural][key]
        stored["kind"], stored["apiVersion"] = info.kind, info.api_version
        for field_name in ("uid", "creationTimestamp"):
            meta[field_name] = old["metadata"][field_name]
        meta["generation"] = old["metadata"].get("generation", 1) + (
            stored.get("spec") != old.get("spec")
        )
        return self._commit(info, key, "MODIFIED", stored, old)

    def delete(self, kind: str, namespace: str, name: str) -> dict[str, Any]:
        info = RESOURCES[PLURAL_OF_KIND[kind]]
        key = (namespace, name)
        old = self._objects[info.plural][key]
        gone = copy.deepcopy(old)
        return self._commit(info, key, "DELETED", gone, old)

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any]:
        return copy.deepcopy(self._objects[PLURAL_OF_KIND[kind]][(namespace, name)])

    def names(self, kind: str) -> set[tuple[str, str]]:
        return set(self._objects[PLURAL_OF_KIND[kind]])

    # ---------------------------------------------------------------- fault controls

    def compact(self) -> None:
        """Forget the event history: watches from any older resourceVersion get 410."""
        self._history.clear()
        self._floor = self.resource_version

    def expire_watches(self) -> int:
        """Send every open watch an ERROR 410 event (HTTP 200 stream) and end it."""
        error = {"type": "ERROR", "object": _status(410, "Expired", "too old resource version")}
        for watcher in list(self._watchers):
            self._offer(watcher, error)
            self._offer(watcher, None)
        return len(self._watchers)

    def drop_watches(self) -> int:
        """Cut the TCP connection of every open watch, mid-stream."""
        count = len(self._watchers)
        for watcher in list(self._watchers):
            transport = watcher.request.transport
            if transport is not None:
                transport.abort()
            self._offer(watcher, None)
        return count

    @contextlib.contextmanager
    def partition(self) -> Iterator[None]:
        """Silently cut the watches open now: from here on they receive nothing (no
        events, no bookmarks) until they end, like a connection that died quietly."""
        self._frozen |= self._watchers
        yield

    def inject_raw(self, plural: str, line: bytes) -> int:
        """Write a raw line (e.g. malformed JSON) to every open watch of `plural`."""
        targets = [w for w in self._watchers if w.info.plural == plural]
        for watcher in targets:
            self._offer(watcher, line)
        return len(targets)

    def open_watches(self, plural: str | None = None) -> int:
        return sum(1 for w in self._watchers if plural is None or w.info.plural == plural)

    def watch_requests(self, plural: str) -> list[RequestRecord]:
        return [
            r
            for r in self.requests
            if r.path.endswith("/" + plural) and _truthy(r.query.get("watch"))
        ]

    def list_requests(self, plural: str) -> list[RequestRecord]:
        return [
            r
            for r in self.requests
            if r.method == "GET"
            and r.path.endswith("/" + plural)
            and not _truthy(r.query.get("watch"))
        ]

    # ---------------------------------------------------------------- internals

    def _info_of(self, obj: dict[str, Any]) -> ResourceInfo:
        return RESOURCES[PLURAL_OF_KIND[obj["kind"]]]

    def _commit(
        self,
        info: ResourceInfo,
        key: tuple[str, str],
        kind: str,
        obj: dict[str, Any],
        old: dict[str, Any] | None,
    ) -> dict[str, Any]:
        self.resource_version = next(self._rv)
        obj["metadata"]["resourceVersion"] = str(self.resource_version)
        if kind == "DELETED":
            del self._objects[info.plural][key]
        else:
            self._objects[info.plural][key] = obj
        change = Change(self.resource_version, info.plural, kind, obj, old)
        if len(self._history) == self._history.maxlen:
            self._floor = self._history[0].rv
        self._history.append(change)
        for watcher in list(self._watchers - self._frozen):
            if watcher.info.plural == info.plural:
                event = watcher.event_for(change)
                if event is not None:
                    self._offer(watcher, event)
        return copy.deepcopy(obj)

    def _offer(self, watcher: _Watcher, item: dict[str, Any] | bytes | None) -> None:
        try:
            watcher.queue.put_nowait(item)
        except asyncio.QueueFull:  # a slow watcher is cut off, as the API server does
            transport = watcher.request.transport
            if transport is not None:
                transport.abort()

    def _authorized(self, request: web.Request) -> bool:
        return self.token is None or request.headers.get("Authorization") == (
            f"Bearer {self.token}"
        )

    def _json(self, body: dict[str, Any], status: int = 200) -> web.Response:
        return web.Response(body=orjson.dumps(body), status=status,
                            content_type="application/json")

    async def _post_event(self, request: web.Request) -> web.Response:
        self.requests.append(RequestRecord("POST", request.path, dict(request.query)))
        if not self._authorized(request):
            return self._json(_status(401, "Unauthorized", "Unauthorized"), 401)
        body = await request.json()
        if body.get("kind") != "Event" or not body.get("involvedObject"):
            return self._json(_status(422, "Invalid", "not an Event"), 422)
        body.setdefault("metadata", {})["namespace"] = request.match_info["namespace"]
        self.events.append(body)
        return self._json(body, 201)

    async def _collection(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.requests.append(RequestRecord("GET", request.path, query))
        if not self._authorized(request):
            return self._json(_status(401, "Unauthorized", "Unauthorized"), 401)
        plural = request.match_info.get("plural", "pods")
        info = RESOURCES.get(plural)
        group = request.match_info.get("group")
        if info is None or (not info.core and (group, request.match_info["version"]) != (
            GROUP, CRD_VERSION
        )):
            return self._json(_status(404, "NotFound", "the server could not find it"), 404)
        namespace = request.match_info.get("namespace")
        try:
            matches = parse_selector(query.get("labelSelector"))
        except SelectorError as exc:
            return self._json(_status(400, "BadRequest", str(exc)), 400)
        if _truthy(query.get("watch")):
            return await self._watch(request, info, namespace, matches, query)
        return self._list(info, namespace, matches, query)

    def _list(
        self, info: ResourceInfo, namespace: str | None, matches: Requirement,
        query: dict[str, str],
    ) -> web.Response:
        token = query.get("continue")
        if token:
            items = self._continues.pop(token, None)
            if items is None:
                return self._json(_status(410, "Expired", "continue token expired"), 410)
            version = token.split(":", 1)[0]
        else:
            items = []
            for (ns, _), obj in sorted(self._objects[info.plural].items()):
                if namespace is not None and ns != namespace:
                    continue
                if not matches(obj["metadata"].get("labels") or {}):
                    continue
                item = copy.deepcopy(obj)
                if info.core:  # the API server leaves these out of built-in LIST items
                    item.pop("kind", None)
                    item.pop("apiVersion", None)
                items.append(item)
            version = str(self.resource_version)
        metadata: dict[str, Any] = {"resourceVersion": version}
        limit = int(query.get("limit") or 0)
        if limit and len(items) > limit:
            rest_token = f"{version}:{uuid.uuid4().hex}"
            self._continues[rest_token] = items[limit:]
            while len(self._continues) > 32:
                self._continues.pop(next(iter(self._continues)))
            metadata["continue"] = rest_token
            metadata["remainingItemCount"] = len(items) - limit
            items = items[:limit]
        return self._json(
            {
                "kind": f"{info.kind}List",
                "apiVersion": info.api_version,
                "metadata": metadata,
                "items": items,
            }
        )

    async def _watch(
        self,
        request: web.Request,
        info: ResourceInfo,
        namespace: str | None,
        matches: Requirement,
        query: dict[str, str],
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        timeout = min(int(query.get("timeoutSeconds") or self.max_timeout_seconds),
                      self.max_timeout_seconds)
        deadline = loop.time() + timeout
        watcher = _Watcher(info, namespace, matches, request)
        start = query.get("resourceVersion") or ""
        if start in ("", "0"):
            initial = [
                {"type": "ADDED", "object": obj}
                for obj in self._objects[info.plural].values()
                if watcher.wants(obj)
            ]
        elif int(start) < self._floor:
            initial = [{"type": "ERROR", "object": _status(
                410, "Expired", f"too old resource version: {start} ({self._floor})"
            )}]
        else:
            initial = []
            for change in self._history:
                if change.plural == info.plural and change.rv > int(start):
                    event = watcher.event_for(change)
                    if event is not None:
                        initial.append(event)
        # No await between reading the history and registering: nothing falls between.
        for event in initial:
            watcher.queue.put_nowait(event)
        if initial and initial[0]["type"] == "ERROR":
            watcher.queue.put_nowait(None)
        else:
            self._watchers.add(watcher)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        bookmarks = None
        if _truthy(query.get("allowWatchBookmarks")):
            bookmarks = asyncio.create_task(self._bookmarks(watcher))
        try:
            await resp.prepare(request)
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    item = await asyncio.wait_for(watcher.queue.get(), min(remaining, 0.5))
                except TimeoutError:
                    transport = request.transport
                    if transport is None or transport.is_closing():
                        break
                    continue
                if item is None:
                    break
                if isinstance(item, bytes):
                    await resp.write(item)
                else:
                    await resp.write(orjson.dumps(item) + b"\n")
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the client went away or the connection was cut
        finally:
            self._watchers.discard(watcher)
            self._frozen.discard(watcher)
            if bookmarks is not None:
                bookmarks.cancel()
        return resp

    async def _bookmarks(self, watcher: _Watcher) -> None:
        info = watcher.info
        while True:
            await asyncio.sleep(self.bookmark_interval)
            if watcher in self._frozen:
                continue
            self._offer(
                watcher,
                {
                    "type": "BOOKMARK",
                    "object": {
                        "kind": info.kind,
                        "apiVersion": info.api_version,
                        "metadata": {"resourceVersion": str(self.resource_version)},
                    },
                },
            )
