"""The fake API server keeps the protocol promises the source relies on.

Checked with a plain aiohttp client, so a bug in the fake cannot hide behind one in the
source: resourceVersions, LIST paging, watch replay, 410, bookmarks, timeouts, selectors.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from fake_apiserver import FakeApiServer, parse_selector
from kube_objects import model_route, model_server, pod
from kube_testkit import wait_until

pytestmark = pytest.mark.kubernetes

PODS = "/api/v1/namespaces/default/pods"
ROUTES_ALL = "/apis/networking.serving.volcano.sh/v1alpha1/modelroutes"


@pytest.fixture
async def http(fake_apiserver: FakeApiServer) -> AsyncIterator[aiohttp.ClientSession]:
    headers = {"Authorization": f"Bearer {fake_apiserver.token}"}
    async with aiohttp.ClientSession(fake_apiserver.url, headers=headers) as session:
        yield session


async def get_json(http: aiohttp.ClientSession, path: str, **params: str) -> Any:
    async with http.get(path, params=params) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def watch_events(
    http: aiohttp.ClientSession, path: str, count: int, **params: str
) -> list[dict[str, Any]]:
    """Read `count` events (or until the stream ends) from a watch."""
    events: list[dict[str, Any]] = []
    async with http.get(path, params={"watch": "true", **params}) as resp:
        assert resp.status == 200
        async with asyncio.timeout(3.0):
            async for line in resp.content:
                if line.strip():
                    events.append(orjson.loads(line))
                if len(events) >= count:
                    break
    return events


def test_selector_grammar() -> None:
    labels = {"app": "a", "tier": "x"}
    assert parse_selector("app=a")(labels)
    assert parse_selector("app==a,tier")(labels)
    assert not parse_selector("app!=a")(labels)
    assert parse_selector("app in (a, b),!missing")(labels)
    assert not parse_selector("app notin (a,b)")(labels)
    assert not parse_selector("missing")(labels)
    assert parse_selector("")(labels)


async def test_list_versions_paging_and_core_items(
    fake_apiserver: FakeApiServer, http: aiohttp.ClientSession
) -> None:
    for i in range(5):
        fake_apiserver.create(pod(f"p{i}", "s", ip=f"10.0.0.{i}"))
    fake_apiserver.create(pod("other", "s", namespace="other"))
    first = await get_json(http, PODS, limit="2")
    assert first["metadata"]["resourceVersion"] == str(fake_apiserver.resource_version)
    assert "kind" not in first["items"][0]  # built-in LIST items carry no kind
    names = [i["metadata"]["name"] for i in first["items"]]
    token = first["metadata"]["continue"]
    while token:
        page = await get_json(http, PODS, limit="2", **{"continue": token})
        names += [i["metadata"]["name"] for i in page["items"]]
        token = page["metadata"].get("continue")
    assert names == [f"p{i}" for i in range(5)]
    everything = await get_json(http, "/api/v1/pods")
    assert len(everything["items"]) == 6


async def test_watch_replays_from_version_and_filters(
    fake_apiserver: FakeApiServer, http: aiohttp.ClientSession
) -> None:
    fake_apiserver.create(model_server("s"))
    start = fake_apiserver.resource_version
    fake_apiserver.create(model_route("r1", "m1", ["s"]))
    fake_apiserver.create(model_route("r2", "m2", ["s"], namespace="other"))
    fake_apiserver.delete("ModelRoute", "default", "r1")
    events = await watch_events(http, ROUTES_ALL, 3, resourceVersion=str(start))
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "r1"), ("ADDED", "r2"), ("DELETED", "r1"),
    ]
    versions = [int(e["object"]["metadata"]["resourceVersion"]) for e in events]
    assert versions == sorted(versions) and versions[0] > start


async def test_selector_transitions(
    fake_apiserver: FakeApiServer, http: aiohttp.ClientSession
) -> None:
    start = fake_apiserver.resource_version
    created = fake_apiserver.create(pod("p", "a"))
    moved = dict(created, metadata={**created["metadata"], "labels": {"x": "y"}})
    fake_apiserver.update(moved)
    events = await watch_events(
        http, PODS, 2, resourceVersion=str(start),
        labelSelector="modelserving.volcano.sh/name in (a)",
    )
    assert [e["type"] for e in events] == ["ADDED", "DELETED"]


async def test_too_old_version_is_an_error_event(
    fake_apiserver: FakeApiServer, http: aiohttp.ClientSession
) -> None:
    old = fake_apiserver.resource_version
    fake_apiserver.create(pod("p", "a"))
    fake_apiserver.compact()
    events = await watch_events(http, PODS, 5, resourceVersion=str(old))
    assert len(events) == 1 and events[0]["type"] == "ERROR"
    assert events[0]["object"]["code"] == 410
    assert events[0]["object"]["reason"] == "Expired"


async def test_bookmarks_and_timeout(
    fake_apiserver: FakeApiServer, http: aiohttp.ClientSession
) -> None:
    fake_apiserver.bookmark_interval = 0.2
    version = str(fake_apiserver.resource_version)
    events = await watch_events(
        http, PODS, 100, resourceVersion=version, allowWatchBookmarks="True",
        timeoutSeconds="1",
    )  # the stream ends by itself after ~1 s
    assert events and all(e["type"] == "BOOKMARK" for e in events)
    assert events[-1]["object"]["metadata"]["resourceVersion"] == version


async def test_expire_and_drop_controls(
    fake_apiserver: FakeApiServer, http: aiohttp.ClientSession
) -> None:
    version = str(fake_apiserver.resource_version)
    task = asyncio.create_task(watch_events(http, PODS, 5, resourceVersion=version))
    await wait_until(lambda: fake_apiserver.open_watches("pods") == 1)
    assert fake_apiserver.expire_watches() == 1
    events = await task
    assert [e["type"] for e in events] == ["ERROR"]

    task = asyncio.create_task(watch_events(http, PODS, 5, resourceVersion=version))
    await wait_until(lambda: fake_apiserver.open_watches("pods") == 1)
    fake_apiserver.drop_watches()
    with pytest.raises(aiohttp.ClientError):
        await task


async def test_auth_and_events(fake_apiserver: FakeApiServer) -> None:
    async with aiohttp.ClientSession(fake_apiserver.url) as anonymous:
        async with anonymous.get(PODS) as resp:
            assert resp.status == 401
    headers = {"Authorization": f"Bearer {fake_apiserver.token}"}
    async with aiohttp.ClientSession(fake_apiserver.url, headers=headers) as http:
        event = {"kind": "Event", "involvedObject": {"name": "x"}, "metadata": {"name": "x.1"}}
        async with http.post("/api/v1/namespaces/default/events", json=event) as resp:
            assert resp.status == 201
    assert fake_apiserver.events[0]["involvedObject"]["name"] == "x"


async def test_stop_and_restart_on_the_same_port(
    fake_apiserver: FakeApiServer, http: aiohttp.ClientSession
) -> None:
    port = fake_apiserver.port
    fake_apiserver.create(pod("p", "a"))
    await fake_apiserver.stop()
    with pytest.raises(aiohttp.ClientConnectionError):
        await get_json(http, PODS)
    await fake_apiserver.start()
    assert fake_apiserver.port == port
    body = await get_json(http, PODS)
    assert [i["metadata"]["name"] for i in body["items"]] == ["p"]
