"""Discovery from a directory of Kubernetes-style YAML manifests.

Every `*.yaml`/`*.yml` below the directory is read (multi-document files included);
ModelRoute, ModelServer and Pod documents feed the view and other kinds (scheduler
config, ConfigMaps, ...) are skipped silently, so one directory can hold a whole
deployment. The directory is polled by stat signature (cheap, no dependency) and on
any change re-read and applied in one `batch()`, so a snapshot never shows half an edit.

Age. A file object has no API server to stamp it, so the reader gives every object
without `metadata.creationTimestamp` the time it first saw it, and keeps that time
across re-reads (and moves between files) until the object leaves the directory. Two
ModelRoutes claiming one `modelName` are thus ordered as in Kubernetes: the older keeps
the traffic, whichever name sorts first (objects read together share a time; then
namespace/name decides, as for equal creationTimestamps).

A file is applied whole, or not at all. A write caught half-way shows either as YAML
that does not parse or as a document that fails validation (a cut IP, a missing
required field). Either way, if the file validated before, all of its last good objects
stay served, the failure is logged and counted (`pdgate_config_file_errors_total`), and
`pdgate_config_files_held` counts the files served from such a last good reading; the
next complete write is picked up. A new file that never validated contributes its valid
documents only. A truncation that leaves valid YAML of valid objects (a file cut at a
document boundary) cannot be told from an edit and is applied; the router then logs the
ModelServers that lost their pods. A deleted file's objects are removed, with a warning.
Writers should write a temporary file and rename it, as kubelet and editors do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge

from router.resources import (
    KINDS,
    InvalidObject,
    Resource,
    format_timestamp,
    kind_of,
    parse_object,
)
from router.view import ClusterView

log = logging.getLogger(__name__)

SUFFIXES = (".yaml", ".yml")
#: Nested `kind: List` documents deeper than this are ignored (guards recursion).
_MAX_LIST_DEPTH = 4

# (st_mtime_ns, st_size, st_ino, st_ctime_ns): any rewrite, even an atomic rename, moves one.
Signature = tuple[int, int, int, int]
ObjectKey = tuple[str, str, str]  # (kind, namespace, name)


#: Why a file's reading was refused (the `reason` label of the error counter).
FILE_ERROR_REASONS = ("unreadable", "yaml", "invalid")


@dataclass(slots=True)
class _FileEntry:
    """What one file last yielded: its good objects survive a later broken write."""

    signature: Signature
    objects: dict[ObjectKey, Resource] = field(default_factory=dict)
    held: bool = False  # the last reading was refused: these objects are an older one's


@dataclass(slots=True)
class LoadResult:
    """One consistent reading of the directory, ready to apply to a view."""

    objects: dict[str, list[Resource]]  # by kind, every kind present (maybe empty)
    invalid: list[InvalidObject]  # newly found problems, to report once
    #: Files read now whose reading was refused, with the reason (FILE_ERROR_REASONS).
    file_errors: list[tuple[Path, str]] = field(default_factory=list)
    held: int = 0  # files served from an earlier, good reading


def _key(obj: Resource) -> ObjectKey:
    return (kind_of(obj), obj.meta.namespace, obj.meta.name)


def _documents(doc: object, depth: int = 0) -> Iterator[Mapping[str, Any]]:
    """Yield manifests, expanding `kind: List` (what `kubectl get -o yaml` writes)."""
    if not isinstance(doc, Mapping):
        return
    items = doc.get("items")
    kind = doc.get("kind")
    if isinstance(kind, str) and kind.endswith("List") and isinstance(items, list):
        if depth < _MAX_LIST_DEPTH:
            for item in items:
                yield from _documents(item, depth + 1)
        return
    yield doc


class DirectoryReader:
    """Reads a directory into objects, remembering each file's last good state.

    Blocking (file I/O and YAML parsing): the source calls it through `to_thread`.
    Not thread-safe; one reading at a time.
    """

    def __init__(
        self, directory: Path, now: Callable[[], datetime] = lambda: datetime.now(UTC)
    ) -> None:
        self.directory = directory
        self._now = now
        self._files: dict[Path, _FileEntry] = {}
        self._last_scan: dict[Path, Signature] | None = None
        #: When each object without a creationTimestamp was first seen (its age); only
        #: objects present in the directory are kept, so it is bounded by them.
        self._first_seen: dict[ObjectKey, str] = {}
        self._stamp = ""  # this reading's time, for objects seen for the first time

    def scan(self) -> dict[Path, Signature]:
        """Stat every manifest file; hidden entries (editor swaps, ConfigMap `..data`) skipped."""
        found: dict[Path, Signature] = {}
        root = self.directory
        if root.is_file():
            candidates: list[Path] = [root]
        else:
            candidates = []
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                for name in filenames:
                    if not name.startswith(".") and name.endswith(SUFFIXES):
                        candidates.append(Path(dirpath) / name)
        for path in candidates:
            try:
                st = path.stat()
            except OSError:
                continue  # vanished or a dangling symlink: absent
            found[path] = (st.st_mtime_ns, st.st_size, st.st_ino, st.st_ctime_ns)
        return dict(sorted(found.items()))

    def poll(self) -> LoadResult | None:
        """Re-read the directory if anything changed since the last reading, else None."""
        scan = self.scan()
        if scan == self._last_scan:
            return None
        return self._load(scan)

    def load(self) -> LoadResult:
        """Read the directory now, re-parsing only files whose signature changed."""
        return self._load(self.scan())

    def _load(self, scan: dict[Path, Signature]) -> LoadResult:
        invalid: list[InvalidObject] = []
        errors: list[tuple[Path, str]] = []
        files: dict[Path, _FileEntry] = {}
        self._stamp = format_timestamp(self._now())
        for path, signature in scan.items():
            previous = self._files.get(path)
            if previous is not None and previous.signature == signature:
                files[path] = previous
            else:
                files[path] = self._read(path, signature, previous, invalid, errors)
        for path, entry in self._files.items():
            if path not in files and entry.objects:
                log.warning("%s is gone: its %d objects are removed", path, len(entry.objects))
        self._files = files
        self._last_scan = scan

        merged: dict[str, list[Resource]] = {kind: [] for kind in KINDS}
        owner: dict[ObjectKey, Path] = {}
        for path, entry in files.items():
            for key, obj in entry.objects.items():
                first = owner.get(key)
                if first is not None:
                    invalid.append(
                        InvalidObject(
                            key[0],
                            f"{key[1]}/{key[2]}",
                            f"defined again in {path}; keeping the one in {first}",
                        )
                    )
                    continue
                owner[key] = path
                merged[key[0]].append(obj)
        for key in [k for k in self._first_seen if k not in owner]:
            del self._first_seen[key]  # gone: if it comes back, it is a new object
        return LoadResult(
            objects=merged,
            invalid=invalid,
            file_errors=errors,
            held=sum(1 for entry in files.values() if entry.held),
        )

    def _read(
        self,
        path: Path,
        signature: Signature,
        previous: _FileEntry | None,
        invalid: list[InvalidObject],
        errors: list[tuple[Path, str]],
    ) -> _FileEntry:
        kept = previous.objects if previous is not None else {}
        try:
            text = path.read_text(encoding="utf-8")
            docs = list(yaml.safe_load_all(text))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            # Most likely a write in progress: keep what the file said last time. The
            # signature was taken before the read, so finishing the write changes it
            # and the next poll reads the file again.
            reason = "yaml" if isinstance(exc, yaml.YAMLError) else "unreadable"
            errors.append((path, reason))
            log.warning("cannot read %s (keeping its %d previous objects): %s",
                        path, len(kept), exc)
            return _FileEntry(signature=signature, objects=dict(kept), held=bool(kept))
        objects: dict[ObjectKey, Resource] = {}
        refused: list[InvalidObject] = []
        for raw in docs:
            for doc in _documents(raw):
                kind = doc.get("kind")
                if kind not in KINDS:
                    continue  # another kind of document: not ours, not an error
                try:
                    obj = parse_object(dict(doc))
                except InvalidObject as exc:
                    refused.append(InvalidObject(exc.kind, exc.name, f"{exc.reason} (in {path})"))
                    continue
                objects[_key(obj)] = self._aged(obj)
        invalid.extend(refused)
        if refused:
            errors.append((path, "invalid"))
            if kept:
                # Maybe a write caught half-way (a cut value fails validation): serve the
                # file's last good reading whole rather than the part that validated.
                log.warning("%s has %d invalid documents: keeping its %d objects of the "
                            "last good reading", path, len(refused), len(kept))
                return _FileEntry(signature=signature, objects=dict(kept), held=True)
        return _FileEntry(signature=signature, objects=objects)

    def _aged(self, obj: Resource) -> Resource:
        """`obj` with its creationTimestamp, or the time the reader first saw it."""
        if obj.meta.creation_timestamp:
            return obj
        key = _key(obj)
        stamp = self._first_seen.setdefault(key, self._stamp)
        return dataclasses.replace(
            obj, meta=dataclasses.replace(obj.meta, creation_timestamp=stamp)
        )


def apply_result(view: ClusterView, result: LoadResult) -> None:
    """Publish one reading: every kind replaced inside one batch, then problems reported."""
    with view.batch():
        for kind in KINDS:
            view.replace_all(kind, result.objects[kind])
    for exc in result.invalid:
        view.report_invalid(exc.kind, exc.name, exc.reason)


def load_directory(directory: Path, view: ClusterView) -> LoadResult:
    """Read a directory once, synchronously, into `view` (for CLI tools and tests)."""
    result = DirectoryReader(directory).load()
    apply_result(view, result)
    return result


class FileMetrics:
    """`pdgate_config_file_errors_total{reason}` and `pdgate_config_files_held`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.errors = Counter(
            "pdgate_config_file_errors",
            "Config file readings refused, by reason (unreadable, yaml, invalid): "
            "counted once per version of a file.",
            ["reason"], registry=registry,
        )
        for reason in FILE_ERROR_REASONS:
            self.errors.labels(reason=reason)
        self.held = Gauge(
            "pdgate_config_files_held",
            "Config files whose latest version was refused and whose last good "
            "reading is still served.",
            registry=registry,
        )

    def observe(self, result: LoadResult) -> None:
        for _, reason in result.file_errors:
            self.errors.labels(reason=reason).inc()
        self.held.set(result.held)


