"""Engine load from every pod's `/metrics`, scraped concurrently, never trusted when stale.

Every `interval_s` (default 200 ms) each pod of the view whose previous scrape has
finished is scraped again (a slow pod delays only itself); at most `max_concurrency`
requests are open at once, each bounded by `timeout_s`. A value older than
`stale_after_intervals` x `interval_s` is unknown: `EngineMetricsStore.get` returns None
and scorers fall back to their neutral value.

Parsing is a byte search for the few names below (no full exposition parser: vLLM's
page is thousands of histogram lines):

    running   vllm:num_requests_running | sglang:num_running_reqs       (summed over series)
    waiting   vllm:num_requests_waiting | sglang:num_queue_reqs         (summed over series)
    kv usage  vllm:kv_cache_usage_perc, else vllm:gpu_cache_usage_perc,
              else sglang:token_usage                                    (0..1, max of series)
    capacity  vllm:cache_config_info labels num_gpu_blocks x block_size, else
              sglang:max_total_num_tokens                                (tokens, summed)

The capacity sizes the approximate prefix index (`on_capacity` callback, on change only).

A pod that runs several data-parallel ranks behind one API server (`router.view.
DataParallel`) is one page for several targets: it is scraped once and each rank's load
read from the series labelled with its `engine` (vLLM labels every engine's series so).

Pages are read with the data path's lean client (`router.http_client`): a scrape through
aiohttp's client cost about twice its CPU, ten times a second with two pods. The request
asks for the page uncompressed (`accept-encoding: identity`): SGLang's `/metrics`
(prometheus_client's ASGI app) gzips for a client that accepts it, CPU on the engine's
side and ours for a page that crosses a cluster network.

Only those series are asked for (`GET /metrics?name[]=...`, one `name[]` a sample read:
prometheus_client's filter, as llm-d and AIBrix ask SGLang): an engine that serves
`/metrics` with prometheus_client's app then renders a few samples, not every family it
has. A vLLM-like page (14 histograms, one engine, 35 KB) took 2.7 ms of CPU to render
whole and 41 µs filtered, at five scrapes a second a router. Two answers are not
filtered pages, and both are read:

- vLLM today answers `/metrics` from its instrumentator's route, which shadows
  prometheus_client's app mounted behind it and ignores the query (vllm#53140; vllm#53160
  mounts the app alone): the whole page, read as before.
- A multiprocess registry (SGLang's, for its scheduler and tokenizer processes) answers
  the filter with an empty page unless it was built to collect nameless collectors
  (prometheus_client 0.25 on, sglang#35752).

A filtered answer without the series (empty, or a 4xx from a server or proxy that
refuses the query; a 5xx is the engine's failure) is followed at once by a request for
the whole page; when that one has them, the pod's page is asked for whole from then on
(a page with them in neither keeps being asked both ways: an engine still starting, say).

Once per host: with `pdgate serve --workers N` only worker 0 scrapes; its store's
`listener` publishes each scrape (`router.sync`) and the other workers, whose scrapers
are `passive`, apply it with `EngineMetricsStore.apply_remote`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from router.http_client import ConnectionBroken, Pool, Response
from router.scheduling.metrics import SchedulerMetrics
from router.view import Snapshot

log = logging.getLogger("pdgate.scheduling.metrics_scraper")

DEFAULT_INTERVAL_S: Final = 0.2
DEFAULT_TIMEOUT_S: Final = 1.0
DEFAULT_STALE_AFTER_INTERVALS: Final = 5
DEFAULT_MAX_CONCURRENCY: Final = 32
#: Largest /metrics page read, in bytes (the rest is ignored).
MAX_METRICS_BYTES: Final = 4 << 20
#: Connection pool bounds of the scraper's own HTTP client (one scrape a page at a time).
MAX_CONNECTIONS: Final = 64
MAX_CONNECTIONS_PER_HOST: Final = 1
#: Below vLLM's 5 s idle timeout, so a kept-alive connection is never reset under us.
KEEPALIVE_S: Final = 4.0

_RUNNING: Final = (b"vllm:num_requests_running", b"sglang:num_running_reqs")
_WAITING: Final = (b"vllm:num_requests_waiting", b"sglang:num_queue_reqs")
_USAGE: Final = (b"vllm:kv_cache_usage_perc", b"vllm:gpu_cache_usage_perc", b"sglang:token_usage")
_CACHE_INFO: Final = b"vllm:cache_config_info"
_SGLANG_CAPACITY: Final = b"sglang:max_total_num_tokens"
#: Every sample name read here: the `name[]` filter of each scrape (`_page_request`).
READ_SAMPLES: Final = (*_RUNNING, *_WAITING, *_USAGE, _CACHE_INFO, _SGLANG_CAPACITY)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One pod's engine-reported load; fields are None when the engine does not report them."""

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    capacity_tokens: int | None = None
    at: float = 0.0  # time.monotonic() of the scrape


