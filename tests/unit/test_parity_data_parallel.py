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


async def _engine(asked: Counter[int]) -> web.AppRunner:
    async def tokenize(request: web.Request) -> web.Response:
        asked[request.url.port or 0] += 1
        body = await request.json()
        form = "chat" if "messages" in body else "completion"
        return web.json_response({"tokens": list(sim_tokenizer().request_ids(form, body)[0])})

    app = web.Application()
    app.router.add_post(parity.TOKENIZE_PATH, tokenize)
    runner = web.AppRunner(app)
    await runner.setup()
    return runner


async def test_a_data_parallel_pod_is_probed_once_for_all_its_ranks() -> None:
    asked: Counter[int] = Counter()
    runner = await _engine(asked)
    ports = []
    for _ in range(2):  # two pods, each its own API server
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        ports.append(sock.getsockname()[1])
        await web.SockSite(runner, sock).start()
    try:
        server = sim_server()
        targets = tuple(
            Endpoint("default", f"pod{i}", "127.0.0.1", port, "aggregated", dp_rank=rank,
                     rank_pin=str(rank))
            for i, port in enumerate(ports) for rank in range(2)
        )
        pods = ServerPods(server, aggregated=targets, data_parallel=DataParallel(size=2))
        tokenizers = sim_registry()
        await tokenizers.wait_loaded()
        prober = ParityProber(tokenizers, CollectorRegistry())
        prober.on_snapshot(Snapshot(servers={server.meta.key: pods}))
        async with aiohttp.ClientSession() as session:
            assert await prober.probe_due(session) is False
        assert asked == {port: len(PROBES) for port in ports}  # each server once
        for target in targets:
            result = prober.pod_result(target.key)
            assert result is not None and result.status == "match", (target.key, result)
        assert prober.status(server.meta.key) == "match"
    finally:
        await runner.cleanup()
