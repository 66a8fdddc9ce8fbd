"""From raw watched objects of one kind to view updates.

An object whose new version is invalid keeps its last good version in the view (a typo
in an edit must not take a model off the air), and is reported once. A LIST replaces the
kind wholesale with `replace_all`, which is what makes a relist after 410 exact: nothing
duplicated, nothing deleted meanwhile left behind.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from router.resources import InvalidObject, Resource, kind_of, parse_object
from router.sources.kube_api import ResourceType
from router.sources.kube_events import ObjectRef
from router.sources.kube_informer import Event
from router.sources.kube_invalid import InvalidReporter
from router.view import ClusterView

log = logging.getLogger(__name__)

#: LISTs larger than this are parsed in a worker thread, off the event loop.
THREAD_PARSE_MIN = 256

_Key = tuple[str, str]
_Parsed = Resource | InvalidObject | None  # None: no usable name at all


class KindHandler:
    """Applies one kind's LISTs and watch events to the view; `good` is the last good state."""

    def __init__(
        self,
        rt: ResourceType,
        view: ClusterView,
        namespace: str | None,
        reporter: InvalidReporter,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.rt = rt
        self.good: dict[_Key, Resource] = {}
        self.listed = False  # a LIST has been applied at least once
        self.on_change = on_change  # called after each LIST or batch of events
        self._view = view
        self._namespace = namespace
        self._reporter = reporter

    async def replace(self, items: list[dict[str, Any]]) -> None:
        if len(items) >= THREAD_PARSE_MIN:
            parsed = await asyncio.to_thread(self._parse_all, items)
        else:
            parsed = self._parse_all(items)
        fresh: dict[_Key, Resource] = {}
        present: set[_Key] = set()
        for raw, result in zip(items, parsed, strict=True):
            key = _key(raw)
            if key is None:
                continue
            present.add(key)
            obj = self._accept(raw, key, result)
            if obj is not None:
                fresh[key] = obj
        self.good = fresh
        self._view.replace_all(self.rt.kind, list(fresh.values()), namespace=self._namespace)
        self._reporter.forget_absent(self.rt.kind, present)
        self.listed = True
        self.on_change()

    def events(self, events: list[Event]) -> None:
        with self._view.batch():
            for kind, raw in events:
                key = _key(raw)
                if key is None:
                    continue
                if kind == "DELETED":
                    self.good.pop(key, None)
                    self._view.delete(self.rt.kind, *key)
                    self._reporter.forget(self.rt.kind, *key)
                    continue
                obj = self._accept(raw, key, self._parse(raw))
                if obj is not None:
                    self.good[key] = obj
                    self._view.apply(obj)
        self.on_change()

    def _parse_all(self, items: list[dict[str, Any]]) -> list[_Parsed]:
        return [self._parse(raw) for raw in items]

    def _parse(self, raw: dict[str, Any]) -> _Parsed:
        """Parse one object (thread-safe: touches nothing but `raw`)."""
        if _key(raw) is None:
            return None
        raw.setdefault("kind", self.rt.kind)
        raw.setdefault("apiVersion", self.rt.api_version)
        try:
            obj = parse_object(raw)
        except InvalidObject as exc:
            return exc
        except Exception as exc:  # a parser bug must not stop discovery
            log.exception("parsing %s %s failed", self.rt.kind, _key(raw))
            return InvalidObject(self.rt.kind, "", f"unexpected parser error: {exc!r}")
        if kind_of(obj) != self.rt.kind:
            reason = f"kind {kind_of(obj)} in a {self.rt.plural} watch"
            return InvalidObject(self.rt.kind, "", reason)
        return obj

    def _accept(self, raw: dict[str, Any], key: _Key, result: _Parsed) -> Resource | None:
        """The object to keep for `key`: the new one if valid, else the last good one."""
        if isinstance(result, InvalidObject):
            meta = raw.get("metadata") or {}
            ref = ObjectRef(
                self.rt.kind, self.rt.api_version, key[0], key[1],
                str(meta.get("uid") or ""), str(meta.get("resourceVersion") or ""),
            )
            self._reporter.invalid(ref, result.reason)
            return self.good.get(key)
        if result is not None:
            self._reporter.forget(self.rt.kind, *key)
        return result


def _key(raw: dict[str, Any]) -> _Key | None:
    meta = raw.get("metadata")
    if not isinstance(meta, dict):
        return None
    name = meta.get("name")
    namespace = meta.get("namespace") or "default"
    if not isinstance(name, str) or not name or not isinstance(namespace, str):
        return None
    return (namespace, name)
