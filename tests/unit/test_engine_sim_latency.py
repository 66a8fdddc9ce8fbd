"""The latency model and the admission scheduler."""

from __future__ import annotations

import asyncio

import pytest

from engine_sim.latency import LatencyModel, pause
from engine_sim.scheduler import QueueFullError, Scheduler


def test_latency_formulas() -> None:
    model = LatencyModel(
        prefill_overhead_s=0.01, prefill_per_token_s=0.001, itl_base_s=0.02, itl_per_running_s=0.5
    )
    assert model.compute_seconds(100) == pytest.approx(0.1)
    assert model.compute_seconds(-5) == 0
    assert model.inter_token_seconds(4) == pytest.approx(2.02)
    fast = LatencyModel.fast()
    assert fast.compute_seconds(10_000) == 0 and fast.inter_token_seconds(100) == 0


async def test_pause_zero_returns_without_sleeping() -> None:
    await pause(0)
    await pause(-1)


async def test_scheduler_queues_in_order_and_counts() -> None:
    scheduler = Scheduler(max_num_seqs=1, max_waiting=2)
    order: list[int] = []

    async def job(n: int) -> None:
        async with scheduler.slot():
            order.append(n)
            await asyncio.sleep(0.01)

    first = asyncio.create_task(job(0))
    await asyncio.sleep(0)
    rest = [asyncio.create_task(job(n)) for n in (1, 2)]
    await asyncio.sleep(0)
    assert scheduler.running == 1 and scheduler.waiting == 2
    with pytest.raises(QueueFullError):
        await scheduler.acquire()
    await asyncio.gather(first, *rest)
    assert order == [0, 1, 2]
    assert scheduler.running == 0 and scheduler.waiting == 0


async def test_scheduler_cancelled_waiter_leaves_queue() -> None:
    scheduler = Scheduler(max_num_seqs=1)
    await scheduler.acquire()
    waiter = asyncio.create_task(scheduler.acquire())
    await asyncio.sleep(0)
    assert scheduler.waiting == 1
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert scheduler.waiting == 0
    scheduler.release()
    assert scheduler.running == 0


def test_kv_transfer_costs_bytes_over_bandwidth() -> None:
    from engine_sim.latency import MLA_KV_BYTES_PER_TOKEN

    assert MLA_KV_BYTES_PER_TOKEN == 70_272  # DeepSeek-V3 / Kimi K2: 61 x (512 + 64) x 2
    model = LatencyModel(kv_bytes_per_token=1000, kv_bandwidth_bytes_per_s=1e6)
    assert model.kv_transfer_seconds(500) == pytest.approx(0.5)
    assert model.kv_transfer_seconds(0) == 0.0
    assert LatencyModel.fast().kv_transfer_seconds(10**6) == 0.0


def test_kv_flags_reach_the_latency_model() -> None:
    from engine_sim.cli import parse_config as parse_args

    config = parse_args(["--role", "both", "--port", "0", "--model", "m",
                         "--kv-bytes-per-token", "2048", "--kv-gbytes-per-s", "2"])
    assert config.latency.kv_bytes_per_token == 2048
    assert config.latency.kv_bandwidth_bytes_per_s == pytest.approx(2e9)
    assert config.latency.kv_transfer_seconds(1_000_000) == pytest.approx(1.024)
    assert config.store_load_per_token_s is None
    with pytest.raises(SystemExit):
        parse_args(["--role", "both", "--port", "0", "--model", "m", "--kv-gbytes-per-s", "0"])
