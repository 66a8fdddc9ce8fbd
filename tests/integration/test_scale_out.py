"""Several router processes, one view of load: `--workers 2`, and two peer replicas (whose
new prompts one of them places).

Real processes over loopback: a Mooncake master, two simulated PD groups, routers started
as `python -m router serve`. In-flight counts are checked against the truth the client
knows (which decode pod each open stream went to, from `x-pdgate-decode-pod`), in every
router process's own view (`pdgate_sync_seen_inflight_requests`, per origin): one scrape of
a `--workers 2` router holds both workers' samples, labelled `worker`.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import openai
import psutil
import pytest

from benchmarks.scale_out import _PodsOnly
from benchmarks.sched_policies import (
    DECODE_FLAGS,
    PolicyCluster,
    Prompt,
    SharedPrefix,
    policy_document,
    prefill_flags,
    shared_prefix,
    stream_chat,
)
from benchmarks.sched_policies import MODEL as SCHED_MODEL
from engine_sim.mooncake_master import MooncakeMaster
from engine_sim.ports import free_ports
from router.sync.config import DEFAULT_HEARTBEAT_S
from tests.integration.harness import (
    Process,
    SimCluster,
    SimPodSpec,
    free_port,
    loopback_net,
    metric_values,
    pd_server_manifests,
    pod_manifest,
    wait_http,
    write_yaml,
)

MODEL = "sim-scale-model"
NET = loopback_net()
GROUPS = {"g0": (f"{NET}.61", f"{NET}.62"), "g1": (f"{NET}.71", f"{NET}.72")}
#: The precise-index test's own pods.
PRECISE_NET = loopback_net()
DECODE_PODS = {f"default/{g}-decode" for g in GROUPS}
#: Streams held open at once (each keeps one decode pod busy for ~STREAM_TOKENS x ITL).
STREAMS = 8
STREAM_TOKENS = 150
ITL_MS = 20
#: The sync TTL the routers run with (seconds); a lost peer is dropped within TTL + one tick.
TTL_S = 1.0
#: README "Running more than one": a dead peer is dropped within --sync-ttl plus one
#: heartbeat (the tick that checks ages); observing it here adds a scrape's latency.
DROPPED_WITHIN_S = TTL_S + DEFAULT_HEARTBEAT_S
OBSERVE_SLACK_S = 0.7
#: 6 system prompts x 4 questions: the precise-index test's traffic (fills the caches).
PRECISE_WORKLOAD = SharedPrefix(groups=6, questions=4, system_tokens=1024, seed=7)
#: The prefilling test's pods, and its groups: two questions each, behind a system prompt
#: whose prefill (about 2 s at 1 ms a token) outlasts the sync's latency many times over.
PREFILLING_NET = loopback_net()
PREFILLING_WORKLOAD = SharedPrefix(groups=3, questions=2, system_tokens=2048, seed=11)
PREFILLING_FLAGS = (*prefill_flags(capacity_blocks=1024), "--prefill-per-token-ms", "1.0")
#: Seconds workers get to drain and exit once their supervisor is gone (nothing in flight).
ORPHAN_EXIT_S = 10.0
#: Requests and scrapes of the one-exposition test.
REQUESTS = 40
SCRAPES = 6
#: The label a `--workers N` exposition puts first on every sample (`{worker="1",...`).
WORKER_LABEL = re.compile(r'(?<=\{)worker="(\d+)",?')


def _specs() -> list[SimPodSpec]:
    return [
        SimPodSpec(name=f"{group}-{role}", ip=ip, role=role, group=group,
                   labels={"app": "sim-scale", "group": group, "role": role})
        for group, ips in GROUPS.items()
        for role, ip in zip(("prefill", "decode"), ips, strict=True)
    ]  # fmt: skip


@pytest.fixture(scope="module")
def pods(mooncake_master: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimCluster]:
    sim = SimCluster(mooncake_master, tmp_path_factory.mktemp("scale-out"))
    specs = _specs()
    port = free_port([spec.ip for spec in specs])
    try:
        for spec in specs:
            flags = ["--itl-ms", str(ITL_MS), "--prefill-overhead-ms", "2"]
            sim.start_pod(spec, port, MODEL, flags)
        sim.wait_pods(port, specs)
        server = pd_server_manifests("sim-scale", MODEL, port=port)
        write_yaml(sim.config_dir / "server.yaml", server)
        write_yaml(sim.config_dir / "pods.yaml", [pod_manifest(s) for s in specs])
        yield sim
    finally:
        sim.stop()


def _router(sim: SimCluster, name: str, port: int, extra: list[str]) -> Process:
    return sim.serve_router(name, ["--sync-ttl", str(TTL_S), *extra], port)


def _two_replicas(sim: SimCluster, name: str) -> tuple[list[Process], list[str]]:
    """Two router replicas peered over their sync ports: (processes, base URLs)."""
    drawn = free_ports(4)  # together, so no HTTP port is also a sync port
    ports, syncs = drawn[:2], drawn[2:]
    routers = [
        _router(sim, f"{name}-{i}", ports[i],
                ["--sync-port", str(syncs[i]), "--peers", f"127.0.0.1:{syncs[1 - i]}"])
        for i in range(2)
    ]
    return routers, [f"http://127.0.0.1:{p}" for p in ports]


def _metrics_once(url: str) -> str:
    request = urllib.request.Request(f"{url}/metrics", headers={"Connection": "close"})
    with urllib.request.urlopen(request, timeout=5) as response:
        return str(response.read().decode())


def split_workers(text: str) -> dict[str, str]:
    """worker index -> its samples, label removed ({"": text} for a single process).

    With `--workers N` one scrape holds every worker's samples, each labelled
    `worker="i"` (router/sync/exposition.py).
    """
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        match = WORKER_LABEL.search(line)
        if match is None:
            continue
        line = WORKER_LABEL.sub("", line, count=1)
        out.setdefault(match.group(1), []).append(line.replace("{} ", " ", 1))
    return {w: "\n".join(lines) for w, lines in out.items()} or {"": text}


def _origin(text: str) -> str:
    [(labels, _)] = metric_values(text, "pdgate_sync_info")
    return labels.split('"')[1]


def per_process_metrics(urls: list[str], processes: int) -> dict[str, str]:
    """origin -> its samples: one scrape per URL covers every process behind it."""
    seen: dict[str, str] = {}
    for url in urls:
        for text in split_workers(_metrics_once(url)).values():
            seen[_origin(text)] = text
    assert len(seen) == processes, f"{sorted(seen)}: not the {processes} router processes"
    return seen


def seen_inflight(text: str) -> dict[str, float]:
    return {labels.split('"')[1]: v
            for labels, v in metric_values(text, "pdgate_sync_seen_inflight_requests")}


async def wait_ready(urls: list[str], processes: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            views = await asyncio.to_thread(per_process_metrics, urls, processes)
        except (AssertionError, OSError):  # a worker still starting: not in the scrape yet
            assert time.monotonic() < deadline, "the router processes did not all start"
            await asyncio.sleep(0.2)
            continue
        ready = [metric_values(t, "pdgate_ready") == [("", 1.0)] for t in views.values()]
        live = [sum(v for lb, v in metric_values(t, "pdgate_peers") if "live" in lb)
                for t in views.values()]
        if all(ready) and all(n == processes - 1 for n in live):
            return
        assert time.monotonic() < deadline, f"not ready: {ready}, live peers {live}"
        await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def open_streams(urls: list[str], count: int) -> AsyncIterator[Counter[str]]:
    """`count` streams, alternating between `urls`, held open; yields decode pod -> streams."""
    truth: Counter[str] = Counter()
    started = asyncio.Event()
    errors: list[str] = []

    async def one(session: aiohttp.ClientSession, url: str, release: asyncio.Event) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "tell a long story"}],
                "max_tokens": STREAM_TOKENS, "stream": True}
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            if response.status != 200:
                errors.append(await response.text())
                return
            pod = "default/" + response.headers["x-pdgate-decode-pod"]
            truth[pod] += 1
            if sum(truth.values()) == count:
                started.set()
            await release.wait()
        truth[pod] -= 1

    release = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(one(session, urls[i % len(urls)], release))
                 for i in range(count)]
        await asyncio.wait_for(started.wait(), 30)
        assert not errors, errors
        try:
            yield truth
        finally:
            release.set()  # closing the streams early cancels them upstream
            await asyncio.gather(*tasks)
    assert not errors, errors


async def assert_views_match(urls: list[str], processes: int, truth: Counter[str]) -> None:
    """Every process sees each decode pod's true count within one, once messages settle."""
    deadline = time.monotonic() + 5
    while True:
        views = await asyncio.to_thread(per_process_metrics, urls, processes)
        off = {origin: {pod: seen_inflight(text).get(pod, 0) - truth.get(pod, 0)
                        for pod in DECODE_PODS}
               for origin, text in views.items()}
        if all(abs(d) <= 1 for view in off.values() for d in view.values()):
            return
        assert time.monotonic() < deadline, f"views differ from the truth {dict(truth)}: {off}"
        await asyncio.sleep(DEFAULT_HEARTBEAT_S)


