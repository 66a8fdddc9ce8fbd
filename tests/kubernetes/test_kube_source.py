"""KubernetesSource against the fake API server, through the real kubernetes-asyncio client.

Each case drives a wire-level fault (410 mid-watch, 410 on reconnect, a cut stream, the
API server killed and restarted, malformed objects and lines) and then checks the view
against the server's truth: nothing duplicated, nothing lost, last good state kept.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import statistics
import time
from typing import Any

import pytest
from fake_apiserver import FakeApiServer
from kube_objects import NAME_LABEL, model_route, model_server, pd_pods, pod
from kube_testkit import FAST_TIMING, RunningSource, StartSource, wait_until

from router.view import Snapshot

pytestmark = pytest.mark.kubernetes

SERVER = "deepseekv4-pd"
RESTARTS = "pdgate_kubernetes_watch_restarts_total"
INVALID = "pdgate_kubernetes_invalid_objects_total"


def seed(server: FakeApiServer, groups: int = 2, name: str = SERVER) -> list[dict[str, Any]]:
    server.create(model_server(name))
    server.create(model_route(f"{name}-route", f"{name}-model", [name]))
    pods = pd_pods(name, groups)
    for item in pods:
        server.create(item)
    return pods


def pods_in_view(running: RunningSource) -> set[tuple[str, str]]:
    return set(running.view.objects("Pod"))


def assert_matches_server(running: RunningSource, server: FakeApiServer) -> None:
    """The view holds exactly the server's objects (pods within the selector)."""
    assert set(running.view.objects("ModelServer")) == server.names("ModelServer")
    assert set(running.view.objects("ModelRoute")) == server.names("ModelRoute")
    assert pods_in_view(running) == server.names("Pod")
    keys = running.endpoint_keys()
    assert len(keys) == len(set(keys)), "duplicate endpoints"


async def test_initial_sync_and_watch_parameters(
    fake_apiserver: FakeApiServer, start_source: StartSource
) -> None:
    pods = seed(fake_apiserver, groups=3)
    running = await start_source(wait_synced=False)
    assert not running.source.synced
    await wait_until(lambda: running.source.synced)
    assert running.metric("pdgate_kubernetes_synced") == 1.0
    assert running.pod_names() == {p["metadata"]["name"] for p in pods}
    assert running.view.snapshot.model_names() == [f"{SERVER}-model"]
    assert running.source.pod_label_selector == f"{NAME_LABEL} in ({SERVER})"

    await wait_until(lambda: fake_apiserver.open_watches() == 3)
    for plural in ("pods", "modelroutes", "modelservers"):
        (watch,) = fake_apiserver.watch_requests(plural)
        assert watch.query["allowWatchBookmarks"] in ("True", "true")
        timeout = int(watch.query["timeoutSeconds"])
        assert FAST_TIMING.min_timeout_s <= timeout <= FAST_TIMING.max_timeout_s
        (listing,) = fake_apiserver.list_requests(plural)
        assert "resourceVersion" not in listing.query  # a consistent read, not the cache
    (pod_watch,) = fake_apiserver.watch_requests("pods")
    assert pod_watch.query["labelSelector"] == f"{NAME_LABEL} in ({SERVER})"
    # Past the list's own event, only a bookmark (every 0.5 s; no pod changes) brings the
    # pods' age under 0.6 s: it would only grow if bookmarks did not count as events.
    await asyncio.sleep(0.6)
    await wait_until(lambda: running.metric(
        "pdgate_kubernetes_seconds_since_last_event", resource="pods") < 0.6)


async def test_sync_waits_for_an_unreachable_api_server(
    fake_apiserver: FakeApiServer, start_source: StartSource
) -> None:
    seed(fake_apiserver)
    await fake_apiserver.stop()
    running = await start_source(wait_synced=False)
    await wait_until(
        lambda: running.metric(RESTARTS, resource="modelservers", reason="unreachable") >= 1
    )
    assert not running.source.synced
    await fake_apiserver.start()
    await wait_until(lambda: running.source.synced)
    assert_matches_server(running, fake_apiserver)