def _samples(data: bytes, name: bytes, engine: bytes | None = None) -> list[tuple[bytes, float]]:
    """(labels text, value) of every sample of `name` in an exposition (data starts "\\n");
    with `engine`, only that engine's samples (and those of no engine)."""
    out: list[tuple[bytes, float]] = []
    needle = b"\n" + name
    size = len(needle)
    pos = data.find(needle)
    while pos >= 0:
        start = pos + size
        end = data.find(b"\n", start)
        if end < 0:
            end = len(data)
        line = data[start:end]
        labels = b""
        if line[:1] == b"{":
            close = line.rfind(b"}")
            if close < 0:
                pos = data.find(needle, end)
                continue
            labels = line[1:close]
            rest = line[close + 1 :]
        elif line[:1] == b" ":
            rest = line
        else:  # a longer name that merely starts with `name`
            pos = data.find(needle, end)
            continue
        fields = rest.split()
        if engine is not None and _label(labels, b"engine") not in (engine, None):
            fields = []
        if fields:
            try:
                out.append((labels, float(fields[0])))
            except ValueError:
                pass
        pos = data.find(needle, end)
    return out


def _label(labels: bytes, name: bytes) -> bytes | None:
    key = name + b'="'
    pos = labels.find(key)
    while pos > 0 and labels[pos - 1 : pos] not in (b",", b"{", b" "):
        pos = labels.find(key, pos + 1)
    if pos < 0:
        return None
    start = pos + len(key)
    end = labels.find(b'"', start)
    return None if end < 0 else labels[start:end]


def _sum(data: bytes, names: tuple[bytes, ...], engine: bytes | None) -> float | None:
    for name in names:
        samples = _samples(data, name, engine)
        if samples:
            return sum(value for _, value in samples)
    return None


def parse_engine_metrics(body: bytes, at: float = 0.0, engine: bytes | None = None) -> EngineLoad:
    """The load fields of one /metrics page (vLLM or SGLang names; see the module
    docstring), of one engine's series when `engine` names its `engine` label."""
    data = b"\n" + body
    usage: float | None = None
    for name in _USAGE:
        samples = _samples(data, name, engine)
        if samples:
            usage = min(1.0, max(0.0, max(value for _, value in samples)))
            break
    capacity: int | None = None
    total = 0
    for labels, _ in _samples(data, _CACHE_INFO, engine):
        blocks = _label(labels, b"num_gpu_blocks")
        block_size = _label(labels, b"block_size")
        try:
            if blocks is not None and block_size is not None:
                total += int(blocks) * int(block_size)
        except ValueError:
            continue
    if total > 0:
        capacity = total
    else:
        tokens = _sum(data, (_SGLANG_CAPACITY,), engine)
        if tokens is not None and tokens > 0:
            capacity = int(tokens)
    return EngineLoad(
        running=_sum(data, _RUNNING, engine),
        waiting=_sum(data, _WAITING, engine),
        kv_usage=usage,
        capacity_tokens=capacity,
        at=at,
    )


#: Bound of `EngineMetricsStore.get_many`'s memo (candidate lists: a few per server and role).
MAX_LOADS_MEMO: Final = 64


