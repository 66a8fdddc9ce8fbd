"""`cache-pressure`: a pod that would evict less cached prefix to take the prompt is better.

    n_p = B - m_p                                       (blocks the pick adds to pod p)
    O_p = max(0, U_p + n_p - C_p)                       (blocks it evicts at once)
    G_p = min(n_p, U_p - U_min) x min(1, (U_p + n_p) / C_p)   (room it uses up, see below)
    E_p = max(O_p, G_p) x t x e                          (in seconds)
    s_p = (E_max - E_p) / (E_max - E_min)                (s_p = 1 for every pod when equal)

- B   = the prompt's approximate blocks, m_p = those pod p already holds (`prefix-cache`);
- U_p, C_p = blocks pod p's approximate index holds and its bound (`ApproximatePrefixIndex`,
        sized from the engine's KV capacity): a pod at its bound evicts one block, the
        least recently used, for every block a prompt adds; U_min = the least any
        candidate holds;
- t   = tokens a block covers (`PromptInfo.tokens_per_approx_block`, as `prefix-cache`);
- e   = seconds to get an evicted token back: the prefill curve's cost per token, or the
        pull from the server's shared KV pool when it has one and that is faster.

With `precise-prefix-cache` ahead of it in the profile, the same in engine blocks: m_p
what that scorer found (the pod's KV events, plus prompts in flight to it), U_p the blocks
the events say the pod holds, C_p the capacity its engine reports (`vllm:cache_config_info`
num_gpu_blocks x block_size), t the block size; exact where the approximate index guesses.

ttft scale: E_max - E_min, so w x scale x (1 - s_p) = E_p - E_min: the recompute a pick
causes beyond the least any candidate causes.

O_p is what a full pod evicts now. A warm prompt costs its own pod only its tail and any
other full pod the whole prompt's worth of someone else's cache: moving it to an idle pod
to save a queue wait leaves it cached twice, and the copy's evictions come back as misses
of other prompts (benchmarks/HISTORY.md, "Shared-prefix: a group kept on two pods").

G_p is what a pod that is not full yet gives up. Where a new prompt lands, its followers
go (`prefix-cache` keeps them there), so its blocks stay in that pod's working set; put
on a pod holding U_p - U_min more blocks than the emptiest candidate, they fill it that
much sooner, and once the caches are full that pod evicts them, or another prompt, while
the emptier one would not have. vLLM Router's and SGLang's `cache_aware` send a prompt
that matches no worker to the one with the smallest tree for this reason; here it is a
cost, so it weighs against load instead of overriding it: at most the prompt's own
blocks, weighted by how full the pod would be (an almost empty cache gives room away
freely; pods that are all full hold as much, U_p = U_min, and G is 0).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.scheduling.context import Candidates, PickContext, SchedulerDeps
from router.scheduling.kv_events import scope_of
from router.scheduling.scorers.base import Scorer
from router.scheduling.scorers.precise_prefix_cache import engine_block_size


class CachePressureScorer(Scorer):
    type_name = "cache-pressure"

    def __init__(self, weight: float, deps: SchedulerDeps, params: Mapping[str, Any]) -> None:
        super().__init__(weight, deps, params)
        #: E_max - E_min of the last `score` (a pick runs score then scale_s, no await).
        self._span_s = 0.0

    def score(self, ctx: PickContext, cands: Candidates) -> list[float]:
        self._span_s = 0.0
        held = ctx.precise_held
        if held is not None and len(held) == len(cands.keys):
            return self._precise(ctx, cands, held)
        hashes = ctx.prompt.approx_hashes()
        total = len(hashes)
        if not total:
            return [1.0] * len(cands.keys)
        approx = self.deps.approx
        depths = ctx.approx_depths
        if depths is None or len(depths) != len(cands.keys):
            depths = approx.match(cands.keys, hashes)
        used, bounds = approx.occupancy(cands.keys)
        return self._scores(ctx, total, depths, used, bounds, ctx.prompt.tokens_per_approx_block())

    def _precise(self, ctx: PickContext, cands: Candidates, held: list[int]) -> list[float]:
        """The same in engine blocks: m_p from `precise-prefix-cache` (events and prompts in
        flight), U_p the blocks the pod's events say it holds, C_p its engine's reported
        capacity; neutral while a candidate's capacity is unknown (no guess: the precise
        index has no bound of its own to fall back on)."""
        total = ctx.precise_hashes
        block = engine_block_size(self.deps.precise.space(scope_of(ctx.server)), self.deps)
        if not total or block <= 0:
            return [1.0] * len(held)
        precise, approx = self.deps.precise, self.deps.approx
        used: list[int] = []
        bounds: list[int] = []
        for key in cands.keys:
            tokens = approx.reported_tokens(key)
            if tokens is None:
                return [1.0] * len(held)
            used.append(precise.block_count(key))
            bounds.append(max(1, tokens // block))
        return self._scores(ctx, total, held, used, bounds, float(block))

    def _scores(
        self, ctx: PickContext, total: int, depths: list[int], used: list[int],
        bounds: list[int], per_block: float,
    ) -> list[float]:
        """The module docstring's s_p from B (`total`), m_p, U_p and C_p in blocks of
        `per_block` tokens."""
        least = min(used)
        evicted: list[float] = []
        for i in range(len(used)):  # indexed, not zip: this runs in every pick (compiled)
            held = used[i]
            adds = total - depths[i]
            after = held + adds
            bound = bounds[i]
            room = adds if adds < held - least else held - least
            if after >= bound:  # full after the pick: O counts, and G at fill factor 1
                now = after - bound
                evicted.append(float(now if now > room else room))
            else:
                evicted.append(room * after / bound)
        low, high = min(evicted), max(evicted)
        if high - low < 1.0:  # the common case: less than a block apart (e.g. all pods full)
            return [1.0] * len(evicted)
        per_token = ctx.fit.coefficients.b
        costs = ctx.server_costs
        if costs.pool.enabled:
            per_token = min(per_token, costs.pull_s_per_token)
        self._span_s = (high - low) * per_block * per_token
        span = high - low
        return [(high - e) / span for e in evicted]

    def scale_s(self, ctx: PickContext, cands: Candidates) -> float:
        return self._span_s
