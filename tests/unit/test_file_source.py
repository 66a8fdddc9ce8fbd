"""The YAML-directory source: loading, skipping, reporting, and following edits."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from router.resources import API_VERSION
from router.sources.base import Source
from router.sources.files import DirectoryReader, FileSource, apply_result, load_directory
from router.view import ClusterView, Snapshot
from tests.fixtures import KTHENA_PD_EXAMPLE

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "config"
FIXTURE = KTHENA_PD_EXAMPLE

ROUTE = f"""
apiVersion: {API_VERSION}
kind: ModelRoute
metadata:
  name: llama
spec:
  modelName: llama
  rules:
  - name: default
    targetModels:
    - modelServerName: llama-ms
"""

SERVER = f"""
apiVersion: {API_VERSION}
kind: ModelServer
metadata:
  name: llama-ms
spec:
  inferenceEngine: vLLM
  workloadSelector:
    matchLabels:
      app: llama
  workloadPort:
    port: 8000
"""


def pod_yaml(name: str, ip: str, app: str = "llama") -> str:
    return f"""
apiVersion: v1
kind: Pod
metadata:
  name: {name}
  labels:
    app: {app}
status:
  phase: Running
  podIP: {ip}
  conditions:
  - type: Ready
    status: "True"
"""


def write(path: Path, text: str) -> None:
    """Write atomically (temp file + rename), as editors and kubelet do."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def pods_of(snapshot: Snapshot, key: tuple[str, str] = ("default", "llama-ms")) -> list[str]:
    server = snapshot.servers.get(key)
    return [] if server is None else [e.pod_name for e in server.aggregated]


async def wait_for(predicate: Callable[[], bool], within: float = 2.0) -> float:
    """Wait until `predicate()` holds (at most `within` seconds); return how long it took."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > within:
            raise AssertionError(f"condition not met within {within} s")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


@contextlib.asynccontextmanager
async def running(source: FileSource, view: ClusterView) -> AsyncIterator[None]:
    task = asyncio.create_task(source.run(view))
    try:
        await wait_for(lambda: source.synced)
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# --------------------------------------------------------------------------- one-shot load


def test_shipped_config_loads_unchanged_with_two_groups() -> None:
    assert (CONFIG / "kthena-pd-example.yaml").read_bytes() == FIXTURE.read_bytes()
    view = ClusterView()
    result = load_directory(CONFIG, view)
    assert result.invalid == []
    snap = view.snapshot
    assert snap.model_names() == ["deepseek_v4"]
    server = snap.servers[("default", "deepseekv4-pd")]
    assert server.is_pd and snap.ambiguous_pods == 0
    assert [g.group for g in server.groups] == ["deepseekv4-pd-0", "deepseekv4-pd-1"]
    addresses = {
        g.group: ([e.base_url for e in g.prefill], [e.base_url for e in g.decode])
        for g in server.groups
    }
    assert addresses == {
        "deepseekv4-pd-0": (["http://127.0.0.11:7100"], ["http://127.0.0.12:7100"]),
        "deepseekv4-pd-1": (["http://127.0.0.21:7100"], ["http://127.0.0.22:7100"]),
    }


def test_multi_document_nested_other_kinds_and_invalid(tmp_path: Path) -> None:
    write(tmp_path / "routes.yaml", ROUTE + "---\n" + """
apiVersion: v1
kind: ConfigMap
metadata:
  name: scheduler
data:
  x: y