async def assert_all_zero(urls: list[str], processes: int) -> None:
    deadline = time.monotonic() + 5
    while True:
        views = await asyncio.to_thread(per_process_metrics, urls, processes)
        left = {o: {p: n for p, n in seen_inflight(t).items() if n} for o, t in views.items()}
        if not any(left.values()):
            return
        assert time.monotonic() < deadline, f"in flight after the traffic ended: {left}"
        await asyncio.sleep(DEFAULT_HEARTBEAT_S)


async def test_two_workers_share_inflight_counts(pods: SimCluster) -> None:
    port = free_port()
    router = _router(pods, "workers", port, ["--workers", "2"])
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ready([url], 2)
        async with open_streams([url], STREAMS) as truth:
            assert set(truth) <= DECODE_PODS
            await assert_views_match([url], 2, truth)
        await assert_all_zero([url], 2)
    finally:
        assert router.stop() == 0, router.log()[-3000:]


async def test_one_scrape_covers_every_worker(pods: SimCluster) -> None:
    """`/metrics` of `--workers 2` holds both workers' counters, whichever worker answers."""
    port = free_port()
    router = _router(pods, "workers-metrics", port, ["--workers", "2"])
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ready([url], 2)
        before = served(_metrics_once(url))
        # A fresh connection per request: SO_REUSEPORT spreads them over both workers.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            for i in range(REQUESTS):
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"q {i}"}],
                        "max_tokens": 2}
                async with s.post(f"{url}/v1/chat/completions", json=body) as response:
                    assert response.status == 200, await response.text()
        scrapes = [served(_metrics_once(url)) for _ in range(SCRAPES)]
        for after in scrapes:  # every scrape, whichever worker made it, sees both
            assert set(after) == {"0", "1"}, after
            added = {w: after[w] - before.get(w, 0) for w in after}
            assert sum(added.values()) == REQUESTS, (before, after)
            assert all(n > 0 for n in added.values()), added  # both workers served some
            assert all(after[w] >= before.get(w, 0) for w in after)
        text = _metrics_once(url)
        assert 'pdgate_metrics_workers{state="answered"} 2.0' in text
        assert text.count("# TYPE pdgate_requests_total counter") == 1
    finally:
        assert router.stop() == 0, router.log()[-3000:]


