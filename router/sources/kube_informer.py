"""List-then-watch of one resource, owned end to end (client-go's reflector, in small).

LIST gives the full state and a resourceVersion; WATCH from that version gives every
change after it. The loop renews the watch before the server-side timeout, follows
BOOKMARKs, answers a 410 Gone (an `ERROR` event with `code: 410`) with a fresh LIST that
replaces the state wholesale (nothing duplicated, nothing lost), and backs off like
client-go when the API server is unreachable. It never raises except on cancellation:
the last good state stays in the view while the API server is gone.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

import aiohttp
import orjson

from router.sources.kube_api import ApiStatusError, KubeApi, ResourceType
from router.sources.kube_backoff import Backoff, BackoffPolicy
from router.sources.kube_metrics import KubeMetrics

log = logging.getLogger(__name__)

#: The largest watch line we accept (etcd's request limit is 1.5 MiB per object).
MAX_LINE_BYTES = 16 * 1024 * 1024

Event = tuple[str, dict[str, Any]]  # ("ADDED" | "MODIFIED" | "DELETED", raw object)


@dataclass(frozen=True, slots=True)
class WatchTiming:
    min_timeout_s: int = 300  # server-side timeoutSeconds is drawn from [min, max]
    max_timeout_s: int = 600
    connect_timeout_s: float = 10.0
    read_grace_s: float = 30.0  # a silent stream is given up this long after timeoutSeconds
    list_read_timeout_s: float = 60.0
    page_size: int = 500
    min_stream_s: float = 1.0  # a stream ending sooner with no event counts as a failure
    backoff: BackoffPolicy = field(default_factory=BackoffPolicy)


class Handler(Protocol):
    """Applies what an informer reads; exceptions are caught, logged and cause a relist."""

    async def replace(self, items: list[dict[str, Any]]) -> None: ...

    def events(self, events: list[Event]) -> None: ...


class _Restart(Exception):
    """Ends one watch attempt: `reason` is the metric label, `relist` whether to LIST."""

    def __init__(self, reason: str, relist: bool, backoff: bool, detail: str = "") -> None:
        super().__init__(detail or reason)
        self.reason = reason
        self.relist = relist
        self.backoff = backoff


_NETWORK_ERRORS = (aiohttp.ClientError, OSError, TimeoutError)


class Informer:
    """Keeps one resource in sync through a Handler until cancelled."""

    def __init__(
        self,
        rt: ResourceType,
        api: KubeApi,
        handler: Handler,
        *,
        namespace: str | None,
        metrics: KubeMetrics,
        timing: WatchTiming,
        selector: Callable[[], str | None] = lambda: None,
        rng: random.Random | None = None,
    ) -> None:
        self.rt = rt
        self.resource = rt.plural
        self._api = api
        self._handler = handler
        self._namespace = namespace
        self._timing = timing
        self._selector = selector
        self._rng = rng or random.Random()
        self._metrics = metrics
        self._restart_requested = asyncio.Event()
        self._restart_reason = "selector_changed"
        self.synced = False
        self.listed = asyncio.Event()  # set once, with `synced`
        self.resource_version: str | None = None
        self.last_event = time.monotonic()
        self.label_selector: str | None = None  # the selector of the current LIST/WATCH
        metrics.track_resource(self.resource, lambda: self.last_event)

    def restart(self, reason: str = "selector_changed") -> None:
        """Drop the current watch and LIST again (e.g. the pod label selector changed)."""
        self._restart_reason = reason
        self._restart_requested.set()

    async def run(self) -> None:
        backoff = Backoff(self._timing.backoff, self._rng)
        relist = True
        while True:
            try:
                if relist:
                    self._restart_requested.clear()
                    await self._list()
                    relist = False
                await self._watch_once()
            except _Restart as stop:
                outcome = stop
            except asyncio.CancelledError:
                raise
            except ApiStatusError as exc:
                expired = exc.status == 410
                outcome = _Restart(
                    "expired" if expired else "http_error",
                    relist=expired, backoff=not expired, detail=str(exc),
                )
            except _NETWORK_ERRORS as exc:
                outcome = _Restart(
                    "unreachable", relist=False, backoff=True,
                    detail=f"{type(exc).__name__}: {exc}",
                )
            except Exception as exc:
                log.exception("%s informer: applying objects failed; relisting", self.resource)
                outcome = _Restart("internal", relist=True, backoff=True, detail=repr(exc))
            relist = relist or outcome.relist
            self._metrics.watch_restarts.labels(self.resource, outcome.reason).inc()
            if outcome.backoff:
                delay = backoff.next_delay()
                log.warning(
                    "%s watch restart (%s: %s); retrying in %.2fs",
                    self.resource, outcome.reason, outcome, delay,
                )
                await asyncio.sleep(delay)
            else:
                log.debug("%s watch restart (%s: %s)", self.resource, outcome.reason, outcome)

    async def _list(self) -> None:
        selector = self._selector()
        items: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            page = await self._api.list(
                self.rt,
                self._namespace,
                label_selector=selector,
                limit=self._timing.page_size,
                continue_token=token,
                read_timeout_s=self._timing.list_read_timeout_s,
            )
            items.extend(page.get("items") or ())
            meta = page.get("metadata") or {}
            token = meta.get("continue") or None
            if token is None:
                break
        version = meta.get("resourceVersion")
        if not isinstance(version, str) or not version:
            raise _Restart("malformed", relist=True, backoff=True,
                           detail="LIST without metadata.resourceVersion")
        for item in items:  # LIST items of built-in kinds carry no kind/apiVersion
            item.setdefault("kind", self.rt.kind)
            item.setdefault("apiVersion", self.rt.api_version)
        await self._handler.replace(items)
        self.label_selector = selector
        self.resource_version = version
        self.last_event = time.monotonic()
        if not self.synced:
            log.info("%s: listed %d objects; synced", self.resource, len(items))
        self.synced = True
        self.listed.set()

    async def _watch_once(self) -> NoReturn:
        """One watch attempt, raced against a restart request; always raises _Restart."""
        watch = asyncio.ensure_future(self._watch())
        restart = asyncio.ensure_future(self._restart_requested.wait())
        try:
            await asyncio.wait((watch, restart), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (watch, restart):
                task.cancel()
            await asyncio.gather(watch, restart, return_exceptions=True)
        if restart.done() and not restart.cancelled():
            raise _Restart(self._restart_reason, relist=True, backoff=False)
        watch.result()  # re-raises _Restart or the error that ended the watch
        raise AssertionError("unreachable: _watch always raises")

    async def _watch(self) -> NoReturn:
        assert self.resource_version is not None
        timing = self._timing
        timeout_s = self._rng.randint(timing.min_timeout_s, timing.max_timeout_s)
        resp = await self._api.watch(
            self.rt,
            self._namespace,
            label_selector=self.label_selector,
            resource_version=self.resource_version,
            timeout_seconds=timeout_s,
            read_timeout_s=timeout_s + timing.read_grace_s,
        )
        started = time.monotonic()
        events_seen = False
        try:
            async for lines in _line_batches(resp.content):
                self._take(lines)
                events_seen = True
            stop = _Restart("closed", relist=False, backoff=False)
        except _Restart as exc:
            stop = exc
        except _NETWORK_ERRORS as exc:
            stop = _Restart(
                "dropped", relist=False, backoff=True, detail=f"{type(exc).__name__}: {exc}"
            )
        finally:
            resp.release()
        if not events_seen and time.monotonic() - started < timing.min_stream_s:
            stop.backoff = True  # ended at once, e.g. 410 right after a LIST: do not spin
        raise stop

    def _take(self, lines: list[bytes]) -> None:
        """Apply one read's worth of watch lines; an ERROR still applies what preceded it."""
        batch: list[Event] = []
        version = self.resource_version
        try:
            for line in lines:
                kind, obj = _decode(line)
                if kind == "ERROR":
                    raise _error_event(obj)
                version = _version_of(obj) or version
                if kind != "BOOKMARK":
                    batch.append((kind, obj))
        finally:
            if batch:
                self._handler.events(batch)
            # resourceVersion moves only once the handler has taken the events.
            self.resource_version = version
            self.last_event = time.monotonic()


