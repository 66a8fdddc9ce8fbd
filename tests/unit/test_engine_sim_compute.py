"""A pod prefills one prompt at a time, in arrival order (`engine_sim/compute.py`).

vLLM v1 spends each step's token budget on running requests before waiting ones, so a
prompt's prefill starts once the earlier prompts' are done; while it waits it is a WAITING
request in the engine's metrics.
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client.parser import text_string_to_metric_families

from engine_sim.compute import ComputeLine, prefill_chunks
from engine_sim.config import SimConfig
from engine_sim.engine import Engine
from engine_sim.kv_params import parse_kv_transfer_params
from engine_sim.latency import LatencyModel
from engine_sim.prompts import STAND_IN
from engine_sim.protocol import parse_request

#: 0.5 ms a token: the long prompt (~400 tokens) computes for about 0.2 s, the short one
#: (~16 tokens) for 8 ms.
LATENCY = LatencyModel(prefill_overhead_s=0.0, prefill_per_token_s=0.0005)
LONG = "alpha beta gamma delta " * 50
SHORT = "omega " * 8


def _engine(latency: LatencyModel = LATENCY) -> Engine:
    config = SimConfig(role="both", model="m", port=0, host="127.0.0.1", tokenizer=STAND_IN,
                       python_hash_seed="0", latency=latency, max_num_seqs=8)
    return Engine(config, None)


async def _first_token(engine: Engine, prompt: str, done: list[str]) -> None:
    parsed = parse_request({"model": "m", "prompt": prompt, "max_tokens": 1}, "completion",
                           engine.tokenizer, engine.limits)
    async with engine.run(parsed, prompt[:5], parse_kv_transfer_params(None),
                          time.perf_counter()):
        done.append(prompt[:5])


def _gauges(engine: Engine) -> dict[str, float]:
    """The engine's running and waiting gauges, as Prometheus parses its `/metrics`."""
    wanted = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    return {sample.name: sample.value
            for family in text_string_to_metric_families(engine.metrics.render().decode())
            for sample in family.samples if sample.name in wanted}


async def test_a_short_prompt_behind_a_long_one_waits_for_it() -> None:
    engine = _engine()
    done: list[str] = []
    long = asyncio.create_task(_first_token(engine, LONG, done))
    await asyncio.sleep(0)  # the long prompt is on the line
    short = asyncio.create_task(_first_token(engine, SHORT, done))
    await asyncio.sleep(0.02)
    # Both admitted (max_num_seqs 8), one computing, one queued for the compute: vLLM's
    # RUNNING and WAITING.
    assert (engine.running, engine.waiting) == (1, 1)
    assert _gauges(engine) == {"vllm:num_requests_running": 1.0,
                               "vllm:num_requests_waiting": 1.0}
    await asyncio.gather(long, short)
    # With a prefill lane each, the short prompt's 8 ms would have ended first.
    assert done == ["alpha", "omega"]
    assert (engine.running, engine.waiting) == (0, 0)


async def test_without_simulated_time_nothing_queues() -> None:
    engine = _engine(LatencyModel.fast())
    done: list[str] = []
    await asyncio.gather(*(_first_token(engine, prompt, done) for prompt in (LONG, SHORT)))
    assert sorted(done) == ["alpha", "omega"] and engine.compute.waiting == 0


async def test_a_cancelled_prompt_leaves_the_line_to_the_next() -> None:
    line = ComputeLine()
    order: list[str] = []

    async def compute(name: str, seconds: float) -> None:
        await line.run([seconds])
        order.append(name)

    first = asyncio.create_task(compute("first", 0.05))
    await asyncio.sleep(0)
    gone = asyncio.create_task(compute("gone", 10.0))
    last = asyncio.create_task(compute("last", 0.01))
    await asyncio.sleep(0)
    assert line.waiting == 2
    gone.cancel()  # its client left while it waited: it computes nothing
    await asyncio.wait_for(asyncio.gather(first, last), 5)
    assert order == ["first", "last"] and line.waiting == 0
    assert gone.cancelled()


def test_a_prompt_past_the_budget_is_prefilled_in_steps_of_the_budget() -> None:
    # From the tokens the caches supplied to the prompt's end, at most the budget a step.
    assert prefill_chunks(0, 100, 64) == [64, 100]
    assert prefill_chunks(0, 128, 64) == [64, 128]
    assert prefill_chunks(32, 100, 64) == [96, 100]
    assert prefill_chunks(0, 50, 64) == [50]
    assert prefill_chunks(100, 100, 64) == []


async def test_each_step_is_reported_as_it_ends_and_the_line_is_held_throughout() -> None:
    """A chunked prompt keeps the line between its steps (vLLM schedules the running
    prompt's next chunk first), and the caller hears of each step before the next runs."""
    line = ComputeLine()
    log: list[str] = []

    async def chunked() -> None:
        await line.run([0.02, 0.02, 0.02], lambda step: log.append(f"step {step}"))
        log.append("chunked done")

    async def next_prompt() -> None:
        await line.run([0.001])
        log.append("next done")

    first = asyncio.create_task(chunked())
    await asyncio.sleep(0)
    second = asyncio.create_task(next_prompt())
    await asyncio.wait_for(asyncio.gather(first, second), 5)
    assert log == ["step 0", "step 1", "step 2", "chunked done", "next done"]