async def _removal_latency(
    running: RunningSource, name: str, act: Any
) -> float:
    """Seconds from `act()` returning (the change written) to a snapshot without `name`."""
    published: asyncio.Future[float] = asyncio.get_running_loop().create_future()

    def listener(snapshot: Snapshot) -> None:
        if not published.done() and name not in _names(snapshot):
            published.set_result(time.perf_counter())

    running.view.subscribe(listener)
    act()
    written = time.perf_counter()
    return await asyncio.wait_for(published, 5.0) - written


def _names(snapshot: Snapshot) -> set[str]:
    names: set[str] = set()
    for server in snapshot.servers.values():
        names.update(ep.pod_name for ep in server.aggregated)
        for group in server.groups:
            names.update(ep.pod_name for ep in group.prefill + group.decode)
    return names


async def test_pod_churn_leaves_the_view_promptly(
    fake_apiserver: FakeApiServer, start_source: StartSource
) -> None:
    pods = seed(fake_apiserver, groups=40)
    running = await start_source()
    assert len(running.pod_names()) == 80
    deleted, unready, terminating = [], [], []
    for i, item in enumerate(pods[:60]):
        name = item["metadata"]["name"]
        if i % 3 == 0:
            latency = await _removal_latency(
                running, name, lambda n=name: fake_apiserver.delete("Pod", "default", n)
            )
            deleted.append(latency)
        elif i % 3 == 1:
            gone = fake_apiserver.get("Pod", "default", name)
            gone["status"]["conditions"][0]["status"] = "False"
            unready.append(await _removal_latency(
                running, name, lambda g=gone: fake_apiserver.update(g)
            ))
        else:
            gone = fake_apiserver.get("Pod", "default", name)
            gone["metadata"]["deletionTimestamp"] = "2030-01-01T00:00:00Z"
            terminating.append(await _removal_latency(
                running, name, lambda g=gone: fake_apiserver.update(g)
            ))
    assert running.pod_names() == {p["metadata"]["name"] for p in pods[60:]}
    for label, samples in (("deleted", deleted), ("unready", unready),
                           ("terminating", terminating)):
        print(
            f"pod {label} -> out of view: median {statistics.median(samples) * 1e3:.2f} ms, "
            f"max {max(samples) * 1e3:.2f} ms over {len(samples)}"
        )
        assert statistics.median(samples) < 0.05
    # A pod relabelled out of the selector arrives as DELETED (selector transition).
    moved = fake_apiserver.get("Pod", "default", pods[60]["metadata"]["name"])
    moved["metadata"]["labels"][NAME_LABEL] = "someone-else"
    await _removal_latency(
        running, moved["metadata"]["name"], lambda: fake_apiserver.update(moved)
    )
    assert (("default", moved["metadata"]["name"])) not in pods_in_view(running)


async def test_model_route_edit_is_applied(
    fake_apiserver: FakeApiServer, start_source: StartSource
) -> None:
    seed(fake_apiserver)
    fake_apiserver.create(model_server("other"))
    running = await start_source()
    route = fake_apiserver.get("ModelRoute", "default", f"{SERVER}-route")
    route["spec"]["modelName"] = "renamed"
    route["spec"]["rules"][0]["targetModels"] = [
        {"modelServerName": SERVER, "weight": 30},
        {"modelServerName": "other", "weight": 70},
    ]
    fake_apiserver.update(route)
    await wait_until(lambda: running.view.snapshot.model_names() == ["renamed"])
    targets = running.view.snapshot.routes_by_model["renamed"].rules[0].target_models
    assert [(t.model_server_name, t.weight) for t in targets] == [(SERVER, 30), ("other", 70)]
    fake_apiserver.delete("ModelRoute", "default", f"{SERVER}-route")
    await wait_until(lambda: running.view.snapshot.model_names() == [])


