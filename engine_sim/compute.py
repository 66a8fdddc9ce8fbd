"""The engine's compute: prompts are prefilled one after another, in arrival order.

What it models: vLLM v1's scheduler (`Scheduler.schedule` in
`vllm/v1/core/sched/scheduler.py`) spends one token budget a step
(`max_num_batched_tokens`) on the RUNNING requests first, in order (a prompt whose
earlier chunks were scheduled is one of them), and only then admits WAITING requests with
what is left. A step's time grows with the tokens in it, so a pod prefills at about one
rate in tokens a second however many prompts it holds, and a prompt's chunks run once the
prompts that arrived before it are done: one server, first come first served. Two
1,000-token prompts arriving together finish at one and two times a 1,000-token prefill,
not both at one.

A prompt longer than the budget is prefilled over several steps, `max_num_batched_tokens`
tokens each (`prefill_chunks`; vLLM's chunked prefill, always on in v1). The line is held
across them, as the running prompt's chunk comes first in every step, and the caller hears
of each step's end: vLLM caches a chunk's full blocks when it schedules the chunk and
publishes their `BlockStored` once the step has run (`Scheduler.update_from_output`).

What it leaves out: decode tokens ride in the same steps (their pace is the latency
model's own, `--itl-ms`); short prompts that fit one step share its fixed cost (here
`--prefill-overhead-ms` is waited beside the line, not on it); the last chunk of one
prompt and the first of the next share a step. KV that arrives over the network (a prefix
read from the store, a PD import) is loaded by the KV connector before vLLM schedules the
request (`WAITING_FOR_REMOTE_KVS`), so that wait is not on the line either.

A prompt queued on the line counts as waiting, not running, in the engine's metrics, as a
vLLM request left in WAITING by a full token budget does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

#: vLLM's `max_num_batched_tokens` for its OpenAI server on a GPU of 70 GiB or more other
#: than an A100 (H100, H800, H20, MI300X: `EngineArgs.get_batch_defaults`); 2048 on smaller
#: ones. Mooncake's traces come from such 80 GB nodes.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


def prefill_chunks(computed: int, num_tokens: int, budget: int) -> list[int]:
    """Where each step of a prefill ends, in prompt tokens: from `computed` (the tokens the
    caches supplied) to `num_tokens`, at most `budget` tokens a step. Empty when nothing
    is left to compute."""
    if budget <= 0:
        raise ValueError("budget must be positive")
    return list(range(computed + budget, num_tokens, budget)) + (
        [num_tokens] if computed < num_tokens else []
    )


class ComputeLine:
    """One pod's prefill compute: `run` waits its turn, then holds the line for its time."""

    def __init__(self) -> None:
        self._turns = asyncio.Lock()  # wakes waiters in arrival order; a cancelled one leaves
        self._queued = 0

    @property
    def waiting(self) -> int:
        """Prompts waiting for the line (the one on it is not counted)."""
        return self._queued

    async def run(
        self, steps: Sequence[float], after_step: Callable[[int], None] | None = None
    ) -> None:
        """Compute a prompt's steps (`steps[i]` seconds each) once every earlier prompt
        has, holding the line throughout; `after_step(i)` runs as step `i` ends. Nothing
        waits, and no step is reported, when the steps take no time."""
        if sum(steps) <= 0:
            return
        self._queued += 1
        try:
            await self._turns.acquire()
        finally:
            self._queued -= 1
        try:
            loop = asyncio.get_running_loop()
            ends = loop.time()
            for index, seconds in enumerate(steps):
                ends += seconds  # each step ends on the model's clock, not after the
                await asyncio.sleep(ends - loop.time())  # last one's wake-up was late
                if after_step is not None:
                    after_step(index)
        finally:
            self._turns.release()
