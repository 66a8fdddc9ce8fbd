"""engine_sim with `--data-parallel-size 2` as a real process: requests pinned to a rank hit
only that rank's prefix cache, each rank publishes its KV events on its own port with its
rank, and /metrics has both engines. Then one node of a 4-rank deployment (hybrid load
balancing): the header's local index pins a global rank, which names everything else."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from engine_sim.ports import free_port_runs
from tests.vllm_kv_events import MapBlockStored, map_decoder

if TYPE_CHECKING:
    from conftest import SimPod

pytestmark = pytest.mark.integration

HOST = "127.0.0.1"
LONG_PROMPT = "The history of rivers and mountains, told slowly. " * 30


async def post(http: aiohttp.ClientSession, pod: SimPod, prompt: str,
               rank: str | None) -> tuple[int, Any]:
    headers = {} if rank is None else {"x-DATA-parallel-RANK": rank}  # any case
    body = {"model": pod.model, "prompt": prompt, "max_tokens": 2}
    async with http.post(f"{pod.base_url}/v1/completions", json=body,
                         headers=headers) as response:
        return response.status, await response.json()


async def get(http: aiohttp.ClientSession, pod: SimPod, path: str) -> Any:
    async with http.get(pod.base_url + path) as response:
        assert response.status == 200
        if response.content_type == "application/json":
            return await response.json()
        return await response.text()


async def subscribed(http: aiohttp.ClientSession, pod: SimPod, sub: zmq.asyncio.Socket,
                     rank: int) -> None:
    """Until `sub` gets a batch: short prompts pinned to `rank` (a ZMQ subscriber misses
    what is published before its subscription lands), then what it got is drained."""
    for attempt in range(200):
        status, _ = await post(http, pod, f"warm {rank} {attempt} " * 20, str(rank))
        assert status == 200
        try:
            await asyncio.wait_for(sub.recv_multipart(), 0.05)
        except TimeoutError:
            continue
        while await sub.poll(timeout=0):
            await sub.recv_multipart()
        return
    raise AssertionError(f"rank {rank}'s subscriber never got a batch")


async def stored_batches(sub: zmq.asyncio.Socket, upto: int) -> list[Any]:
    """Batches `sub` receives through sequence number `upto`."""
    batches = []
    while True:
        _, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
        batches.append(map_decoder.decode(payload))
        if int.from_bytes(seq, "big") >= upto:
            return batches


async def published_on_its_stream(
    sub: zmq.asyncio.Socket, view: dict[str, Any], before: list[Any], rank: int
) -> None:
    """Every block the rank cached since `before` (its `/sim/cache` view) came on its own
    stream, in batches naming that rank."""
    new = set(view["block_hashes"]) - set(before)
    assert new, f"rank {rank} cached nothing of the long prompt"
    batches = await stored_batches(sub, view["kv_events"]["last_seq"])
    assert {b.data_parallel_rank for b in batches} == {rank}
    published = {h for b in batches for e in b.events
                 if isinstance(e, MapBlockStored) for h in e.block_hashes}
    assert new <= published


async def test_two_ranks_two_caches_two_event_ports_one_metrics_page(
    sim_pod: Callable[..., SimPod],
) -> None:
    base, replay = free_port_runs(2, 2)
    pod = sim_pod(role="both", fast=True, data_parallel_size=2, kv_events_port=base,
                  kv_events_replay_port=replay)
    context = zmq.asyncio.Context()
    subs = []
    try:
        for rank in (0, 1):
            sub = context.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"tcp://{HOST}:{base + rank}")
            subs.append(sub)
        async with aiohttp.ClientSession() as http:
            for rank in (0, 1):
                await subscribed(http, pod, subs[rank], rank)
            before = {rank: (await get(http, pod, f"/sim/cache?rank={rank}"))["block_hashes"]
                      for rank in (0, 1)}  # fmt: skip

            for pin in ("0", "0", "1"):
                status, _ = await post(http, pod, LONG_PROMPT, pin)
                assert status == 200

            stats = await get(http, pod, "/sim/stats")
            assert stats["data_parallel_size"] == 2
            ranks = stats["ranks"]
            assert [r["engine_id"] for r in ranks] == [f"{pod.engine_id}_dp0",
                                                       f"{pod.engine_id}_dp1"]
            long0 = [r for r in ranks[0]["recent"] if r["prompt_tokens"] > 300]
            long1 = [r for r in ranks[1]["recent"] if r["prompt_tokens"] > 300]
            assert [r["rank"] for r in long0 + long1] == [0, 0, 1]
            assert long0[0]["cached_tokens"] == 0
            assert long0[1]["cached_tokens"] > 0  # rank 0's cache
            assert long1[0]["cached_tokens"] == 0  # rank 1 has none of it

            cache = await get(http, pod, "/sim/cache")
            assert [r["data_parallel_rank"] for r in cache["ranks"]] == [0, 1]
            for rank in (0, 1):
                await published_on_its_stream(subs[rank], cache["ranks"][rank], before[rank],
                                              rank)

            status, body = await post(http, pod, "short", "2")
            assert status == 400
            assert body["error"]["message"] == "data_parallel_rank 2 is out of range [0, 2)."
            assert (await post(http, pod, "short", "not-a-rank"))[0] == 200  # no pin

            metrics = await get(http, pod, "/metrics")
            for rank in (0, 1):
                assert f'vllm:num_requests_running{{engine="{rank}",model_name="{pod.model}"}}' \
                    in metrics
                assert f'vllm:prefix_cache_hits_total{{engine="{rank}",' in metrics
    finally:
        for sub in subs:
            sub.close(0)
        context.term()


async def test_hybrid_node_serves_its_global_ranks_by_local_index(
    sim_pod: Callable[..., SimPod],
) -> None:
    """The second node of a 4-rank deployment (`--data-parallel-size 4
    --data-parallel-size-local 2 --data-parallel-start-rank 2 --data-parallel-hybrid-lb`,
    as llm-d's wide-EP guide runs vLLM): `X-data-parallel-rank: 1` is global rank 3, whose
    KV events come on events port + 3 with `data_parallel_rank` 3, and /metrics has
    engines 2 and 3 only."""
    base, replay = free_port_runs(2, 4)
    pod = sim_pod(role="both", fast=True, data_parallel_size=4, data_parallel_size_local=2,
                  data_parallel_start_rank=2, data_parallel_hybrid_lb=True,
                  kv_events_port=base, kv_events_replay_port=replay)
    context = zmq.asyncio.Context()
    sub = context.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://{HOST}:{base + 3}")
        async with aiohttp.ClientSession() as http:
            await subscribed(http, pod, sub, 1)  # index 1: global rank 3
            before = (await get(http, pod, "/sim/cache?rank=3"))["block_hashes"]
            status, _ = await post(http, pod, LONG_PROMPT, "1")
            assert status == 200

            served = await get(http, pod, "/sim/stats?rank=3")
            assert served["data_parallel_rank"] == 3
            assert [r["rank"] for r in served["recent"] if r["prompt_tokens"] > 300] == [3]
            other = await get(http, pod, "/sim/stats?rank=2")
            assert not [r for r in other["recent"] if r["prompt_tokens"] > 300]
            stats = await get(http, pod, "/sim/stats")
            assert [stats[k] for k in ("data_parallel_size", "data_parallel_size_local",
                                       "data_parallel_start_rank")] == [4, 2, 2]
            assert [r["data_parallel_rank"] for r in stats["ranks"]] == [2, 3]
            async with http.get(f"{pod.base_url}/sim/stats?rank=1") as response:
                assert response.status == 400  # rank 1 runs on another node

            await published_on_its_stream(sub, await get(http, pod, "/sim/cache?rank=3"),
                                          before, 3)

            status, body = await post(http, pod, "short", "2")
            assert status == 400
            assert body["error"]["message"] == "data_parallel_rank 2 is out of range [0, 2)."

            metrics = await get(http, pod, "/metrics")
            engines = {sample.labels["engine"]
                       for family in text_string_to_metric_families(metrics)
                       for sample in family.samples if "engine" in sample.labels}
            assert engines == {"2", "3"}
    finally:
        sub.close(0)
        context.term()
