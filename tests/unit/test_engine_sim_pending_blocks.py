"""A prefix hit on blocks another request is still computing waits for that prefill.

vLLM v1 caches a block's hash when the block is scheduled, so the hit is real, but the KV
exists only once the step computing it has run (`engine_sim/pending_blocks.py`).
"""

from __future__ import annotations

import asyncio
import time

from engine_sim.config import SimConfig
from engine_sim.engine import Engine
from engine_sim.kv_params import parse_kv_transfer_params
from engine_sim.latency import LatencyModel
from engine_sim.pending_blocks import PendingBlocks
from engine_sim.prompts import STAND_IN
from engine_sim.protocol import parse_request

#: One token per word and per space (the stand-in tokenizer): 192 tokens, 12 full blocks
#: (the same prompt again hits 11: vLLM always computes the last prompt token).
PROMPT = "alpha beta gamma delta " * 24
#: Long enough that a second request's own prefill (the overhead) ends well before it.
LATENCY = LatencyModel(prefill_overhead_s=0.002, prefill_per_token_s=0.0005)


def _engine() -> Engine:
    config = SimConfig(role="both", model="m", port=0, host="127.0.0.1", tokenizer=STAND_IN,
                       python_hash_seed="0", latency=LATENCY, max_num_seqs=4)
    return Engine(config, None)


async def _first_token(engine: Engine, prompt: str, done: list[tuple[str, int]],
                       name: str) -> None:
    parsed = parse_request({"model": "m", "prompt": prompt, "max_tokens": 1}, "completion",
                           engine.tokenizer, engine.limits)
    async with engine.run(parsed, name, parse_kv_transfer_params(None),
                          time.perf_counter()) as generation:
        done.append((name, generation.cached_tokens))


async def _prefilling(engine: Engine) -> None:
    """One turn of the loop: the task just created runs to its modelled prefill (nothing
    awaits before it without a store), its blocks cached but not computed. Timers fire in
    deadline order, so what starts now with a shorter prefill ends first however late the
    loop turns."""
    await asyncio.sleep(0)
    assert len(engine.pending) > 0


async def test_a_hit_on_blocks_being_computed_comes_after_their_prefill() -> None:
    engine = _engine()
    done: list[tuple[str, int]] = []
    first = asyncio.create_task(_first_token(engine, PROMPT, done, "first"))
    await _prefilling(engine)
    await _first_token(engine, PROMPT + "and more", done, "second")
    await first
    # The second finds the first's 12 blocks (a hit, as vLLM counts it) but its first token
    # comes after the first's prefill ends (it came some 80 ms before it without the wait).
    assert done == [("first", 0), ("second", 192)]
    assert len(engine.pending) == 0


async def test_other_prompts_claim_nothing_and_computed_blocks_hit_at_once() -> None:
    engine = _engine()
    done: list[tuple[str, int]] = []
    first = asyncio.create_task(_first_token(engine, PROMPT, done, "first"))
    await _prefilling(engine)
    other = parse_request({"model": "m", "prompt": "omega " * 8, "max_tokens": 1},
                          "completion", engine.tokenizer, engine.limits)
    claim = engine.pending.claim(engine.block_hashes.hashes(other.token_ids, None), 0)
    assert claim.waits_for == ()  # a prompt that shares no block waits for no one's blocks
    engine.pending.release(claim)
    await first
    await _first_token(engine, PROMPT, done, "after")  # the blocks exist: no wait
    assert done == [("first", 0), ("after", 176)]
    assert len(engine.pending) == 0


async def test_a_cancelled_waiter_leaves_the_claim_it_waited_for() -> None:
    pending = PendingBlocks()
    writer = pending.claim((1, 2, 3), writes_from=0)
    reader = pending.claim((1, 2, 3, 4), writes_from=3)  # hit on 1-3, writes 4
    assert reader.block_hashes == (4,) and reader.waits_for == (writer.done,)
    waiting = asyncio.create_task(pending.wait(reader))
    await asyncio.sleep(0)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert not writer.done.is_set()  # the waiter's cancellation is not the writer's
    pending.release(reader)
    late = pending.claim((1, 2), writes_from=2)
    assert late.waits_for == (writer.done,)
    pending.release(writer)
    await asyncio.wait_for(pending.wait(late), 1)
    pending.release(late)
    assert len(pending) == 0