async def test_410_mid_watch_relists_without_duplicates_or_losses(
    fake_apiserver: FakeApiServer, start_source: StartSource
) -> None:
    pods = seed(fake_apiserver, groups=5)
    running = await start_source()
    await wait_until(lambda: fake_apiserver.open_watches() == 3)
    lists_before = len(fake_apiserver.list_requests("pods"))
    with fake_apiserver.partition():  # these changes never reach the open watches
        fake_apiserver.delete("Pod", "default", pods[0]["metadata"]["name"])
        fake_apiserver.create(pod(f"{SERVER}-g9-prefill", SERVER, group="g9", ip="10.9.0.1"))
        fake_apiserver.create(pod(f"{SERVER}-g9-decode", SERVER, role="decode", group="g9",
                                  ip="10.9.0.2"))
        changed = fake_apiserver.get("Pod", "default", pods[3]["metadata"]["name"])
        changed["status"]["podIP"] = "10.99.0.1"
        fake_apiserver.update(changed)
        route = fake_apiserver.get("ModelRoute", "default", f"{SERVER}-route")
        route["spec"]["modelName"] = "after-410"
        fake_apiserver.update(route)
    fake_apiserver.compact()
    await asyncio.sleep(0.1)
    assert pods[0]["metadata"]["name"] in running.pod_names()  # the watch saw nothing
    assert fake_apiserver.expire_watches() == 3

    await wait_until(lambda: running.view.snapshot.model_names() == ["after-410"])
    await wait_until(lambda: pods_in_view(running) == fake_apiserver.names("Pod"))
    assert_matches_server(running, fake_apiserver)
    ips = {ep.pod_name: ep.ip for s in running.view.snapshot.servers.values()
           for g in s.groups for ep in g.prefill + g.decode}
    assert ips[pods[3]["metadata"]["name"]] == "10.99.0.1"
    assert f"{SERVER}-g9-prefill" in ips and pods[0]["metadata"]["name"] not in ips
    for plural in ("pods", "modelroutes", "modelservers"):
        assert running.metric(RESTARTS, resource=plural, reason="expired") == 1
    assert len(fake_apiserver.list_requests("pods")) == lists_before + 1
    assert running.source.synced


async def test_410_on_reconnect_after_a_cut_stream(
    fake_apiserver: FakeApiServer, start_source: StartSource
) -> None:
    pods = seed(fake_apiserver, groups=3)
    running = await start_source()
    await wait_until(lambda: fake_apiserver.open_watches() == 3)
    with fake_apiserver.partition():
        fake_apiserver.delete("Pod", "default", pods[1]["metadata"]["name"])
    fake_apiserver.compact()  # the deletion can no longer be replayed
    fake_apiserver.drop_watches()
    await wait_until(lambda: pods_in_view(running) == fake_apiserver.names("Pod"))
    assert_matches_server(running, fake_apiserver)
    assert running.metric(RESTARTS, resource="pods", reason="dropped") == 1
    assert running.metric(RESTARTS, resource="pods", reason="expired") == 1


async def test_cut_stream_resumes_from_its_version_without_relisting(
    fake_apiserver: FakeApiServer, start_source: StartSource
) -> None:
    pods = seed(fake_apiserver, groups=3)
    running = await start_source()
    await wait_until(lambda: fake_apiserver.open_watches() == 3)
    fake_apiserver.drop_watches()
    fake_apiserver.delete("Pod", "default", pods[0]["metadata"]["name"])  # in the gap
    await wait_until(lambda: pods_in_view(running) == fake_apiserver.names("Pod"))
    assert len(fake_apiserver.list_requests("pods")) == 1  # replayed, not relisted
    assert running.metric(RESTARTS, resource="pods", reason="dropped") == 1