class EngineMetricsStore:
    """The last scrape of each pod; `get` answers only while it is fresh.

    `get_many` is memoized per candidate list until a scrape lands or the oldest load in
    the answer goes stale, and returns the same list object while nothing changed, so
    what is computed from the engine loads alone (queue and KV scores, the saturation
    filter) can be kept per answer too (`memo_of`)."""

    def __init__(self, stale_after_s: float = DEFAULT_INTERVAL_S * DEFAULT_STALE_AFTER_INTERVALS):
        self._stale_after_s = stale_after_s
        self._loads: dict[str, EngineLoad] = {}
        #: Called with (pod key, load) on every local scrape (`router.sync`).
        self.listener: Callable[[str, EngineLoad], None] | None = None
        #: id(keys) -> (a copy of keys, valid until, the answer); emptied on every change.
        self._memo: dict[int, tuple[list[str], float, list[EngineLoad | None]]] = {}

    @property
    def stale_after_s(self) -> float:
        return self._stale_after_s

    @stale_after_s.setter
    def stale_after_s(self, value: float) -> None:
        self._stale_after_s = value
        self._memo.clear()

    def get(self, key: str, now: float) -> EngineLoad | None:
        load = self._loads.get(key)
        if load is None or now - load.at > self.stale_after_s:
            return None
        return load

    def get_many(self, keys: list[str], now: float) -> list[EngineLoad | None]:
        """`get` for many pods at once (one call per decision, not one per pod).

        The answer is shared (see the class docstring): read it, never change it."""
        memo = self._memo.get(id(keys))
        if memo is not None and now <= memo[1] and memo[0] == keys:
            return memo[2]
        get = self._loads.get
        stale_after = self._stale_after_s
        oldest = now - stale_after
        out: list[EngineLoad | None] = [get(key) for key in keys]
        until = math.inf
        for i, load in enumerate(out):
            if load is not None:
                if load.at < oldest:
                    out[i] = None
                elif load.at + stale_after < until:
                    until = load.at + stale_after  # this one goes stale then
        if len(self._memo) >= MAX_LOADS_MEMO:
            self._memo.clear()
        self._memo[id(keys)] = (list(keys), until, out)
        return out

    def put(self, key: str, load: EngineLoad) -> None:
        self._loads[key] = load
        self._memo.clear()
        if self.listener is not None:
            self.listener(key, load)

    def apply_remote(self, key: str, load: EngineLoad) -> None:
        """Another worker of this host scraped `key` (`put` without echo)."""
        self._loads[key] = load
        self._memo.clear()

    def retain(self, keys: set[str]) -> None:
        for key in [k for k in self._loads if k not in keys]:
            del self._loads[key]
        self._memo.clear()

    def __len__(self) -> int:
        return len(self._loads)


@dataclass(slots=True)
class ScrapeSettings:
    interval_s: float = DEFAULT_INTERVAL_S
    timeout_s: float = DEFAULT_TIMEOUT_S
    stale_after_intervals: float = DEFAULT_STALE_AFTER_INTERVALS
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    enabled: bool = True


