"""Tokenizer parity on data-parallel pods: one probe an API server, not one a rank.

vLLM's `--data-parallel-size N` serves every rank of a pod from one API server with one
tokenizer, so the parity prober asks each such server once and records the answer for
each of its ranks (a server's parity still reads per target). Two pods of two ranks each,
each pod's API server a small HTTP server on loopback that tokenizes with the simulator's
tokenizer and counts what it is asked.
"""

from __future__ import annotations

import socket
from collections import Counter

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from router.tokenization import parity
from router.tokenization.parity import PROBES, ParityProber
from router.view import DataParallel, Endpoint, ServerPods, Snapshot
from tests.sim_tokens import sim_registry, sim_server, sim_tokenizer


async def _engine(asked: Counter[int], wrong: bool = False) -> web.AppRunner:
    async def tokenize(request: web.Request) -> web.Response:
        asked[request.url.port or 0] += 1
        body = await request.json()
        form = "chat" if "messages" in body else "completion"
        ids = list(sim_tokenizer().request_ids(form, body)[0])
        return web.json_response({"tokens": ids[1:] if wrong else ids})

    app = web.Application()
    app.router.add_post(parity.TOKENIZE_PATH, tokenize)
    runner = web.AppRunner(app)
    await runner.setup()
    return runner


async def _probe_two_pods(wrong: bool = False) -> tuple[Counter[int], list[int],
                                                        ParityProber, CollectorRegistry]:
    """Two 2-rank pods, each its own API server, probed once by a fresh prober."""
    asked: Counter[int] = Counter()
    runner = await _engine(asked, wrong)
    ports = []
    for _ in range(2):  # two pods, each its own API server
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        ports.append(sock.getsockname()[1])
        await web.SockSite(runner, sock).start()
    try:
        server = sim_server()
        targets = tuple(
            Endpoint("default", f"pod{i}", "127.0.0.1", port, "both", dp_rank=rank,
                     rank_pin=str(rank))
            for i, port in enumerate(ports) for rank in range(2)
        )
        pods = ServerPods(server, aggregated=targets, data_parallel=DataParallel(size=2))
        tokenizers = sim_registry()
        await tokenizers.wait_loaded()
        registry = CollectorRegistry()
        prober = ParityProber(tokenizers, registry)
        prober.on_snapshot(Snapshot(servers={server.meta.key: pods}))
        async with aiohttp.ClientSession() as session:
            assert await prober.probe_due(session) is False
        return asked, ports, prober, registry
    finally:
        await runner.cleanup()


async def test_a_data_parallel_pod_is_probed_once_for_all_its_ranks() -> None:
    asked, ports, prober, _ = await _probe_two_pods()
    assert asked == {port: len(PROBES) for port in ports}  # each server once
    for i, rank in ((0, 0), (0, 1), (1, 0), (1, 1)):
        result = prober.pod_result(f"default/pod{i}/dp{rank}")
        assert result is not None and result.status == "match", (i, rank, result)
    assert prober.status(sim_server().meta.key) == "match"


async def test_a_mismatch_counts_once_a_probe_not_once_a_rank() -> None:
    asked, ports, prober, registry = await _probe_two_pods(wrong=True)
    assert asked == {port: 1 for port in ports}  # the chat form differed: no second form
    assert prober.status(sim_server().meta.key) == "mismatch"
    namespace, name = sim_server().meta.key
    labels = {"namespace": namespace, "server": name}
    assert registry.get_sample_value("pdgate_tokenizer_parity_mismatches_total", labels) == 2
    assert registry.get_sample_value("pdgate_tokenizer_parity_probes_total",
                                     {"result": "mismatch"}) == 2
