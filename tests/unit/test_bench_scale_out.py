"""`benchmarks.scale_out`: the open loop of its fixed-rate part (`send_at_rate`, against
two loopback SSE servers standing in for two router URLs) and its tables' ratios."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from benchmarks.scale_out import Routers, Run, fast_table, fixed_table, send_at_rate, tiny_prompts
from benchmarks.sched_policies import RequestResult
from tests.local_http import serve

EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"pong"}}]}\n\ndata: [DONE]\n\n'


async def _start(counts: list[int], index: int) -> tuple[web.AppRunner, str]:
    async def chat(request: web.Request) -> web.StreamResponse:
        counts[index] += 1
        await request.read()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(EVENT)
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner, port = await serve(app)
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def two_urls() -> AsyncIterator[tuple[Routers, list[int]]]:
    counts = [0, 0]
    started = [await _start(counts, i) for i in range(2)]
    routers = Routers("2 routers, no sync", [url for _, url in started], [], 2)
    routers.pools = [aiohttp.ClientSession() for _ in started]
    yield routers, counts
    for pool in routers.pools:
        await pool.close()
    for runner, _ in started:
        await runner.cleanup()


async def test_requests_go_out_at_the_rate_alternating_between_urls(
    two_urls: tuple[Routers, list[int]],
) -> None:
    routers, counts = two_urls
    started = time.perf_counter()
    results, seconds, _ = await send_at_rate(routers, tiny_prompts(20), "s", 100.0, "m")
    # Paced: the 20th request leaves 0.19 s after the first.
    assert time.perf_counter() - started >= 0.185
    assert seconds >= 0.185
    assert [r.status for r in results] == [200] * 20
    assert all(r.completed and r.ttft is not None for r in results)
    assert counts == [10, 10]


def test_tables_give_each_setup_against_one_process() -> None:
    done = [RequestResult(0.002, 200, None, None, None, True)] * 100
    one = Run("one process", "fixed", done, cpu_s=0.05, seconds=1.0, idle_cpu_s=0.01)
    two = Run("--workers 2", "fixed", done, cpu_s=0.08, seconds=1.0, idle_cpu_s=0.02)
    fixed = fixed_table({"--workers 2": two, "one process": one}).splitlines()
    assert fixed[2].startswith("| one process | 100 | 0.50 | 1.00x | 0.40 | 1.00x |")
    assert fixed[3].startswith("| --workers 2 | 100 | 0.80 | 1.60x | 0.60 | 1.50x |")
    fast = fast_table({"one process": one, "--workers 2": two}).splitlines()
    assert fast[3].startswith("| --workers 2 | 100 | 1.00x | 0.80 | 1.60x | 0.60 | 1.50x | 2.0% |")