class MetricsScraper:
    """Scrapes every pod of the view into an `EngineMetricsStore` (run it as a task)."""

    def __init__(
        self,
        store: EngineMetricsStore,
        metrics: SchedulerMetrics,
        settings: ScrapeSettings | None = None,
        on_capacity: Callable[[str, int | None], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self._metrics = metrics
        self.settings = settings or ScrapeSettings()
        self._on_capacity = on_capacity
        self._clock = clock
        #: base URL -> (key, `engine` label or None for the whole page) of each target
        self._pages: dict[str, tuple[tuple[str, bytes | None], ...]] = {}
        #: base URL -> (scheme, host, port, the filtered GET's head, the whole page's)
        self._where: dict[str, tuple[str, str, int, bytes, bytes]] = {}
        #: Pages whose filtered answer held none of the series and whose whole page did:
        #: read whole (bounded by the pages in the view).
        self._whole: set[str] = set()
        #: The connections of `run` while it runs (`reconfigure` updates its timeout).
        self._pool: Pool | None = None
        self._running: dict[str, asyncio.Task[None]] = {}
        self._capacity: dict[str, int | None] = {}
        #: Rank targets whose `engine` series their page lacked, warned about once (bounded
        #: by the targets in the view).
        self._unlabelled: set[str] = set()
        #: True on workers that leave scraping to worker 0 (`run` returns at once).
        self.passive = False
        self._apply_settings()

    def _apply_settings(self) -> None:
        s = self.settings
        self.store.stale_after_s = s.interval_s * s.stale_after_intervals
        self._semaphore = asyncio.Semaphore(max(1, s.max_concurrency))
        if self._pool is not None:
            self._pool.connect_timeout_s = s.timeout_s

    def _new_pool(self) -> Pool:
        return Pool(MAX_CONNECTIONS, MAX_CONNECTIONS_PER_HOST, KEEPALIVE_S,
                    self.settings.timeout_s)

    def reconfigure(self, settings: ScrapeSettings) -> None:
        self.settings = settings
        self._apply_settings()

    def on_snapshot(self, snapshot: Snapshot) -> None:
        pages: dict[str, list[tuple[str, int | None]]] = {}
        where: dict[str, tuple[str, str, int, bytes, bytes]] = {}
        for key, pod in snapshot.endpoints().items():
            url = pod.base_url
            pages.setdefault(url, []).append((key, pod.dp_rank))
            if url not in where:
                where[url] = (pod.scheme, pod.ip, pod.port, _page_request(url),
                              _page_request(url, filtered=False))
        self._where = where
        self._pages = {
            url: tuple(
                (key, None if rank is None or len(targets) == 1 else str(rank).encode())
                for key, rank in targets
            )
            for url, targets in pages.items()
        }
        keys = {key for targets in pages.values() for key, _ in targets}
        self.store.retain(keys)
        self._whole &= where.keys()
        for key in [k for k in self._capacity if k not in keys]:
            del self._capacity[key]
        self._unlabelled &= keys

    async def run(self) -> None:
        if self.passive:
            return
        loop = asyncio.get_running_loop()
        pool = self._pool = self._new_pool()
        try:
            while True:
                began = loop.time()
                pages = self._pages if self.settings.enabled else {}
                for url in pages:
                    if url not in self._running:
                        task = asyncio.create_task(self._scrape(pool, url))
                        self._running[url] = task
                        task.add_done_callback(self._finished(url))
                interval = self.settings.interval_s
                await asyncio.sleep(max(0.0, interval - (loop.time() - began)))
        finally:
            self._pool = None
            tasks = list(self._running.values())
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await pool.close()

    def _finished(self, url: str) -> Callable[[asyncio.Task[None]], None]:
        def done(_task: asyncio.Task[None]) -> None:
            self._running.pop(url, None)

        return done

    async def scrape_once(self) -> None:
        """Scrape every pod once and wait for all of them (tests, warm-up)."""
        pool = self._new_pool()
        try:
            await asyncio.gather(*(self._scrape(pool, url) for url in self._pages))
        finally:
            await pool.close()

    async def _scrape(self, pool: Pool, url: str) -> None:
        filtered = url not in self._whole
        page = await self._page(pool, url, filtered)
        loads = self._loads(url, page)
        if filtered and _refused_or_empty(page) and url in self._pages and not _any_load(loads):
            # Not what a filtered page holds (a 4xx, or none of the series): the whole
            # page, and from then on always, if that one has them. A 5xx is the engine's.
            page = await self._page(pool, url, filtered=False)
            loads = self._loads(url, page)
            if _any_load(loads):
                self._whole.add(url)
        if page is None:
            return  # failed, and counted
        if isinstance(page, int):
            self._metrics.scrape_errors.labels(reason="http").inc()
            return
        if loads is None:
            return  # the pod left while we were reading
        missing: list[tuple[str, bytes | None]] = []
        for key, engine, load in loads:
            if not _has_load(load):
                missing.append((key, engine))
                continue
            self.store.put(key, load)
            if self._on_capacity is not None and self._capacity.get(key) != load.capacity_tokens:
                self._capacity[key] = load.capacity_tokens
                self._on_capacity(key, load.capacity_tokens)
        if _any_load(loads):  # counted a page, not a target
            self._metrics.scrapes.inc()
            self._warn_unlabelled(url, missing)
        else:
            self._metrics.scrape_errors.labels(reason="parse").inc()

    def _loads(self, url: str, page: bytes | int | None) -> list[_Target] | None:
        """Each target's load on a page read, or None (no page, or the pod left)."""
        targets = self._pages.get(url)
        if not isinstance(page, bytes) or targets is None:
            return None
        at = self._clock()
        return [(key, engine, parse_engine_metrics(page, at, engine)) for key, engine in targets]

    async def _page(self, pool: Pool, url: str, filtered: bool) -> bytes | int | None:
        """One pod's page, or its HTTP status when not 200, or None after counting a
        timeout or a connection that failed."""
        where = self._where.get(url)
        if where is None:
            return None
        scheme, host, port, filtered_head, whole_head = where
        head = filtered_head if filtered else whole_head
        try:
            async with self._semaphore, asyncio.timeout(self.settings.timeout_s):
                response = await pool.request(scheme, host, port, head, b"")
                try:
                    if response.status != 200:
                        return response.status
                    return _decoded(await _read_bounded(response),
                                    response.headers.get("content-encoding"))
                finally:
                    response.release()
        except TimeoutError:
            self._metrics.scrape_errors.labels(reason="timeout").inc()
        except (ConnectionBroken, OSError):
            self._metrics.scrape_errors.labels(reason="connect").inc()
        return None

    def _warn_unlabelled(self, url: str, missing: list[tuple[str, bytes | None]]) -> None:
        """A page that serves some of its ranks but not these: vLLM labels a node's series
        with the global ranks it runs, so the pod's first rank (or its size) is declared
        wrong. Once a target."""
        for key, engine in missing:
            if engine is not None and key not in self._unlabelled:
                self._unlabelled.add(key)
                log.warning("%s/metrics has no series with engine=\"%s\" for %s: is the "
                            "pod's first data-parallel rank right?", url, engine.decode(), key)


#: (pod key, `engine` label or None, the load read for it) of one target of a page.
_Target = tuple[str, bytes | None, EngineLoad]


def _has_load(load: EngineLoad) -> bool:
    return load.running is not None or load.waiting is not None or load.kv_usage is not None


def _any_load(loads: list[_Target] | None) -> bool:
    return loads is not None and any(_has_load(load) for _, _, load in loads)


def _refused_or_empty(page: bytes | int | None) -> bool:
    """A page read, or a 4xx: what a server that does not take the filter may answer."""
    return isinstance(page, bytes) or (page is not None and 400 <= page < 500)


#: The query of a filtered scrape: `name[]` once for each sample read (brackets escaped).
_FILTER: Final = "?" + "&".join(f"name%5B%5D={name.decode()}" for name in READ_SAMPLES)


def _page_request(base_url: str, filtered: bool = True) -> bytes:
    """The head of a GET of a pod's `/metrics`, filtered to the series read (see the
    module docstring)."""
    host = base_url.split("://", 1)[-1]
    query = _FILTER if filtered else ""
    return (f"GET /metrics{query} HTTP/1.1\r\nhost: {host}\r\naccept: text/plain\r\n"
            "accept-encoding: identity\r\n\r\n").encode("latin-1")


def _decoded(body: bytes, encoding: str | None) -> bytes:
    """The page as text: a proxy on the way may compress it although asked not to (gzip
    or deflate, inflated to at most `MAX_METRICS_BYTES`; a broken one parses as nothing)."""
    if encoding is None or encoding == "identity":
        return body
    wbits = {"gzip": 31, "deflate": 15}.get(encoding.strip().lower())
    if wbits is None:
        return b""
    try:
        return zlib.decompressobj(wbits).decompress(body, MAX_METRICS_BYTES)
    except zlib.error:
        return b""


async def _read_bounded(response: Response) -> bytes:
    """The page's first `MAX_METRICS_BYTES` (a longer page's connection is not reused)."""
    chunks: list[bytes] = []
    size = 0
    while size < MAX_METRICS_BYTES:
        chunk = await response.readany()
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)[:MAX_METRICS_BYTES]