def served(text: str) -> dict[str, float]:
    """worker -> chat requests it answered with 200 (`pdgate_requests_total`)."""
    out: dict[str, float] = {}
    for worker, samples in split_workers(text).items():
        out[worker] = sum(v for labels, v in metric_values(samples, "pdgate_requests_total")
                          if 'status="200"' in labels)
    return out


async def test_two_replicas_share_counts_and_survive_a_killed_peer(pods: SimCluster) -> None:
    routers, urls = _two_replicas(pods, "replica")
    try:
        await wait_ready(urls, 2)
        async with open_streams(urls, STREAMS) as truth:
            await assert_views_match(urls, 2, truth)
        await assert_all_zero(urls, 2)

        # Replica 1 holds streams when it is SIGKILLed; replica 0 keeps serving its own
        # requests throughout, and drops replica 1 (and its in-flight counts) within TTL.
        survivor = openai.AsyncOpenAI(base_url=f"{urls[0]}/v1", api_key="unused", max_retries=0)
        doomed = asyncio.create_task(_hold_streams(urls[1], 4))
        await asyncio.sleep(1.0)
        before = seen_inflight(_metrics_once(urls[0]))
        assert sum(before.get(p, 0) for p in DECODE_PODS) >= 4, before

        async def ask(i: int) -> None:
            await survivor.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"question {i}"}],
                max_tokens=4,
            )

        traffic = asyncio.gather(*(ask(i) for i in range(40)))
        routers[1].popen.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        killed_at = time.monotonic()
        lost_after = None
        while lost_after is None:
            text = _metrics_once(urls[0])
            peers = dict(metric_values(text, "pdgate_peers"))
            if peers.get('{state="lost"}') == 1 and peers.get('{state="live"}') == 0:
                lost_after = time.monotonic() - killed_at
            else:
                assert time.monotonic() - killed_at < DROPPED_WITHIN_S + 2 * OBSERVE_SLACK_S
                await asyncio.sleep(0.05)
        await traffic  # raises if any of the survivor's own requests failed
        doomed.cancel()
        with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
            await doomed
        assert lost_after <= DROPPED_WITHIN_S + OBSERVE_SLACK_S, lost_after
        await assert_all_zero([urls[0]], 1)
    finally:
        for router in routers:
            router.stop(signal.SIGKILL if router is routers[1] else signal.SIGTERM)


