"""Discovery from a directory of Kubernetes-style YAML manifests.

Every `*.yaml`/`*.yml` below the directory is read (multi-document files included);
ModelRoute, ModelServer and Pod documents feed the view and other kinds (scheduler
config, ConfigMaps, ...) are skipped silently, so one directory can hold a whole
deployment. The directory is polled by stat signature (cheap, no dependency) and on
any change re-read and applied in one `batch()`, so a snapshot never shows half an edit.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from router.resources import (
    KINDS,
    InvalidObject,
    Resource,
    kind_of,
    object_name,
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


@dataclass(slots=True)
class _FileEntry:
    """What one file last yielded: its good objects survive a later broken write."""

    signature: Signature
    objects: dict[ObjectKey, Resource] = field(default_factory=dict)


@dataclass(slots=True)
class LoadResult:
    """One consistent reading of the directory, ready to apply to a view."""

    objects: dict[str, list[Resource]]  # by kind, every kind present (maybe empty)
    invalid: list[InvalidObject]  # newly found problems, to report once


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

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._files: dict[Path, _FileEntry] = {}
        self._last_scan: dict[Path, Signature] | None = None

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
        files: dict[Path, _FileEntry] = {}
        for path, signature in scan.items():
            previous = self._files.get(path)
            if previous is not None and previous.signature == signature:
                files[path] = previous
            else:
                files[path] = self._read(path, signature, previous, invalid)
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
        return LoadResult(objects=merged, invalid=invalid)

    def _read(
        self,
        path: Path,
        signature: Signature,
        previous: _FileEntry | None,
        invalid: list[InvalidObject],
    ) -> _FileEntry:
        kept = previous.objects if previous is not None else {}
        try:
            text = path.read_text(encoding="utf-8")
            docs = list(yaml.safe_load_all(text))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            # Most likely a write in progress: keep what the file said last time. The
            # signature was taken before the read, so finishing the write changes it
            # and the next poll reads the file again.
            log.warning("cannot read %s (keeping its %d previous objects): %s",
                        path, len(kept), exc)
            return _FileEntry(signature=signature, objects=dict(kept))
        objects: dict[ObjectKey, Resource] = {}
        for raw in docs:
            for doc in _documents(raw):
                kind = doc.get("kind")
                if kind not in KINDS:
                    continue  # another kind of document: not ours, not an error
                try:
                    obj = parse_object(dict(doc))
                except InvalidObject as exc:
                    invalid.append(InvalidObject(exc.kind, exc.name, f"{exc.reason} (in {path})"))
                    # Keep this object's last good version, as the API server would.
                    namespace, _, name = object_name(doc).partition("/")
                    last_good = kept.get((str(kind), namespace, name))
                    if last_good is not None:
                        objects[_key(last_good)] = last_good
                    continue
                objects[_key(obj)] = obj
        return _FileEntry(signature=signature, objects=objects)


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


class FileSource:
    """A `Source` fed by a directory of YAML manifests, polled for changes.

    It owns every ModelRoute, ModelServer and Pod in the view (each reading replaces
    them all), so it should not share a view's kinds with another source.
    """

    def __init__(self, directory: Path, poll_interval: float = 0.5) -> None:
        if poll_interval <= 0:
            raise ValueError("poll_interval must be positive")
        self.directory = Path(directory)
        self.poll_interval = poll_interval
        self._reader = DirectoryReader(self.directory)
        self._synced = False

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
                if not self._synced:
                    self._synced = True
                    log.info("loaded %s: %s", self.directory, {
                        kind: len(objs) for kind, objs in result.objects.items()
                    })
            await asyncio.sleep(self.poll_interval)


__all__ = ["DirectoryReader", "FileSource", "LoadResult", "apply_result", "load_directory"]