async def test_api_server_killed_and_restarted(
    fake_apiserver: FakeApiServer, start_source: StartSource
) -> None:
    pods = seed(fake_apiserver, groups=4)
    running = await start_source()
    await wait_until(lambda: fake_apiserver.open_watches() == 3)
    before = running.pod_names()
    await fake_apiserver.stop()
    # Changes made while the router cannot see them (the state outlives the process,
    # as etcd does).
    fake_apiserver.delete("Pod", "default", pods[0]["metadata"]["name"])
    fake_apiserver.create(pod(f"{SERVER}-g7-prefill", SERVER, group="g7", ip="10.7.0.1"))
    fake_apiserver.create(pod(f"{SERVER}-g7-decode", SERVER, role="decode", group="g7",
                              ip="10.7.0.2"))
    for _ in range(10):
        await asyncio.sleep(0.1)
        assert running.source.synced, "synced must hold while the API server is gone"
        assert running.pod_names() == before, "the last good state is served"
    await wait_until(lambda: running.metric(RESTARTS, resource="pods", reason="unreachable") >= 1)

    await fake_apiserver.start()
    restarted = time.perf_counter()
    await wait_until(lambda: pods_in_view(running) == fake_apiserver.names("Pod"))
    print(f"recovered {time.perf_counter() - restarted:.3f}s after the API server came back")
    assert_matches_server(running, fake_apiserver)
    assert f"{SERVER}-g7-decode" in running.pod_names()


async def test_restarted_api_server_without_history_forces_a_relist(
    fake_apiserver: FakeApiServer, start_source: StartSource
) -> None:
    pods = seed(fake_apiserver, groups=2)
    running = await start_source()
    await fake_apiserver.stop()
    fake_apiserver.delete("Pod", "default", pods[0]["metadata"]["name"])
    fake_apiserver.compact()  # a new API server process with a fresh watch cache
    await asyncio.sleep(0.2)
    await fake_apiserver.start()
    await wait_until(lambda: pods_in_view(running) == fake_apiserver.names("Pod"))
    assert_matches_server(running, fake_apiserver)
    assert running.metric(RESTARTS, resource="pods", reason="expired") == 1


async def test_watch_renewed_at_timeout_without_losing_events(
    fake_apiserver: FakeApiServer, start_source: StartSource
) -> None:
    seed(fake_apiserver, groups=1)
    timing = dataclasses.replace(FAST_TIMING, min_timeout_s=1, max_timeout_s=1)
    running = await start_source(timing=timing)
    for i in range(12):  # 2.4 s of changes across at least two renewals
        fake_apiserver.create(pod(f"{SERVER}-x{i}", SERVER, group=f"x{i}", ip=f"10.8.0.{i}"))
        await asyncio.sleep(0.2)
    await wait_until(lambda: pods_in_view(running) == fake_apiserver.names("Pod"))
    assert running.metric(RESTARTS, resource="pods", reason="closed") >= 2
    assert len(fake_apiserver.list_requests("pods")) == 1
    assert len(fake_apiserver.watch_requests("pods")) >= 3


async def test_paged_list(fake_apiserver: FakeApiServer, start_source: StartSource) -> None:
    seed(fake_apiserver, groups=10)
    running = await start_source(timing=dataclasses.replace(FAST_TIMING, page_size=3))
    assert_matches_server(running, fake_apiserver)
    assert len(fake_apiserver.list_requests("pods")) == 7  # 20 pods, 3 a page


