"""The scheduling pipeline: filters -> weighted scorers -> picker, per role, PD-aware.

One decision (`PipelineScheduler.pick`):

1. Candidates per role. Aggregated server: its pods, role `aggregated`. PD server: every
   prefill pod (role `prefill`) and every decode pod (role `decode`) of every group.
   Pods in `avoid` are dropped, then each profile filter runs; each step is skipped when
   it would leave a role with nothing (filters are soft). If no group keeps both a
   prefill and a decode pod, the filters are relaxed, then `avoid`.
2. Cost per candidate: the profile's scorers combined (`scorers.base`), in seconds of
   predicted TTFT (unit `ttft`, the default) or in 0..1 (unit `score`). Affinity scores
   (cache, session) within `cacheSimilarity` of the best count as the best, so among
   pods with a similar cache benefit, load decides.
3. Guard: a candidate whose load (router in-flight + engine waiting) is at least
   `guard.absolute` above the least loaded AND at least `guard.relative` times it is
   excluded (its cost gets `GUARD_PENALTY`), whatever its affinity
   (`pdgate_scheduler_guard_overrides_total` counts the times this changed the winner).
4. PD pairs are scored together: per group, the best prefill and the best decode; the
   pair's cost is prefill + `decodeWeight` x decode (ttft) or their weighted mean
   (score). So a group whose decode side is saturated (filtered) or loaded (costly) is not
   chosen for its warm prefill pod. The pair cost is separable, so this costs
   O(prefill pods + decode pods), not their product. The prefill side is compared by its
   cost plus `workWeight` x the compute (and pull) seconds it would spend (ttft unit), so
   a near-tie between waiting on a warm pod and computing the prompt cold on an idle one
   keeps the prompt on its pod; the predicted TTFT is the cost alone.
5. Ties: every candidate (or group) whose cost is within `tieTolerance` of the best
   (x one mean prefill time in ttft unit) is equally good; one is drawn with the
   scheduler's `random.Random` (injectable, seedable), never by list order; for a prompt
   no candidate holds a block of, by rendezvous hashing over the tied candidates' names
   seeded with its first block's hash (`ties.tie_breaker`), so that routers sharing state
   send the same new prompt to the same pod.
6. Dispatch bookkeeping: scorers see the chosen pod (`picked`: the approximate index
   records the prompt, session affinity remembers the pod), the prefix-cache hit
   counters are bumped for the chosen prefill/aggregated pod, the running mean of
   uncached tokens is updated (by profiles with a prefix scorer only), and the decision
   time and (ttft unit) the predicted TTFT of the choice (+ `prefill_overhead_s` + prompt
   tokens x `transfer_s_per_token`) are observed.

This module runs the steps in order; a role's filters, costs and guard (1-3) are its
`profile.Profile`'s, the draw among ties (5) is `ties`'s, and a sequential-PD prefill's
predicted duration, from dispatch to its measured end, is a `prefill_ticket.PrefillTicket`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from router.scheduling import Pick, ScheduleRequest
from router.scheduling.block_hash import CHAT_PATH, LeadingBlocks, salt_of
from router.scheduling.config import SchedulerConfig
from router.scheduling.context import (
    Candidates,
    PickContext,
    PromptInfo,
    SchedulerDeps,
    ServerCosts,
)
from router.scheduling.kv_events import scope_of
from router.scheduling.metrics import DecisionCounts, SchedulerMetrics
from router.scheduling.prefill_ticket import PrefillTicket
from router.scheduling.profile import GUARD_PENALTY, Profile, Profiles, build_profiles
from router.scheduling.slo import Prediction, SLOGate
from router.scheduling.ties import at_random, choose, draw_below, tie_breaker, within
from router.tokenization import ChatInputError, prompt_chars
from router.tokenization import Endpoint as Prompt
from router.view import Endpoint, ServerPods

_INF = math.inf
# Added per avoided or ejected pod when nothing else is left: dwarfs any real cost, so a
# pair with one such pod beats a pair with two, whatever their loads.
UNWANTED_PENALTY = 1e15


#: Bound of the per-server pod-list cache (servers); emptied on every snapshot anyway.
MAX_CACHED_LAYOUTS = 1024


@dataclass(frozen=True, slots=True)
class _Layout:
    """A server's pods by role, with their keys, computed once per snapshot."""

    pods: list[Endpoint]  # aggregated, or prefill for a PD server
    keys: list[str]
    decode: list[Endpoint]
    decode_keys: list[str]
    costs: ServerCosts
    #: PD: the groups with both prefill and decode pods when every group has both (then a
    #: decision that filtered nothing out needs no pairing pass), else None.
    paired: frozenset[str | None] | None = None
    #: PD: each prefill / decode pod's group, in the order of `pods` / `decode`.
    groups: list[str | None] | None = None
    decode_groups: list[str | None] | None = None