---
# an empty document
---
""" + SERVER)
    write(tmp_path / "nested" / "deeper" / "pods.yml", pod_yaml("p1", "10.0.0.1") + "---\n"
          + pod_yaml("p2", "10.0.0.2"))
    bad_server = SERVER.replace("name: llama-ms", "name: broken").replace("8000", "70000")
    write(tmp_path / "bad.yaml", bad_server + "---\n" + pod_yaml("p3", "10.0.0.3"))
    write(tmp_path / "scheduler.yaml", "pluginConfig:\n- name: least-request\n")
    write(tmp_path / "notes.txt", ROUTE.replace("llama", "ignored"))
    write(tmp_path / ".hidden" / "x.yaml", ROUTE.replace("llama", "hidden"))
    view = ClusterView()
    load_directory(tmp_path, view)
    snap = view.snapshot
    assert snap.model_names() == ["llama"]
    assert pods_of(snap) == ["p1", "p2", "p3"]
    assert ("default", "broken") not in snap.servers
    # Only the broken ModelServer is reported, with its name and the file it came from.
    assert view.invalid_counts == {"ModelServer": 1}
    record = view.recent_invalid[0]
    assert record.name == "default/broken"
    assert "workloadPort.port" in record.reason and "bad.yaml" in record.reason


def test_kind_list_is_expanded(tmp_path: Path) -> None:
    items = "".join(
        "\n- " + pod_yaml(name, ip).strip().replace("\n", "\n  ")
        for name, ip in (("a", "10.0.0.1"), ("b", "10.0.0.2"))
    )
    write(tmp_path / "list.yaml", "apiVersion: v1\nkind: List\nitems:" + items + "\n")
    write(tmp_path / "s.yaml", SERVER)
    view = ClusterView()
    load_directory(tmp_path, view)
    assert pods_of(view.snapshot) == ["a", "b"]


def test_duplicate_across_files_keeps_first(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", SERVER)
    write(tmp_path / "b.yaml", SERVER.replace("8000", "9000"))
    view = ClusterView()
    load_directory(tmp_path, view)
    assert view.snapshot.servers[("default", "llama-ms")].server.port == 8000
    assert view.invalid_counts == {"ModelServer": 1}
    assert "defined again" in view.recent_invalid[0].reason


def test_missing_directory_loads_nothing(tmp_path: Path) -> None:
    view = ClusterView()
    load_directory(tmp_path / "absent", view)
    assert view.snapshot.servers == {} and view.invalid_counts == {}


def test_reader_keeps_file_state_when_yaml_breaks(tmp_path: Path) -> None:
    reader = DirectoryReader(tmp_path)
    write(tmp_path / "s.yaml", SERVER)
    assert len(reader.load().objects["ModelServer"]) == 1
    assert reader.poll() is None  # nothing changed: no reading at all
    (tmp_path / "s.yaml").write_text(SERVER[: len(SERVER) // 2] + "\n  : [unclosed")
    result = reader.poll()
    assert result is not None and len(result.objects["ModelServer"]) == 1


def test_file_source_is_a_source(tmp_path: Path) -> None:
    source: Source = FileSource(tmp_path)
    assert source.synced is False
    with pytest.raises(ValueError):
        FileSource(tmp_path, poll_interval=0)


# --------------------------------------------------------------------------- following edits


async def test_picks_up_added_server_and_removed_pod(tmp_path: Path) -> None:
    write(tmp_path / "route.yaml", ROUTE)
    write(tmp_path / "pods.yaml", pod_yaml("p1", "10.0.0.1") + "---\n" + pod_yaml("p2", "10.0.0.2"))
    view = ClusterView()
    source = FileSource(tmp_path)  # the default 0.5 s poll
    async with running(source, view):
        assert view.snapshot.model_names() == ["llama"]
        assert view.snapshot.servers == {}

        write(tmp_path / "servers" / "llama-ms.yaml", SERVER)
        took = await wait_for(lambda: pods_of(view.snapshot) == ["p1", "p2"])
        assert took < 2.0

        write(tmp_path / "pods.yaml", pod_yaml("p1", "10.0.0.1"))
        took = await wait_for(lambda: pods_of(view.snapshot) == ["p1"])
        assert took < 2.0

        (tmp_path / "servers" / "llama-ms.yaml").unlink()
        await wait_for(lambda: view.snapshot.servers == {})


async def test_one_snapshot_per_reload(tmp_path: Path) -> None:
    write(tmp_path / "all.yaml", ROUTE + "---\n" + SERVER + "---\n" + pod_yaml("p1", "10.0.0.1"))
    view = ClusterView()
    snapshots: list[Snapshot] = []
    view.subscribe(snapshots.append)
    source = FileSource(tmp_path, poll_interval=0.05)
    async with running(source, view):
        assert len(snapshots) == 1
        # One edit touching all three kinds is published as a single snapshot.
        write(tmp_path / "all.yaml", ROUTE.replace("modelName: llama", "modelName: llama2")
              + "---\n" + SERVER.replace("8000", "8001") + "---\n" + pod_yaml("p9", "10.0.0.9"))
        await wait_for(lambda: len(snapshots) == 2)
        await asyncio.sleep(0.2)
        assert len(snapshots) == 2
        snap = snapshots[-1]
        assert snap.model_names() == ["llama2"]
        assert pods_of(snap) == ["p9"]
        assert snap.servers[("default", "llama-ms")].aggregated[0].port == 8001


async def test_broken_file_keeps_last_good_state(tmp_path: Path) -> None:
    write(tmp_path / "route.yaml", ROUTE)
    write(tmp_path / "server.yaml", SERVER)
    write(tmp_path / "pods.yaml", pod_yaml("p1", "10.0.0.1"))
    view = ClusterView()
    source = FileSource(tmp_path, poll_interval=0.05)
    async with running(source, view):
        assert pods_of(view.snapshot) == ["p1"]
        generation = view.generation

        # A write in progress: not YAML at all. The file's last good objects stay.
        (tmp_path / "server.yaml").write_text(SERVER + "\n  workloadPort: [unclosed\n")
        await asyncio.sleep(0.3)
        assert pods_of(view.snapshot) == ["p1"]
        assert view.generation == generation

        # Valid YAML but an invalid object: reported, and its last good version kept.
        write(tmp_path / "server.yaml", SERVER.replace("8000", "0"))
        await wait_for(lambda: view.invalid_counts.get("ModelServer", 0) == 1)
        assert view.snapshot.servers[("default", "llama-ms")].server.port == 8000
        assert pods_of(view.snapshot) == ["p1"]

        # Other files keep being followed meanwhile, and a fix is picked up.
        write(tmp_path / "pods.yaml", pod_yaml("p1", "10.0.0.1") + "---\n"
              + pod_yaml("p2", "10.0.0.2"))
        await wait_for(lambda: pods_of(view.snapshot) == ["p1", "p2"])
        write(tmp_path / "server.yaml", SERVER.replace("8000", "8080"))
        await wait_for(
            lambda: view.snapshot.servers[("default", "llama-ms")].server.port == 8080
        )


async def test_starts_on_missing_directory_and_follows_it(tmp_path: Path) -> None:
    directory = tmp_path / "later"
    view = ClusterView()
    source = FileSource(directory, poll_interval=0.05)
    async with running(source, view):
        assert view.snapshot.servers == {}
        shutil.copytree(CONFIG, directory)
        await wait_for(lambda: len(view.snapshot.servers) == 1)


# --------------------------------------------------------------------------- age and halves


class StepClock:
    """A wall clock that moves one second per reading, so every reading has its own age."""

    def __init__(self) -> None:
        self.now = datetime(2025, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        self.now += timedelta(seconds=1)
        return self.now


def routed(view: ClusterView, model: str = "llama") -> str:
    return view.snapshot.routes_by_model[model].meta.name


def test_a_younger_route_never_takes_a_model_name(tmp_path: Path) -> None:
    reader = DirectoryReader(tmp_path, now=StepClock())
    view = ClusterView()
    write(tmp_path / "a.yaml", ROUTE.replace("name: llama\n", "name: zz-first\n"))
    apply_result(view, reader.load())
    assert routed(view) == "zz-first"

    # A second route for the same model, whose name sorts first, appears later: the
    # first one keeps the traffic (it is older), and the newcomer is listed as shadowed.
    write(tmp_path / "b.yaml", ROUTE.replace("name: llama\n", "name: aa-later\n"))
    apply_result(view, reader.load())
    assert routed(view) == "zz-first"
    assert [(s.route.meta.name, s.winner.meta.name) for s in view.snapshot.shadowed] == [
        ("aa-later", "zz-first")
    ]
    # Its age survives an edit of its file and a move to another file.
    write(tmp_path / "a.yaml", ROUTE.replace("name: llama\n", "name: zz-first\n")
          .replace("  - name: default", "  - name: edited"))
    apply_result(view, reader.load())
    assert routed(view) == "zz-first"
    (tmp_path / "a.yaml").rename(tmp_path / "c.yaml")
    apply_result(view, reader.load())
    assert routed(view) == "zz-first"

    # Gone and back: a new object, now younger than the other one.
    (tmp_path / "c.yaml").unlink()
    apply_result(view, reader.load())
    assert routed(view) == "aa-later" and view.snapshot.shadowed == ()
    write(tmp_path / "c.yaml", ROUTE.replace("name: llama\n", "name: zz-first\n"))
    apply_result(view, reader.load())
    assert routed(view) == "aa-later"

    # A creationTimestamp written in the YAML is the object's age.
    write(tmp_path / "d.yaml", ROUTE.replace(
        "name: llama\n", "name: kept\n  creationTimestamp: 2020-01-01T00:00:00Z\n", 1))
    apply_result(view, reader.load())
    assert routed(view) == "kept"


def test_objects_read_together_share_an_age_and_tie_on_name(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", ROUTE.replace("name: llama\n", "name: b\n"))
    write(tmp_path / "b.yaml", ROUTE.replace("name: llama\n", "name: a\n"))
    view = ClusterView()
    load_directory(tmp_path, view)
    assert routed(view) == "a"


PODS_3 = pod_yaml("p1", "10.0.0.1") + "---\n" + pod_yaml("p2", "10.0.0.2") + "---\n" + pod_yaml(
    "p3", "10.0.0.3")


def test_a_file_cut_mid_write_keeps_its_whole_last_reading(tmp_path: Path) -> None:
    reader = DirectoryReader(tmp_path)
    write(tmp_path / "s.yaml", SERVER)
    write(tmp_path / "pods.yaml", PODS_3)
    view = ClusterView()
    apply_result(view, reader.load())
    assert pods_of(view.snapshot) == ["p1", "p2", "p3"]

    # Cut inside the first pod's IP: valid YAML, one invalid Pod, two pods missing.
    (tmp_path / "pods.yaml").write_text(PODS_3[: PODS_3.index("10.0.0.1") + 5])
    result = reader.poll()
    assert result is not None
    apply_result(view, result)
    assert pods_of(view.snapshot) == ["p1", "p2", "p3"]
    assert result.file_errors == [(tmp_path / "pods.yaml", "invalid")] and result.held == 1
    assert "not an IP address" in view.recent_invalid[-1].reason

    # Cut so that the YAML does not parse: the same.
    (tmp_path / "pods.yaml").write_text(PODS_3[: PODS_3.index("conditions") + 13] + "[x")
    result = reader.poll()
    assert result is not None and result.file_errors == [(tmp_path / "pods.yaml", "yaml")]
    apply_result(view, result)
    assert pods_of(view.snapshot) == ["p1", "p2", "p3"]

    # The complete write is applied as it is, and nothing is held any more.
    write(tmp_path / "pods.yaml", pod_yaml("p2", "10.0.0.2"))
    result = reader.poll()
    assert result is not None and result.file_errors == [] and result.held == 0
    apply_result(view, result)
    assert pods_of(view.snapshot) == ["p2"]


def test_a_new_file_with_an_invalid_document_serves_its_valid_ones(tmp_path: Path) -> None:
    write(tmp_path / "s.yaml", SERVER)
    write(tmp_path / "pods.yaml", pod_yaml("p1", "10.0.0.1") + "---\n" + pod_yaml("p2", "10.0."))
    view = ClusterView()
    result = load_directory(tmp_path, view)
    assert pods_of(view.snapshot) == ["p1"]
    assert result.file_errors == [(tmp_path / "pods.yaml", "invalid")] and result.held == 0


async def test_file_errors_are_counted_once_per_version(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    write(tmp_path / "s.yaml", SERVER)
    write(tmp_path / "pods.yaml", PODS_3)
    view = ClusterView()
    source = FileSource(tmp_path, poll_interval=0.02, registry=registry)

    def errors(reason: str) -> float:
        value = registry.get_sample_value("pdgate_config_file_errors_total", {"reason": reason})
        return value or 0.0

    async with running(source, view):
        (tmp_path / "pods.yaml").write_text(PODS_3.replace("10.0.0.2", "10.0."))
        await wait_for(lambda: errors("invalid") == 1)
        await asyncio.sleep(0.1)  # polled again meanwhile: the same version, not recounted
        assert errors("invalid") == 1 and errors("yaml") == 0
        assert registry.get_sample_value("pdgate_config_files_held") == 1
        assert pods_of(view.snapshot) == ["p1", "p2", "p3"]
        write(tmp_path / "pods.yaml", PODS_3)
        await wait_for(lambda: registry.get_sample_value("pdgate_config_files_held") == 0)