async def test_pod_selector_follows_model_servers(
    fake_apiserver: FakeApiServer, start_source: StartSource
) -> None:
    seed(fake_apiserver, groups=2)
    stranger = pod("stranger", "nobody", ip="10.50.0.1")
    fake_apiserver.create(stranger)
    running = await start_source()
    assert ("default", "stranger") not in pods_in_view(running)
    for item in pd_pods("second", 2):  # pods exist before their ModelServer
        fake_apiserver.create(item)
    fake_apiserver.create(model_server("second"))
    await wait_until(
        lambda: running.source.pod_label_selector == f"{NAME_LABEL} in ({SERVER},second)"
    )
    await wait_until(lambda: len(running.pod_names()) == 8)
    assert running.metric(RESTARTS, resource="pods", reason="selector_changed") >= 1
    fake_apiserver.delete("ModelServer", "default", "second")
    await wait_until(lambda: running.source.pod_label_selector == f"{NAME_LABEL} in ({SERVER})")
    await wait_until(
        lambda: {n for _, n in pods_in_view(running)} == {
            p["metadata"]["name"] for p in pd_pods(SERVER, 2)
        }
    )


async def test_all_namespaces(fake_apiserver: FakeApiServer, start_source: StartSource) -> None:
    for namespace in ("team-a", "team-b"):
        fake_apiserver.create(model_server("s", namespace=namespace))
        fake_apiserver.create(model_route("r", f"model-{namespace}", ["s"], namespace=namespace))
        for item in pd_pods("s", 1, namespace=namespace):
            fake_apiserver.create(item)
    running = await start_source(namespace=None)
    assert running.view.snapshot.model_names() == ["model-team-a", "model-team-b"]
    assert_matches_server(running, fake_apiserver)
    assert all(r.path.startswith(("/api/v1/pods", "/apis/networking.serving.volcano.sh/"))
               and "/namespaces/" not in r.path for r in fake_apiserver.requests)
    fake_apiserver.delete("Pod", "team-b", "s-g0-decode")
    await wait_until(lambda: ("team-b", "s-g0-decode") not in pods_in_view(running))