class _PrefixReport:
    """What the prefix scorers found for one role's candidates (for metrics and the mean).

    `_PrefixReport` and `_Decision` are built on every decision: plain classes, since
    mypyc compiles their `__init__` (a dataclass's runs interpreted, see `pick.py`)."""

    def __init__(self, ctx: PickContext) -> None:
        self.approx_depths: list[int] | None = ctx.approx_depths
        self.approx_total: int = ctx.approx_hashes
        self.precise_local: list[int] | None = ctx.precise_local
        self.precise_reach: list[int] | None = ctx.precise_reach
        self.precise_total: int = ctx.precise_hashes
        self.store_factor: float = ctx.store_factor
        self.compute_tokens: list[float] | None = ctx.compute_tokens
        self.pull_tokens: list[float] | None = ctx.pull_tokens


def _take_report(ctx: PickContext) -> _PrefixReport:
    report = _PrefixReport(ctx)
    _clear_report(ctx)
    return report


def _clear_report(ctx: PickContext) -> None:
    ctx.approx_depths = ctx.precise_local = ctx.precise_reach = ctx.precise_held = None
    ctx.compute_tokens = ctx.pull_tokens = None


class _Decision:
    """A pick before its bookkeeping: `commit` records it (skipped when the SLO gate
    refuses the request, or for a dry run); `predicted` is its TTFT (ttft unit).
    `idle_s`: the request's idle TTFT, its whole prompt uncached on an idle pod
    (`slo.Prediction`)."""

    def __init__(
        self, pick: Pick, predicted: float | None, commit: Callable[[], None],
        idle_s: float = 0.0,
    ) -> None:
        self.pick = pick
        self.predicted = predicted
        self.commit = commit
        self.idle_s = idle_s

    def prediction(self) -> Prediction | None:
        return None if self.predicted is None else Prediction(self.predicted, self.idle_s)


def _groups_of(
    cands: Candidates, pods: list[Endpoint], groups: list[str | None] | None
) -> list[str | None]:
    """Each candidate's PD group (the layout's list when no pod was filtered out)."""
    if groups is not None and cands.pods is pods:
        return groups
    return [p.group for p in cands.pods]


def _one_pod(server: ServerPods, flow: str) -> bool:
    """Whether a request of `flow` goes to one pod chosen by load alone (`_pick_single`):
    the `single` flow, and `generate` on a PD server (its decode pod)."""
    return flow == "single" or (flow == "generate" and server.is_pd)


def _endpoint(path: str, body: dict[str, Any]) -> Prompt:
    return "chat" if path == CHAT_PATH or isinstance(body.get("messages"), list) else "completion"


def _nothing() -> None:
    """The commit of a decision that records nothing."""