def _decode(line: bytes) -> tuple[str, dict[str, Any]]:
    try:
        event = orjson.loads(line)
        kind = event["type"]
        obj = event["object"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        raise _Restart("malformed", relist=True, backoff=True,
                       detail=f"not a watch event: {line[:200]!r}") from None
    if kind not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR") or not isinstance(
        obj, dict
    ):
        raise _Restart("malformed", relist=True, backoff=True,
                       detail=f"unknown watch event {str(kind)[:40]!r}")
    return kind, obj


def _version_of(obj: dict[str, Any]) -> str | None:
    meta = obj.get("metadata")
    version = meta.get("resourceVersion") if isinstance(meta, dict) else None
    return version if isinstance(version, str) and version else None


def _error_event(status: dict[str, Any]) -> _Restart:
    detail = f"{status.get('reason')}: {status.get('message')}"
    if status.get("code") == 410:
        return _Restart("expired", relist=True, backoff=False, detail=detail)
    return _Restart("error_event", relist=True, backoff=True, detail=detail)


async def _line_batches(stream: aiohttp.StreamReader) -> AsyncIterator[list[bytes]]:
    """The complete JSON lines of each chunk as it arrives (one batch per read)."""
    pending = bytearray()
    async for chunk in stream.iter_any():
        pending += chunk
        if b"\n" not in chunk:
            if len(pending) > MAX_LINE_BYTES:
                raise _Restart("malformed", relist=True, backoff=True,
                               detail=f"watch line over {MAX_LINE_BYTES} bytes")
            continue
        *lines, rest = pending.split(b"\n")
        pending = bytearray(rest)
        batch = [bytes(line) for line in lines if line.strip()]
        if batch:
            yield batch
    if pending.strip():
        yield [bytes(pending)]