async def test_invalid_objects_are_counted_reported_and_never_replace_good_state(
    fake_apiserver: FakeApiServer, start_source: StartSource, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    seed(fake_apiserver, groups=1)
    route_name = f"{SERVER}-route"
    running = await start_source()
    good_route = running.view.snapshot.routes_by_model[f"{SERVER}-model"]

    bad_server = model_server("broken")
    bad_server["spec"]["inferenceEngine"] = "TensorRT"
    fake_apiserver.create(bad_server)
    await wait_until(lambda: running.metric(INVALID, kind="ModelServer") == 1)
    assert ("default", "broken") not in running.view.objects("ModelServer")
    assert "broken" in caplog.text

    edit = fake_apiserver.get("ModelRoute", "default", route_name)
    edit["spec"]["rules"][0]["targetModels"][0]["weight"] = 200  # breaks the 0-100 bound
    fake_apiserver.update(edit)
    await wait_until(lambda: running.metric(INVALID, kind="ModelRoute") == 1)
    assert running.view.snapshot.routes_by_model[f"{SERVER}-model"] is good_route
    assert route_name in caplog.text

    # A garbage line on the watch: the watch restarts and relists; the relist sees the
    # same invalid versions again without counting them twice.
    assert fake_apiserver.inject_raw("modelroutes", b"{not json\n") == 1
    await wait_until(
        lambda: running.metric(RESTARTS, resource="modelroutes", reason="malformed") == 1
    )
    await wait_until(lambda: len(fake_apiserver.list_requests("modelroutes")) == 2)
    await wait_until(lambda: fake_apiserver.open_watches("modelroutes") == 1)
    assert running.metric(INVALID, kind="ModelRoute") == 1
    assert running.view.snapshot.routes_by_model[f"{SERVER}-model"] is good_route

    # Cross-object problems: a missing ModelServer and a younger duplicate modelName.
    fake_apiserver.create(model_route("dangling", "other-model", ["nope"]))
    fake_apiserver.create(model_route("copycat", f"{SERVER}-model", [SERVER],
                                      created="2099-01-01T00:00:00Z"))
    await wait_until(lambda: running.metric(INVALID, kind="ModelRoute") == 3)
    assert running.view.snapshot.routes_by_model[f"{SERVER}-model"] is good_route

    fixed = fake_apiserver.get("ModelRoute", "default", route_name)
    fixed["spec"]["rules"][0]["targetModels"][0]["weight"] = 50
    fake_apiserver.update(fixed)
    await wait_until(
        lambda: running.view.snapshot.routes_by_model[f"{SERVER}-model"].rules[0]
        .target_models[0].weight == 50
    )
    await wait_until(lambda: len(fake_apiserver.events) == 4)
    reasons = sorted(
        (e["involvedObject"]["kind"], e["involvedObject"]["name"], e["reason"])
        for e in fake_apiserver.events
    )
    assert reasons == [
        ("ModelRoute", "copycat", "DuplicateModelName"),
        ("ModelRoute", "dangling", "MissingModelServer"),
        ("ModelRoute", route_name, "InvalidSpec"),
        ("ModelServer", "broken", "InvalidSpec"),
    ]
    for event in fake_apiserver.events:
        assert event["type"] == "Warning" and event["involvedObject"]["uid"]
    # The server records an Event before the client has its answer and counts it.
    await wait_until(
        lambda: running.metric("pdgate_kubernetes_events_total", result="posted") == 4
    )
    assert running.source.synced


async def test_a_failure_while_applying_relists_instead_of_dying(
    fake_apiserver: FakeApiServer, start_source: StartSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    pods = seed(fake_apiserver, groups=2)
    running = await start_source()
    real_delete = running.view.delete
    failures = []

    def flaky_delete(kind: str, namespace: str, name: str) -> None:
        if not failures:
            failures.append(name)
            raise RuntimeError("a bug while applying an event")
        real_delete(kind, namespace, name)

    monkeypatch.setattr(running.view, "delete", flaky_delete)
    fake_apiserver.delete("Pod", "default", pods[0]["metadata"]["name"])
    await wait_until(lambda: pods_in_view(running) == fake_apiserver.names("Pod"))
    assert failures and running.metric(RESTARTS, resource="pods", reason="internal") == 1
    assert not running.task.done() and running.source.synced


async def test_event_posting_refused_is_counted_not_fatal(
    fake_apiserver: FakeApiServer, start_source: StartSource
) -> None:
    seed(fake_apiserver)
    fake_apiserver.token = "rotated"  # every call is now 401, Event POSTs included
    running = await start_source(wait_synced=False)
    # The first refused LIST is counted at once (20-50 ms here, once over 0.3 s on a fresh
    # clone): wait for it rather than for a fixed time.
    await wait_until(
        lambda: running.metric(RESTARTS, resource="modelservers", reason="http_error") >= 1
    )
    assert not running.source.synced
    fake_apiserver.token = "fake-token"
    await wait_until(lambda: running.source.synced)
    # `synced` turns true after the LIST; the WATCH request follows it. Rotating the token
    # before that request arrives would refuse the watch too and nothing would ever be
    # delivered, so wait for the open watch the bad object must travel on.
    await wait_until(lambda: fake_apiserver.open_watches("modelservers") == 1)
    fake_apiserver.token = "rotated"
    bad = model_server("broken", engine="TensorRT")
    fake_apiserver.create(bad)  # the open watch still delivers it
    await wait_until(
        lambda: running.metric("pdgate_kubernetes_events_total", result="failed") == 1
    )
    assert running.metric(INVALID, kind="ModelServer") == 1 and not running.task.done()


def test_default_namespace_follows_the_kubeconfig(
    fake_apiserver: FakeApiServer, tmp_path: Any
) -> None:
    from router.sources.kube_api import default_namespace

    path = fake_apiserver.write_kubeconfig(tmp_path / "kc", namespace="team-a")
    assert default_namespace(str(path)) == "team-a"
    assert default_namespace(str(tmp_path / "missing")) == "default"
