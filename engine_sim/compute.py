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


class ComputeLine:
    """One pod's prefill compute: `run` waits its turn, then holds the line for its time."""

    def __init__(self) -> None:
        self._turns = asyncio.Lock()  # wakes waiters in arrival order; a cancelled one leaves
        self._queued = 0

    @property
    def waiting(self) -> int:
        """Prompts waiting for the line (the one on it is not counted)."""
        return self._queued

    async def run(self, seconds: float) -> None:
        """Compute for `seconds` once every earlier prompt has; nothing to wait for at 0."""
        if seconds <= 0:
            return
        self._queued += 1
        try:
            await self._turns.acquire()
        finally:
            self._queued -= 1
        try:
            await asyncio.sleep(seconds)
        finally:
            self._turns.release()