def placements(text: str) -> dict[str, float]:
    """outcome -> count of `pdgate_sync_placements_total` in one process's samples."""
    return {labels.split('"')[1]: v
            for labels, v in metric_values(text, "pdgate_sync_placements_total")}


async def test_two_replicas_place_new_prompts_as_one_process(pods: SimCluster) -> None:
    """Two different new prompts reach the two replicas at once, eight times over: every
    new prompt the other replica receives is placed by the leader (the lowest origin;
    answered, none timed out), and each pair starts on the two prefill pods, as one
    process places them. (On this machine two routers deciding apart also split most
    pairs, so the asks are what shows the leader placed them; the pair check guards
    against a placement that ignores the leader's own pick.)"""
    routers, urls = _two_replicas(pods, "placing")
    try:
        await wait_ready(urls, 2)
        leader = min(await asyncio.to_thread(per_process_metrics, urls, 2))
        async with aiohttp.ClientSession() as http:
            for pair in range(8):
                bodies = [
                    {"model": MODEL, "max_tokens": 2, "stream": True, "messages": [
                        {"role": "system", "content": f"Pair {pair}, tenant {i}. " * 60},
                        {"role": "user", "content": "hello"}]}
                    for i in range(2)
                ]  # fmt: skip
                first, second = await asyncio.gather(
                    *(stream_chat(http, url, body) for url, body in zip(urls, bodies, strict=True))
                )
                assert first.status == second.status == 200
                assert {first.prefill, second.prefill} == {"g0-prefill", "g1-prefill"}, pair
        views = await asyncio.to_thread(per_process_metrics, urls, 2)
        (other,) = (origin for origin in views if origin != leader)
        asked = placements(views[other])
        assert asked["answered"] >= 8 and asked["timeout"] == 0, asked
        assert placements(views[leader])["served"] == asked["answered"]
        # The leader's picks for the other replica are not counted as its own decisions:
        # over both, one decision per request.
        decisions = sum(value for text in views.values() for _, value in
                        metric_values(text, "pdgate_scheduler_decision_seconds_count"))
        assert decisions == 16, decisions
    finally:
        for router in routers:
            router.stop(signal.SIGTERM)


async def _hold_streams(url: str, count: int) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a long story"}],
            "max_tokens": STREAM_TOKENS, "stream": True}
    async with aiohttp.ClientSession() as session:

        async def one() -> None:
            async with session.post(f"{url}/v1/chat/completions", json=body) as response:
                async for _ in response.content:
                    pass

        await asyncio.gather(*(one() for _ in range(count)))