class PipelineScheduler:
    """`router.scheduling.Scheduler` built from a `SchedulerConfig` (see module docstring)."""

    def __init__(
        self,
        config: SchedulerConfig,
        deps: SchedulerDeps,
        metrics: SchedulerMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.deps = deps
        self.metrics = metrics
        self._clock = clock
        self._profiles = build_profiles(config, deps)
        self._layouts: dict[int, tuple[ServerPods, _Layout]] = {}
        deps.ttft.configure(config.cost_model.seed(), config.ttft_model)
        self._slo = SLOGate(config.slo, metrics)
        #: Where picks that must not count go (a peer's request, `predict`): never exported.
        self._uncounted = DecisionCounts()
        #: `deps.rng.randrange`'s draws, made once for every pick (`ties.draw_below`).
        self._draw = draw_below(deps.rng)

    @property
    def config(self) -> SchedulerConfig:
        return self._profiles.config

    def forget_layouts(self) -> None:
        """Drop the per-server pod lists (call on every new view snapshot)."""
        self._layouts.clear()

    def _layout(self, server: ServerPods) -> _Layout:
        cached = self._layouts.get(id(server))
        if cached is not None and cached[0] is server:
            return cached[1]
        if len(self._layouts) >= MAX_CACHED_LAYOUTS:
            self._layouts.clear()
        if server.is_pd:
            pods = [p for g in server.groups for p in g.prefill]
            decode = [p for g in server.groups for p in g.decode]
        else:
            pods, decode = list(server.aggregated), []
        config = self._profiles.config
        costs = ServerCosts.of(
            server.server, config.cost_model, config.pool_view.enabled,
            config.pool_view.capacity_tokens, config.slo.ttft_target_s,
        )
        pre_groups = frozenset(p.group for p in pods)
        paired = pre_groups if pre_groups and pre_groups == {p.group for p in decode} else None
        layout = _Layout(
            pods, [p.key for p in pods], decode, [p.key for p in decode], costs, paired,
            [p.group for p in pods], [p.group for p in decode],
        )
        self._layouts[id(server)] = (server, layout)
        return layout

    def set_config(self, config: SchedulerConfig) -> None:
        """Swap in new profiles (built first, so a bad config leaves the old one running)."""
        self._profiles = build_profiles(config, self.deps)
        self._layouts.clear()  # server costs depend on the config
        self.deps.ttft.configure(config.cost_model.seed(), config.ttft_model)
        self._slo.config = config.slo

    # -- the Scheduler protocol ---------------------------------------------------------------

    async def prepare(self, server: ServerPods, request: ScheduleRequest) -> None:
        """Tokenize a big prompt off the event loop when the precise scorer will need it;
        with the SLO gate's `queue` action, wait while the prediction is over target."""
        catch_up = self.deps.catch_up
        if catch_up is not None:
            catch_up()  # `_is_new` reads the approximate index
        await self._tokenize(server, request)
        if self._slo.config.enabled:
            await self._slo.wait(
                self._layout(server).costs, lambda: self.predict(server, request)
            )
        place = self.deps.place
        if place is not None and request.placed is None and self._is_new(server, request):
            request.placed = await place(
                "/".join(server.server.meta.key), request.model, request.path, request.flow,
                request.body,
            )

    def _is_new(self, server: ServerPods, request: ScheduleRequest) -> bool:
        """Whether no candidate holds a block of this request's prompt, for a pick a prefix
        scorer takes part in (see `router.sync`: where such a prompt starts is the
        leader's decision): by the approximate index, or by the precise one (no candidate
        and no pool holds its first block, and no prompt sharing it is on its way into a
        candidate's cache)."""
        if _one_pod(server, request.flow):
            return False
        profiles = self._profiles
        config = (profiles.prefill if server.is_pd else profiles.aggregated).config
        by_approx, by_precise = config.uses("prefix-cache"), config.uses("precise-prefix-cache")
        if not (by_approx or by_precise):
            return False
        deps = self.deps
        prompt = self._prompt(server, request)
        keys = self._layout(server).keys
        approx = prompt.approx_hashes()
        if not approx or not keys:
            return False
        if by_approx or deps.precise_fallen_back(server.server):
            return not any(deps.approx.match(keys, approx))
        if deps.inflight_prefixes.depths(keys, approx, self._clock()) is not None:
            return False
        scope = scope_of(server)
        precise = deps.precise
        space = precise.space(scope) or deps.hasher.space
        hashes = prompt.leading_hashes(space, precise.known(scope))
        if not hashes:  # nobody holds its first block (or it has none: not new)
            return prompt.token_count() >= space.block_size
        local, reach = precise.match(keys, scope, hashes[:1])
        return not any(local) and not any(reach)

    async def _tokenize(self, server: ServerPods, request: ScheduleRequest) -> None:
        deps = self.deps
        pool = deps.tokenize_pool
        if (
            request.flow == "single"
            or request.tokens is not None
            or pool is None
            or not self._profiles.precise
            or deps.precise_fallen_back(server.server)
        ):
            return
        if prompt_chars(_endpoint(request.path, request.body), request.body) < pool.min_chars:
            return  # cheaper inline, in `pick`
        # Only the leading blocks some pod or the pool holds matter: the rest is never
        # encoded (the precise pool is fed by the engines' events, not by the prompt).
        scope = self._layout(server).costs.scope
        precise = deps.precise
        space = precise.space(scope) or deps.hasher.space
        known, hasher, salt = precise.known(scope), deps.hasher, salt_of(request.body)

        def leading() -> LeadingBlocks | None:
            stream = hasher.id_stream(request.path, request.body, server.server)
            return None if stream is None else hasher.leading_hashes(
                stream, salt, space, known, request.lora_name
            )

        found = await pool.call(leading)
        if found is not None:
            request.leading = (space.ident, found)

    async def prompt_ids(
        self, server: ServerPods, path: str, body: dict[str, Any]
    ) -> list[tuple[int, ...]] | None:
        """Every prompt's token ids by the server's own tokenizer (off the event loop when
        big), or None: no tokenizer loaded for it, or a body it cannot tokenize (the engine
        will say why). The proxy calls this at most once per request (the rate limiter's
        input tokens) and hands the first prompt's ids to `pick` (`ScheduleRequest.tokens`)."""
        deps = self.deps
        registry = deps.tokenizers
        tokenizer = None if registry is None else registry.get(server.server)
        if tokenizer is None:
            return None
        endpoint = _endpoint(path, body)
        try:
            if deps.tokenize_pool is None:
                return tokenizer.request_ids(endpoint, body)
            return await deps.tokenize_pool.request_ids(tokenizer, endpoint, body)
        except ChatInputError:
            return None

    def pick(
        self, server: ServerPods, request: ScheduleRequest, avoid: frozenset[str]
    ) -> Pick | None:
        """Choose the pods; raises a 429 `APIError` when the SLO gate refuses (see slo.py)."""
        catch_up = self.deps.catch_up
        if catch_up is not None:
            catch_up()  # what the other workers routed and counted since `prepare`
        started = time.perf_counter()
        layout = self._layout(server)
        placed = request.placed
        if placed is not None and not avoid.intersection(placed) and not any(
            map(self.deps.is_ejected, placed)
        ):
            # Where the leader placed this new prompt (`prepare`): every other pod is
            # avoided, so the pick keeps to those while they are candidates (not ejected
            # here, not avoided by a retry).
            avoid = frozenset(k for k in (*layout.keys, *layout.decode_keys) if k not in placed)
        counts = self.metrics.decisions if request.counted else self._uncounted
        decision = self._decide(server, request, avoid, layout, counts)
        if decision is not None:
            if decision.predicted is not None and self._slo.config.enabled:
                self._slo.check(layout.costs, decision.prediction(), counts)
            decision.commit()
        observe = counts.decision_pd if server.is_pd else counts.decision_aggregated
        observe.observe(time.perf_counter() - started)
        return None if decision is None else decision.pick

    def predict(
        self, server: ServerPods, request: ScheduleRequest, avoid: frozenset[str] = frozenset()
    ) -> Prediction | None:
        """The predicted TTFT of the pods `pick` would choose now, recording nothing."""
        decision = self._decide(server, request, avoid, self._layout(server), self._uncounted)
        return None if decision is None else decision.prediction()

    def _decide(
        self, server: ServerPods, request: ScheduleRequest, avoid: frozenset[str],
        layout: _Layout, counts: DecisionCounts,
    ) -> _Decision | None:
        now = self._clock()
        self.deps.pending.flush(now)
        profiles = self._profiles
        ctx = PickContext(
            request, server, self._prompt(server, request), self.deps,
            profiles.config.cost_model, now, counts, layout.costs,
        )
        if _one_pod(server, request.flow):
            return self._pick_single(profiles, ctx, server, avoid, layout)
        if server.is_pd:
            return self._pick_pd(profiles, ctx, server, avoid, layout)
        return self._pick_aggregated(profiles, ctx, server, avoid, layout)

    def _prompt(self, server: ServerPods, request: ScheduleRequest) -> PromptInfo:
        """The request's prompt, hashed lazily, with this configuration's block sizes."""
        approx = self._profiles.config.approximate_index
        return PromptInfo(
            request, self.deps.hasher, approx.block_bytes, approx.max_prompt_blocks,
            approx.chars_per_token, server.server, self.deps.approx_hasher,
        )

    # -- candidates ---------------------------------------------------------------------------

    def _narrow(
        self,
        ctx: PickContext,
        profile: Profile,
        pods: list[Endpoint],
        pod_keys: list[str],
        avoid: frozenset[str],
        level: int,
    ) -> Candidates:
        """Candidates after `avoid` (level >= 1) and the filters (level 2), each soft."""
        chosen, keys = pods, pod_keys
        if level >= 1 and avoid:
            kept = [i for i, key in enumerate(keys) if key not in avoid]
            if kept and len(kept) < len(keys):
                chosen = [pods[i] for i in kept]
                keys = [keys[i] for i in kept]
        cands = Candidates.read(chosen, keys, self.deps, ctx.now)
        if level < 2:
            return cands
        for filt in profile.filters:
            keep = filt.select(ctx, cands)
            if keep is None:
                continue
            if not keep:
                self.metrics.filter_fallbacks.labels(filter=filt.type_name).inc()
            else:
                cands = cands.subset(keep)
        return cands

    # -- aggregated ---------------------------------------------------------------------------

    def _pick_aggregated(
        self,
        profiles: Profiles,
        ctx: PickContext,
        server: ServerPods,
        avoid: frozenset[str],
        layout: _Layout,
    ) -> _Decision | None:
        if not server.aggregated:
            return None
        profile = profiles.aggregated
        ctx.role = "aggregated"
        cands = self._narrow(ctx, profile, layout.pods, layout.keys, avoid, 2)
        costs = profile.costs(ctx, cands)
        report = _take_report(ctx)
        guarded = profile.guard(cands, costs)
        ties = tie_breaker(ctx, report.approx_depths, self._draw)
        index = choose(ties, costs, profile.tolerance(ctx), cands.keys)
        predicted = (
            costs[index] + ctx.fit.predict(0.0)
            if profile.ttft and costs[index] < GUARD_PENALTY
            else None
        )

        if predicted is not None:
            ctx.ready_at = ctx.now + predicted

        def commit() -> None:
            self._dispatched(ctx, profile, cands, index, report)
            if guarded:
                ctx.counts.guard["aggregated"].inc()
            if predicted is not None:
                ctx.counts.predicted_aggregated.observe(predicted)

        pick = Pick(decode=cands.pods[index], decode_cost=costs[index])
        idle = 0.0 if predicted is None else ctx.fit.predict(ctx.prompt.token_count())
        return _Decision(pick, predicted, commit, idle)

    def _pick_single(
        self,
        profiles: Profiles,
        ctx: PickContext,
        server: ServerPods,
        avoid: frozenset[str],
        layout: _Layout,
    ) -> _Decision | None:
        """One pod for a request outside the PD flow: an aggregated pod, or a PD server's
        decode pod. The role's filters apply, then the least loaded wins (ties at random);
        scorers are not consulted and nothing is recorded, since the request leaves no
        prefix in the pod's cache that later requests could reuse."""
        if server.is_pd:
            profile, pods, keys = profiles.decode, layout.decode, layout.decode_keys
        else:
            profile, pods, keys = profiles.aggregated, layout.pods, layout.keys
        if not pods:
            return None
        ctx.role = "decode" if server.is_pd else "aggregated"
        cands = self._narrow(ctx, profile, pods, keys, avoid, 2)
        loads = cands.loads()
        index = choose(at_random(self._draw), loads, 0.0, cands.keys)
        return _Decision(Pick(decode=cands.pods[index], decode_cost=loads[index]), None, _nothing)

    # -- prefill/decode pairs -----------------------------------------------------------------

    def _penalise_unwanted(
        self, cands: Candidates, costs: list[float], avoid: frozenset[str]
    ) -> None:
        ejected = self.deps.is_ejected
        for i, key in enumerate(cands.keys):
            if key in avoid or ejected(key):
                costs[i] += UNWANTED_PENALTY

    def _pick_pd(
        self,
        profiles: Profiles,
        ctx: PickContext,
        server: ServerPods,
        avoid: frozenset[str],
        layout: _Layout,
    ) -> _Decision | None:
        if not server.groups:
            return None
        pre_profile, dec_profile = profiles.prefill, profiles.decode
        pre = dec = None
        common: AbstractSet[str | None] = frozenset()
        level = 2
        for level in (2, 1, 0):
            ctx.role = "prefill"
            pre = self._narrow(ctx, pre_profile, layout.pods, layout.keys, avoid, level)
            ctx.role = "decode"
            dec = self._narrow(
                ctx, dec_profile, layout.decode, layout.decode_keys, avoid, level
            )
            if layout.paired is not None and pre.pods is layout.pods and dec.pods is layout.decode:
                common = layout.paired  # nothing was filtered out: every group pairs
                break
            pre_groups = {p.group for p in pre.pods}
            common = pre_groups & {p.group for p in dec.pods}
            if common:
                if len(common) < len(pre_groups):
                    pre = pre.subset([i for i, p in enumerate(pre.pods) if p.group in common])
                if any(p.group not in common for p in dec.pods):
                    dec = dec.subset([i for i, p in enumerate(dec.pods) if p.group in common])
                break
        if pre is None or dec is None or not common:
            return None

        ctx.role = "prefill"
        pre_costs = pre_profile.costs(ctx, pre)
        report = _take_report(ctx)
        pre_guarded = pre_profile.guard(pre, pre_costs)
        ctx.role = "decode"
        dec_costs = dec_profile.costs(ctx, dec)
        _clear_report(ctx)
        dec_guarded = dec_profile.guard(dec, dec_costs)
        if level == 0:
            # Last resort: every group has an avoided or ejected pod. Still prefer the pair
            # with the fewest of them, so a retry does not walk back onto a dead pod.
            self._penalise_unwanted(pre, pre_costs, avoid)
            self._penalise_unwanted(dec, dec_costs, avoid)

        pre_of = _groups_of(pre, layout.pods, layout.groups)
        dec_of = _groups_of(dec, layout.decode, layout.decode_groups)
        pre_choice = pre_profile.choice_costs(pre_costs)
        best_pre: dict[str | None, float] = {}
        for name, cost in zip(pre_of, pre_choice, strict=True):
            if cost < best_pre.get(name, _INF):
                best_pre[name] = cost
        best_dec: dict[str | None, float] = {}
        for name, cost in zip(dec_of, dec_costs, strict=True):
            if cost < best_dec.get(name, _INF):
                best_dec[name] = cost
        weight = profiles.config.pairing.decode_weight
        names: list[str | None] = []
        pair_costs: list[float] = []
        for name in best_pre:
            dcost = best_dec.get(name)
            if dcost is None:
                continue
            names.append(name)
            pair_costs.append(
                best_pre[name] + weight * dcost
                if pre_profile.ttft
                else (best_pre[name] + weight * dcost) / (1.0 + weight)
            )
        rng_index = self._draw
        ties = tie_breaker(ctx, report.approx_depths, rng_index)
        tolerance = pre_profile.tolerance(ctx)
        group = names[choose(ties, pair_costs, tolerance, names)]

        ctx.role = "prefill"
        pi = within(pre_of, pre_choice, group, tolerance, ties, pre.keys)
        ctx.role = "decode"
        di = within(dec_of, dec_costs, group, dec_profile.tolerance(ctx),
                    at_random(rng_index), dec.keys)
        pair = pre_costs[pi] + weight * dec_costs[di]
        predicted: float | None = None
        idle = 0.0
        if pre_profile.ttft and pair < GUARD_PENALTY:
            tokens = ctx.prompt.token_count()
            transfer = tokens * ctx.cost.transfer_s_per_token
            predicted = pair + ctx.fit.predict(0.0) + transfer
            idle = ctx.fit.predict(tokens) + transfer
        ticket = self._prefill_ticket(ctx, pre, pi, report, pre_profile.uses_backlog)
        if pre_profile.ttft and pre_costs[pi] < GUARD_PENALTY:
            ctx.ready_at = ctx.now + pre_costs[pi] + ctx.fit.predict(0.0)

        def commit() -> None:
            ctx.role = "prefill"
            self._dispatched(ctx, pre_profile, pre, pi, report)
            if ticket is not None:
                asker = ctx.request.asker
                if asker is None:
                    ticket.dispatch()
                else:  # the asker's until it reports its own backlog (`router.sync`)
                    ticket.dispatch_for(asker)
            ctx.role = "decode"
            for scorer in dec_profile.recorders:
                scorer.picked(ctx, dec, di)
            counts = ctx.counts
            if pre_guarded:
                counts.guard["prefill"].inc()
            if dec_guarded:
                counts.guard["decode"].inc()
            if predicted is not None:
                counts.predicted_pd.observe(predicted)

        pick = Pick(decode=dec.pods[di], prefill=pre.pods[pi], decode_cost=dec_costs[di],
                    prefill_cost=pre_costs[pi],
                    on_prefill=None if ticket is None else ticket.done,
                    on_prefill_failed=None if ticket is None else ticket.failed)
        return _Decision(pick, predicted, commit, idle)

    def _prefill_ticket(
        self, ctx: PickContext, cands: Candidates, index: int, report: _PrefixReport,
        backlog: bool,
    ) -> PrefillTicket | None:
        """The chosen prefill's prediction (queue + compute + pull) and what to do with its
        measured duration (sequential PD); None when neither the fit nor the backlog
        needs it. Without a Conductor cost (no prefix scorer in ttft unit) the whole prompt
        counts as computed, and the fit learns nothing from it (what the pod had cached is
        unknown)."""
        known = report.compute_tokens is not None and report.pull_tokens is not None
        if not (known or backlog):
            return None
        if report.compute_tokens is not None and report.pull_tokens is not None:
            compute = report.compute_tokens[index]
            pull_s = report.pull_tokens[index] * ctx.server_costs.pull_s_per_token
        else:
            compute, pull_s = float(ctx.prompt.token_count()), 0.0
        engine = cands.engine[index]
        waiting = engine.waiting if engine is not None and engine.waiting else 0.0
        return PrefillTicket(
            ctx.fit, self.metrics, self.deps.backlog, self._clock, cands.keys[index],
            compute, pull_s, cands.inflight[index] == 0, ctx.now, waiting * ctx.mean_prefill_s,
            calibrates=known,
        )

    # -- bookkeeping --------------------------------------------------------------------------

    def _dispatched(
        self,
        ctx: PickContext,
        profile: Profile,
        cands: Candidates,
        index: int,
        report: _PrefixReport,
    ) -> None:
        for scorer in profile.recorders:
            scorer.picked(ctx, cands, index)
        counts = ctx.counts
        cached: float | None = None
        if report.approx_depths is not None and report.approx_total:
            depth = report.approx_depths[index]
            counts.queries["approximate"].inc(report.approx_total)
            if depth:
                counts.hits["approximate"].inc(depth)
            cached = depth / report.approx_total
        if (
            report.precise_local is not None
            and report.precise_reach is not None
            and report.precise_total
        ):
            local = report.precise_local[index]
            reach = report.precise_reach[index]
            counts.queries["precise"].inc(report.precise_total)
            if reach:
                counts.hits["precise"].inc(reach)
            cached = (local + report.store_factor * (reach - local)) / report.precise_total
        if not ctx.request.counted:
            # A pick for another process's request: its own pick observes it. Observed here
            # too, the leader's mean would count every process's new (cold) prompts and
            # only its own warm ones: twice the real mean at two workers, pricing each
            # request in flight on a warm pod at two prefills, which sent warm prompts away.
            return
        if report.approx_depths is None and report.precise_local is None:
            # No prefix scorer: what this pod has cached is unknown, and counting the whole
            # prompt as uncached would inflate the mean prefill a later prefix-aware
            # profile (after a reload) starts from, so it would spread away from its hits.
            return
        tokens = ctx.prompt.token_count()
        if report.compute_tokens is not None:
            uncached = report.compute_tokens[index]
        else:
            uncached = tokens * (1.0 - cached) if cached is not None else float(tokens)
        self.deps.estimator.observe(uncached, ctx.cost.ewma_alpha)
