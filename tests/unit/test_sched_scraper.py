"""Engine metrics: parsing vLLM and SGLang pages, concurrent scraping, staleness, errors."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import socket
import time
import zlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from router.resources import ModelServer, ObjectMeta
from router.scheduling.metrics import SchedulerMetrics
from router.scheduling.metrics_scraper import (
    EngineLoad,
    EngineMetricsStore,
    MetricsScraper,
    ScrapeSettings,
    parse_engine_metrics,
)
from router.view import Endpoint, ServerPods, Snapshot
from tests.local_http import serve

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 99.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",\
num_cpu_blocks="None",num_gpu_blocks="2048",swap_space="4"} 1.0
vllm:e2e_request_latency_seconds_bucket{le="0.3",model_name="m"} 12.0
"""

OLD_VLLM = """\
vllm:num_requests_running 1
vllm:num_requests_waiting 0 1712000000000
vllm:gpu_cache_usage_perc 0.75
"""

SGLANG = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",tp_rank="0"} 4.0
sglang:num_queue_reqs{model_name="m",tp_rank="0"} 1.0
sglang:token_usage{model_name="m",tp_rank="0"} 0.6
sglang:max_total_num_tokens{model_name="m",tp_rank="0"} 471258.0
"""


def test_parse_vllm() -> None:
    load = parse_engine_metrics(VLLM.encode(), at=5.0)
    assert load == EngineLoad(running=5.0, waiting=7.0, kv_usage=0.5,
                              capacity_tokens=2048 * 16, at=5.0)


def test_parse_older_vllm_and_timestamps() -> None:
    load = parse_engine_metrics(OLD_VLLM.encode())
    assert (load.running, load.waiting, load.kv_usage, load.capacity_tokens) == (
        1.0, 0.0, 0.75, None)


def test_parse_sglang() -> None:
    load = parse_engine_metrics(SGLANG.encode())
    assert (load.running, load.waiting, load.kv_usage, load.capacity_tokens) == (
        4.0, 1.0, 0.6, 471258)


def test_parse_garbage() -> None:
    load = parse_engine_metrics(b"vllm:num_requests_running{oops 1\nnothing here\n")
    assert (load.running, load.waiting, load.kv_usage) == (None, None, None)
    assert parse_engine_metrics(b"vllm:kv_cache_usage_perc 7\n").kv_usage == 1.0  # clamped


def test_store_answers_only_while_fresh() -> None:
    store = EngineMetricsStore(stale_after_s=1.0)
    store.put("a", EngineLoad(waiting=1.0, at=100.0))
    assert store.get("a", 100.5) is not None
    assert store.get("a", 101.5) is None
    assert store.get_many(["a", "b"], 100.5) == [EngineLoad(waiting=1.0, at=100.0), None]
    assert store.get_many(["a"], 102.0) == [None]
    store.retain({"b"})
    assert len(store) == 0


def _snapshot(ports: list[int]) -> Snapshot:
    server = ServerPods(
        server=ModelServer(meta=ObjectMeta(name="s"), model="m", inference_engine="vLLM",
                           match_labels={"a": "b"}, pd_group=None, port=0),
        aggregated=tuple(Endpoint("ns", f"p{port}", "127.0.0.1", port, "both")
                         for port in ports),
    )
    return Snapshot(servers={("default", "s"): server})


async def test_scraper_reads_every_pod_concurrently_and_counts_errors() -> None:
    slow_release = asyncio.Event()
    calls: dict[str, int] = {}

    enough = asyncio.Event()

    async def good(request: web.Request) -> web.Response:
        calls["good"] = calls.get("good", 0) + 1
        if calls["good"] >= 4:
            enough.set()
        return web.Response(text=VLLM)

    async def slow(request: web.Request) -> web.Response:
        calls["slow"] = calls.get("slow", 0) + 1
        await slow_release.wait()
        return web.Response(text=VLLM)

    async def broken(request: web.Request) -> web.Response:
        calls["broken"] = calls.get("broken", 0) + 1
        return web.Response(status=500)

    runners = []
    ports = []
    for handler in (good, slow, broken):
        app = web.Application()
        app.router.add_get("/metrics", handler)
        runner, port = await serve(app)
        runners.append(runner)
        ports.append(port)
    # A port with nothing listening.
    ports.append(1)

    registry = CollectorRegistry()
    store = EngineMetricsStore()
    capacities: list[tuple[str, int | None]] = []
    scraper = MetricsScraper(
        store, SchedulerMetrics(registry),
        ScrapeSettings(interval_s=0.05, timeout_s=0.3, stale_after_intervals=4),
        on_capacity=lambda key, tokens: capacities.append((key, tokens)),
    )
    scraper.on_snapshot(_snapshot(ports))
    task = asyncio.create_task(scraper.run())
    try:
        await asyncio.wait_for(enough.wait(), 5)
        # The good pod is scraped every interval although the slow one hangs.
        assert calls["good"] >= 4
        assert calls["slow"] == 1
        now = time.monotonic()
        good_key, slow_key = f"ns/p{ports[0]}", f"ns/p{ports[1]}"
        load = store.get(good_key, now)
        assert load is not None and load.waiting == 7.0
        assert store.get(slow_key, now) is None
        assert capacities == [(good_key, 32768)]  # reported once, not every scrape
        await asyncio.sleep(0.4)  # the slow scrape times out
        sample = registry.get_sample_value
        assert (sample("pdgate_engine_scrape_errors_total", {"reason": "timeout"}) or 0) >= 1
        http_errors = sample("pdgate_engine_scrape_errors_total", {"reason": "http"}) or 0
        # A failing engine is asked once a scrape (no second try for the whole page),
        # give or take the request in flight.
        assert http_errors >= 1 and calls["broken"] - http_errors in (0, 1)
        assert (sample("pdgate_engine_scrape_errors_total", {"reason": "connect"}) or 0) >= 1
        # Pods that leave are forgotten.
        scraper.on_snapshot(_snapshot([ports[2]]))
        assert store.get(good_key, time.monotonic()) is None
    finally:
        slow_release.set()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        for runner in runners:
            await runner.cleanup()


async def test_scrape_once_and_stale_values() -> None:
    async def sglang(request: web.Request) -> web.Response:
        return web.Response(text=SGLANG)

    app = web.Application()
    app.router.add_get("/metrics", sglang)
    runner, port = await serve(app)
    clock = [1000.0]
    store = EngineMetricsStore()
    scraper = MetricsScraper(store, SchedulerMetrics(CollectorRegistry()),
                             ScrapeSettings(interval_s=0.1, stale_after_intervals=5),
                             clock=lambda: clock[0])
    scraper.on_snapshot(_snapshot([port]))
    try:
        await scraper.scrape_once()
        assert store.get(f"ns/p{port}", 1000.4) is not None
        assert store.get(f"ns/p{port}", 1000.6) is None  # older than 5 intervals: unknown
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def _uvicorn(app: Any) -> AsyncIterator[int]:
    """`app` served by uvicorn on a free loopback port (as SGLang and vLLM serve /metrics)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:  # listening: a first request is not left to task order
            if serving.done():
                serving.result()  # it failed to start: say why
            await asyncio.sleep(0.005)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await serving
        sock.close()