class FileSource:
    """A `Source` fed by a directory of YAML manifests, polled for changes.

    It owns every ModelRoute, ModelServer and Pod in the view (each reading replaces
    them all), so it should not share a view's kinds with another source.
    """

    def __init__(
        self,
        directory: Path,
        poll_interval: float = 0.5,
        registry: CollectorRegistry | None = None,
    ) -> None:
        if poll_interval <= 0:
            raise ValueError("poll_interval must be positive")
        self.directory = Path(directory)
        self.poll_interval = poll_interval
        self._reader = DirectoryReader(self.directory)
        self._synced = False
        self._metrics = FileMetrics(registry) if registry is not None else None

    @property
    def synced(self) -> bool:
        return self._synced

    async def run(self, view: ClusterView) -> None:
        if not self.directory.exists():
            log.warning("config directory %s does not exist (yet): watching for it",
                        self.directory)
        while True:
            try:
                # Stat, read and parse off the event loop: only the apply runs on it.
                if self._synced:
                    result = await asyncio.to_thread(self._reader.poll)
                else:
                    result = await asyncio.to_thread(self._reader.load)
            except Exception:
                log.exception("reading %s failed; retrying", self.directory)
                result = None
            if result is not None:
                apply_result(view, result)
                if self._metrics is not None:
                    self._metrics.observe(result)
                if not self._synced:
                    self._synced = True
                    log.info("loaded %s: %s", self.directory, {
                        kind: len(objs) for kind, objs in result.objects.items()
                    })
            await asyncio.sleep(self.poll_interval)


__all__ = [
    "DirectoryReader", "FileMetrics", "FileSource", "LoadResult", "apply_result",
    "load_directory",
]