async def test_precise_index_is_the_same_in_two_routers_without_any_sync(
    mooncake_master: MooncakeMaster, tmp_path: Path
) -> None:
    """KV events make the precise index consistent by construction: two routers that share
    nothing (no --sync-port, no peers) each read every engine's events, so after the same
    traffic they hold the same number of blocks, and a prompt asked of either lands on a
    pod holding as much of it as the other's pick did (exactly the engine's cached tokens)."""
    async with _PodsOnly(
        tmp_path, groups=3, subnet=PRECISE_NET, prefill_flags=prefill_flags(),
        decode_flags=DECODE_FLAGS, policy="precise-prefix-cache",
        mooncake=(mooncake_master.rpc_address, mooncake_master.metadata_url),
    ) as cluster:
        strict = {"cacheSimilarity": 0.0, "tieTolerance": 0.0}
        # Decode by this router's own load only: the engines' scraped load shows the other
        # router's last request for a scrape interval, which outweighs two cached blocks
        # (a decode pod's KV usage is not what this test is about).
        profiles = {"prefill": {"scorers": [
            {"type": "precise-prefix-cache", "weight": 1.0, "storeHitFactor": 0.0},
            {"type": "least-request", "weight": 1.0}], "picker": strict},
            "decode": {"scorers": [{"type": "least-request", "weight": 1.0}]}}
        write_yaml(cluster.scheduler_file, [policy_document("precise-prefix-cache", profiles)])
        argv = ["--config", str(cluster.config_dir), "--scheduler-config",
                str(cluster.scheduler_file)]
        ports = free_ports(2)
        routers = [_router_argv(tmp_path, f"precise-{i}", ports[i], argv) for i in range(2)]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        try:
            prompts = shared_prefix(PRECISE_WORKLOAD)
            async with aiohttp.ClientSession() as http:
                # Both routers place the same traffic, alternating, four at a time.
                for start in range(0, len(prompts), 4):
                    results = await asyncio.gather(*(
                        stream_chat(http, urls[i % 2], prompts[i].body(SCHED_MODEL, 2, "fill"))
                        for i in range(start, min(start + 4, len(prompts)))
                    ))
                    assert all(r.status == 200 and r.completed for r in results), results
                await _same_precise_blocks(urls)
                picks = []
                for prompt in prompts[:: PRECISE_WORKLOAD.questions]:  # one per group
                    # Router 0 places the prompt (its pod now holds all of it); once router
                    # 1 has read the same events, it sends the prompt where router 0 does.
                    body = prompt.body(SCHED_MODEL, 2, "fill")
                    await cached_tokens(cluster, http, urls[0], body)
                    await _same_precise_blocks(urls)
                    picks.append([await cached_tokens(cluster, http, url, body)
                                  for url in (urls[1], urls[0])])
            assert all(one == zero > 0 for one, zero in picks), picks
        finally:
            for router in routers:
                assert router.stop() == 0, router.log()[-3000:]


async def test_a_replica_sees_the_prompts_the_other_is_prefilling(
    mooncake_master: MooncakeMaster, tmp_path: Path
) -> None:
    """The precise index learns a pod's blocks from the engine's events, sent once the
    prefill has stored them; until then the router that sent a prompt holds it as in
    flight to that pod. Two peered replicas share that record: the next question of a
    group, sent to the other replica while the first is still prefilling, goes to the
    first's pod (as in one process) instead of to an idle pod."""
    async with _PodsOnly(
        tmp_path, groups=3, subnet=PREFILLING_NET, prefill_flags=PREFILLING_FLAGS,
        decode_flags=DECODE_FLAGS, policy="precise-prefix-cache",
        mooncake=(mooncake_master.rpc_address, mooncake_master.metadata_url),
    ) as cluster:
        argv = ["--config", str(cluster.config_dir), "--scheduler-config",
                str(cluster.scheduler_file), "--sync-ttl", str(TTL_S)]
        drawn = free_ports(4)  # together, so no HTTP port is also a sync port
        ports, syncs = drawn[:2], drawn[2:]
        routers = [
            _router_argv(tmp_path, f"prefilling-{i}", ports[i], [
                *argv, "--sync-port", str(syncs[i]), "--peers", f"127.0.0.1:{syncs[1 - i]}"])
            for i in range(2)
        ]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        prefill_pods = {f"default/{pod.name}" for pod in cluster.prefill_pods}
        try:
            await wait_ready(urls, 2)
            groups: dict[int, list[Prompt]] = {}
            for prompt in shared_prefix(PREFILLING_WORKLOAD):
                groups.setdefault(prompt.group, []).append(prompt)
            pairs = []
            async with aiohttp.ClientSession() as http:
                for first, second in groups.values():
                    blocks = await asyncio.to_thread(_precise_blocks, urls[1])
                    sent = asyncio.create_task(
                        stream_chat(http, urls[0], first.body(SCHED_MODEL, 2, "fill")))
                    await _busy_in_view(urls[1], prefill_pods)
                    # Still prefilling: no event of it has reached the other replica.
                    assert await asyncio.to_thread(_precise_blocks, urls[1]) == blocks
                    after = await stream_chat(http, urls[1], second.body(SCHED_MODEL, 2, "fill"))
                    before = await sent
                    assert before.status == after.status == 200, (before, after)
                    assert before.completed and after.completed, (before, after)
                    pairs.append((before.prefill, after.prefill))
                    await assert_all_zero(urls, 2)
            assert all(one == two for one, two in pairs), pairs
            assert len({one for one, _ in pairs}) > 1, pairs  # the groups spread over pods
        finally:
            for router in routers:
                assert router.stop() == 0, router.log()[-3000:]