async def test_a_prometheus_client_page_is_read_uncompressed_on_one_kept_connection() -> None:
    """SGLang mounts prometheus_client's ASGI app at `/metrics`, which gzips the page for a
    client that accepts gzip: served here by uvicorn as SGLang serves it, the page is
    asked for as is, and one connection is kept between scrapes."""
    from prometheus_client import Gauge, make_asgi_app

    registry = CollectorRegistry()
    Gauge("sglang:num_running_reqs", "running", ["model_name"],
          registry=registry).labels(model_name="m").set(4)
    Gauge("sglang:num_queue_reqs", "queued", ["model_name"],
          registry=registry).labels(model_name="m").set(1)
    metrics_app = make_asgi_app(registry=registry)
    clients: set[object] = set()
    encodings: list[bytes | None] = []
    scraped = asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        clients.add(scope["client"])
        encodings.append(dict(scope["headers"]).get(b"accept-encoding"))
        if len(encodings) >= 5:  # the scrape before it has been read and counted
            scraped.set()
        await metrics_app(scope, receive, send)

    store = EngineMetricsStore()
    registry_of_router = CollectorRegistry()
    scraper = MetricsScraper(store, SchedulerMetrics(registry_of_router),
                             ScrapeSettings(interval_s=0.02))
    async with _uvicorn(app) as port:
        scraper.on_snapshot(_snapshot([port]))
        task = asyncio.create_task(scraper.run())
        try:
            await asyncio.wait_for(scraped.wait(), 10)
            load = store.get(f"ns/p{port}", time.monotonic())
            assert load is not None and (load.running, load.waiting) == (4.0, 1.0)
            assert set(encodings) == {b"identity"}
            assert len(clients) == 1  # one connection, kept alive between scrapes
            assert registry_of_router.get_sample_value("pdgate_engine_scrapes_total") >= 4
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_only_the_series_read_are_asked_for() -> None:
    """prometheus_client's app (SGLang's `/metrics`, vLLM's once vllm#53160 lands) serves
    `?name[]=...` as those samples alone: the engine renders none of its histograms for a
    scrape, and the load and capacity read from the short page are the whole page's."""
    from prometheus_client import Gauge, Histogram, make_asgi_app

    registry = CollectorRegistry()
    for name, value in (("vllm:num_requests_running", 3), ("vllm:num_requests_waiting", 7),
                        ("vllm:kv_cache_usage_perc", 0.25)):
        Gauge(name, name, ["engine"], registry=registry).labels("0").set(value)
    Gauge("vllm:cache_config_info", "cache", ["engine", "block_size", "num_gpu_blocks"],
          registry=registry).labels("0", "16", "2048").set(1)
    Histogram("vllm:time_to_first_token_seconds", "ttft", ["engine"],
              registry=registry).labels("0").observe(0.1)
    metrics_app = make_asgi_app(registry=registry)
    served: list[bytes] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        async def recorded(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                served.append(message.get("body", b""))
            await send(message)

        await metrics_app(scope, receive, recorded)

    store = EngineMetricsStore()
    scraper = MetricsScraper(store, SchedulerMetrics(CollectorRegistry()))
    async with _uvicorn(app) as port:
        scraper.on_snapshot(_snapshot([port]))
        await scraper.scrape_once()
    load = store.get(f"ns/p{port}", time.monotonic())
    assert load is not None
    assert load == parse_engine_metrics(generate_latest(registry), load.at)  # the whole page's
    assert (load.running, load.waiting, load.kv_usage, load.capacity_tokens) == (
        3.0, 7.0, 0.25, 2048 * 16)
    page = b"".join(served)
    assert b"vllm:num_requests_waiting" in page and b"time_to_first_token" not in page


@pytest.mark.parametrize("filtered_answer", [(200, ""), (400, "bad query")],
                         ids=["empty", "refused"])
async def test_a_filter_answered_without_the_series_reads_the_whole_page_from_then_on(
    filtered_answer: tuple[int, str],
) -> None:
    """A multiprocess registry not built to collect nameless collectors (SGLang's today,
    sglang#35752) answers the filter with an empty page, and a proxy may refuse the query:
    the whole page is read at once instead, and asked for whole from then on. A server
    that ignores the filter (vLLM today) is read as it answers: the other tests' pages."""
    queries: list[str] = []
    status, text = filtered_answer

    async def answer(request: web.Request) -> web.Response:
        queries.append(request.query_string)
        if "name[]" in request.query:
            return web.Response(status=status, text=text)
        return web.Response(text=VLLM)

    app = web.Application()
    app.router.add_get("/metrics", answer)
    runner, port = await serve(app)
    registry = CollectorRegistry()
    store = EngineMetricsStore()
    scraper = MetricsScraper(store, SchedulerMetrics(registry))
    scraper.on_snapshot(_snapshot([port]))
    try:
        await scraper.scrape_once()
        load = store.get(f"ns/p{port}", time.monotonic())
        assert load is not None and load.waiting == 7.0
        await scraper.scrape_once()
    finally:
        await runner.cleanup()
    assert [bool(query) for query in queries] == [True, False, False]
    assert "name[]=vllm:num_requests_waiting" in queries[0]  # as the server decodes it
    assert registry.get_sample_value("pdgate_engine_scrapes_total") == 2
    for reason in ("parse", "http"):
        assert registry.get_sample_value("pdgate_engine_scrape_errors_total",
                                         {"reason": reason}) is None


async def test_a_page_without_the_series_either_way_keeps_the_filter() -> None:
    """No load in the whole page either (an engine still starting, another server): one
    parse error a scrape, and the next scrape asks for the filtered page again."""
    queries: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        queries.append(request.query_string)
        return web.Response(text="# nothing yet\n")

    app = web.Application()
    app.router.add_get("/metrics", answer)
    runner, port = await serve(app)
    registry = CollectorRegistry()
    scraper = MetricsScraper(EngineMetricsStore(), SchedulerMetrics(registry))
    scraper.on_snapshot(_snapshot([port]))
    try:
        await scraper.scrape_once()
        await scraper.scrape_once()
    finally:
        await runner.cleanup()
    assert [bool(query) for query in queries] == [True, False, True, False]
    assert registry.get_sample_value("pdgate_engine_scrape_errors_total",
                                     {"reason": "parse"}) == 2


async def test_a_page_compressed_on_the_way_is_inflated() -> None:
    """A proxy that compresses anyway: gzip and deflate pages are read, an encoding the
    scraper cannot read is a parse error, not garbage parsed."""
    encodings = {"gzip": gzip.compress, "deflate": zlib.compress, "br": lambda b: b}
    loads: dict[str, EngineLoad | None] = {}
    registry = CollectorRegistry()
    metrics = SchedulerMetrics(registry)
    for name, encode in encodings.items():
        page = encode(VLLM.encode())

        async def answer(request: web.Request, page: bytes = page, name: str = name
                         ) -> web.Response:
            return web.Response(body=page, headers={"Content-Encoding": name})

        app = web.Application()
        app.router.add_get("/metrics", answer)
        runner, port = await serve(app)
        store = EngineMetricsStore()
        scraper = MetricsScraper(store, metrics)
        scraper.on_snapshot(_snapshot([port]))
        try:
            await scraper.scrape_once()
        finally:
            await runner.cleanup()
        loads[name] = store.get(f"ns/p{port}", time.monotonic())
    assert [load and load.waiting for load in loads.values()] == [7.0, 7.0, None]
    assert registry.get_sample_value("pdgate_engine_scrape_errors_total",
                                     {"reason": "parse"}) == 1


def test_get_many_is_memoized_until_a_scrape_lands_or_a_load_goes_stale() -> None:
    from router.scheduling.metrics_scraper import EngineLoad, EngineMetricsStore

    store = EngineMetricsStore(stale_after_s=10.0)
    keys = ["a", "b", "c"]
    store.put("a", EngineLoad(waiting=1.0, at=100.0))
    store.put("b", EngineLoad(waiting=2.0, at=105.0))
    first = store.get_many(keys, 106.0)
    assert [load and load.waiting for load in first] == [1.0, 2.0, None]
    assert store.get_many(keys, 110.0) is first  # nothing changed: the same answer
    later = store.get_many(keys, 110.5)  # "a" went stale after 110.0
    assert later is not first and [load and load.waiting for load in later] == [None, 2.0, None]
    store.put("c", EngineLoad(waiting=3.0, at=111.0))  # a scrape lands
    fresh = store.get_many(keys, 111.0)
    assert [load and load.waiting for load in fresh] == [None, 2.0, 3.0]
    keys.append("a")  # a list changed in place is never misread
    assert len(store.get_many(keys, 111.0)) == 4
    store.stale_after_s = 100.0  # a reconfiguration applies at once
    assert [load and load.waiting for load in store.get_many(keys, 111.0)] == [1.0, 2.0, 3.0, 1.0]


def test_parse_one_engine_of_a_data_parallel_page() -> None:
    """vLLM labels each engine's series with `engine`: a rank reads its own (and the
    series that name no engine)."""
    zero = parse_engine_metrics(VLLM.encode(), engine=b"0")
    one = parse_engine_metrics(VLLM.encode(), engine=b"1")
    assert (zero.running, zero.waiting, zero.kv_usage) == (3.0, 7.0, 0.25)
    assert (one.running, one.waiting, one.kv_usage) == (2.0, None, 0.5)
    assert zero.capacity_tokens == one.capacity_tokens == 2048 * 16


async def _ranks_page(
    text: str, pins: dict[int, str], hits: list[str] | None = None
) -> tuple[web.AppRunner, EngineMetricsStore, MetricsScraper]:
    """One pod's `/metrics` page (`text`) served on loopback, and a scraper whose view is
    that pod as the data-parallel ranks `pins` (rank -> pin); `hits` gets each path read."""

    async def page(request: web.Request) -> web.Response:
        if hits is not None:
            hits.append(request.path)
        return web.Response(text=text)

    app = web.Application()
    app.router.add_get("/metrics", page)
    runner, port = await serve(app)
    server = ServerPods(
        server=ModelServer(meta=ObjectMeta(name="s"), model="m", inference_engine="vLLM",
                           match_labels={"a": "b"}, pd_group=None, port=port),
        aggregated=tuple(Endpoint("ns", "p", "127.0.0.1", port, "both", dp_rank=rank,
                                  rank_pin=pin) for rank, pin in pins.items()),
    )
    store = EngineMetricsStore()
    scraper = MetricsScraper(store, SchedulerMetrics(CollectorRegistry()))
    scraper.on_snapshot(Snapshot(servers={("default", "s"): server}))
    return runner, store, scraper


async def test_a_data_parallel_pod_is_scraped_once_for_all_its_ranks() -> None:
    hits: list[str] = []
    runner, store, scraper = await _ranks_page(VLLM, {0: "0", 1: "1"}, hits)
    try:
        await scraper.scrape_once()
        assert hits == ["/metrics"]
        now = time.monotonic()
        zero, one = store.get("ns/p/dp0", now), store.get("ns/p/dp1", now)
        assert zero is not None and one is not None
        assert (zero.running, one.running) == (3.0, 2.0)
    finally:
        await runner.cleanup()


async def test_a_nodes_ranks_read_their_global_engine_series_and_a_missing_one_is_warned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The second node of a hybrid deployment runs global ranks 2 and 3, so vLLM labels
    its page `engine="2"` and `engine="3"`. A target declared rank 4 (its pod's first rank
    misdeclared) finds no series: no load for it, and one warning however often scraped."""
    node = VLLM.replace('engine="1"', 'engine="3"').replace('engine="0"', 'engine="2"')
    runner, store, scraper = await _ranks_page(node, {2: "0", 3: "1", 4: "2"})
    try:
        for _ in range(3):
            await scraper.scrape_once()
        now = time.monotonic()
        two, three = store.get("ns/p/dp2", now), store.get("ns/p/dp3", now)
        assert two is not None and three is not None
        assert (two.running, three.running) == (3.0, 2.0)
        assert store.get("ns/p/dp4", now) is None
        assert caplog.text.count('no series with engine="4" for ns/p/dp4') == 1
    finally:
        await runner.cleanup()