def _precise_blocks(url: str) -> float:
    """The blocks the router at `url` holds in its precise index."""
    return dict(metric_values(_metrics_once(url), "pdgate_prefix_index_blocks")
                )['{index="precise"}']


async def _busy_in_view(url: str, pods: set[str]) -> None:
    """Until the router at `url` sees a request in flight on one of `pods`."""
    deadline = time.monotonic() + 10
    while not any(n for pod, n in seen_inflight(
            await asyncio.to_thread(_metrics_once, url)).items() if pod in pods):
        assert time.monotonic() < deadline, "the other replica's request never showed"
        await asyncio.sleep(0.005)


async def cached_tokens(
    cluster: PolicyCluster, http: aiohttp.ClientSession, url: str, body: dict[str, object]
) -> int:
    """Send `body` through `url`; the prompt tokens its prefill pod found cached."""
    result = await stream_chat(http, url, body)
    assert result.status == 200 and result.completed and result.prefill is not None
    pod = next(p for p in cluster.prefill_pods if p.name == result.prefill)
    return int((await cluster.sim_json(pod))["recent"][-1]["cached_tokens"])


async def _same_precise_blocks(urls: list[str]) -> None:
    """Until both routers' precise indexes hold the same block count, twice in a row."""
    deadline = time.monotonic() + 10
    last: list[float] = []
    while True:
        counts = [await asyncio.to_thread(_precise_blocks, url) for url in urls]
        if counts[0] == counts[1] > 0 and counts == last:
            return
        assert time.monotonic() < deadline, f"precise index blocks differ: {counts}"
        last = counts
        await asyncio.sleep(0.3)


def _router_argv(tmp: Path, name: str, port: int, argv: list[str]) -> Process:
    process = Process(
        [sys.executable, "-m", "router", "serve", *argv, "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning"],
        tmp / f"{name}.log",
    )  # fmt: skip
    process.start()
    wait_http(f"http://127.0.0.1:{port}/readyz")
    return process


async def test_workers_stop_when_their_supervisor_is_killed(pods: SimCluster) -> None:
    """A SIGKILLed supervisor leaves no worker serving its port, unsupervised."""
    port = free_port()
    router = _router(pods, "workers-orphans", port, ["--workers", "2"])
    url = f"http://127.0.0.1:{port}"
    workers: list[psutil.Process] = []
    try:
        await wait_ready([url], 2)
        assert router.popen is not None
        workers = [p for p in psutil.Process(router.popen.pid).children() if p.is_running()]
        assert len(workers) == 2
        router.popen.send_signal(signal.SIGKILL)
        router.popen.wait()
        _, alive = await asyncio.to_thread(psutil.wait_procs, workers, ORPHAN_EXIT_S)
        assert not alive, [p.pid for p in alive]
        with pytest.raises(OSError):
            _metrics_once(url)
    finally:
        router.stop(signal.SIGKILL)
        for worker in workers:  # if the test failed: no orphan outlives it
            with contextlib.suppress(psutil.Error):
                worker.kill()
