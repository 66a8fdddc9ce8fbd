"""What one scheduling decision works on: the request's prompt, the candidates, the cost model.

Everything here is built per request and lives only for that request, except
`SchedulerDeps` (the long-lived state scorers read), `LoadEstimator` (one running
average) and `EngineMemo` (what a scorer computed from one scrape's engine loads).
Lists are parallel arrays indexed by candidate position, so a scorer fills a
preallocated `list[float]` instead of building dicts.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Generic, Literal, TypeVar

from router.kvhash.keyspace import KeySpace
from router.load import InFlight
from router.resources import ModelServer, parse_duration
from router.scheduling import ScheduleRequest
from router.scheduling.approx_index import ApproximatePrefixIndex
from router.scheduling.backlog import PrefillBacklog
from router.scheduling.block_hash import (
    ApproximateHasher,
    LeadingBlocks,
    PreciseHasher,
    PromptTokens,
    approximate_block_hashes,
    render_prompt,
    salt_of,
)
from router.scheduling.fallback import PreciseFallback
from router.scheduling.inflight_prefixes import InFlightPrefixes
from router.scheduling.metrics import DecisionCounts
from router.scheduling.metrics_scraper import EngineLoad, EngineMetricsStore
from router.scheduling.pool_view import PendingWrites, PoolSettings, PoolView, pool_settings
from router.scheduling.precise_index import PrecisePrefixIndex
from router.scheduling.ttft_model import Coefficients, FitSettings, PrefillFit, TTFTModels
from router.tokenization import TokenizePool, TokenizerRegistry
from router.view import Endpoint, ServerPods

RoleName = Literal["prefill", "decode", "aggregated"]
SESSION_HEADER: Final = "x-session-id"
#: Characters of a session id the session table keeps as it is; a longer one by its digest.
MAX_SESSION_ID_CHARS: Final = 256
#: Prompt length assumed before any request was seen (tokens), for the running average.
INITIAL_MEAN_UNCACHED_TOKENS: Final = 512.0


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds per unit of work: the `ttft` unit's conversion factors (config `costModel`).

    Predicted TTFT of a candidate = queue wait + prefill of the uncached prompt tokens
    (+ the prompt tokens x `transfer_s_per_token` to decode, the same for every
    candidate). Prefill is the ModelServer's calibrated curve (`ttft_model.py`), seeded
    with `prefill_overhead_s` + tokens x `prefill_s_per_token`. A prefix in the server's
    shared KV pool is pulled instead of recomputed when that is faster, at
    `kv_bytes_per_token` / `pool_gbytes_per_sec` seconds a token (per server: annotations
    `pdgate.io/kv-bytes-per-token`, `pdgate.io/kv-pool-gbytes-per-sec`). Defaults match
    the engine simulator's latency model (DeepSeek-V3 / Kimi K2 MLA KV in bf16 over one
    100 Gb/s NIC).
    """

    prefill_s_per_token: float = 1e-4
    prefill_overhead_s: float = 0.005
    transfer_s_per_token: float = 2e-6
    #: Floor of the mean prefill time one queued request adds.
    min_request_prefill_s: float = 0.005
    #: Share of a prefill one in-flight request costs a newcomer on an aggregated pod
    #: (in-flight requests there are mostly decoding, batched with the new prefill).
    aggregated_load_factor: float = 0.5
    #: Extra TTFT per request ahead of this one in a decode pod's queue.
    decode_admission_s: float = 0.01
    #: Extra TTFT at a full KV cache (preemption, admission stalls); scaled by usage.
    kv_full_penalty_s: float = 0.5
    #: Seconds one unit of a scorer with no natural scale (session, random) is worth.
    seconds_per_point: float = 0.05
    #: Weight of the newest request in the running mean of uncached prompt tokens.
    ewma_alpha: float = 0.05
    #: KV bytes of one token (model-dependent: 61 x (512 + 64) x 2 for DeepSeek-V3/Kimi K2).
    kv_bytes_per_token: int = 70_272
    #: Bandwidth a prefill pod pulls KV from the shared pool at, GB/s.
    pool_gbytes_per_sec: float = 12.5

    def seed(self) -> Coefficients:
        """The prefill curve before any measurement: overhead + tokens x per-token cost."""
        return Coefficients(self.prefill_overhead_s, self.prefill_s_per_token, 0.0)


KV_BYTES_ANNOTATION: Final = "pdgate.io/kv-bytes-per-token"
POOL_BANDWIDTH_ANNOTATION: Final = "pdgate.io/kv-pool-gbytes-per-sec"
SLO_ANNOTATION: Final = "pdgate.io/ttft-slo"


def _positive(annotations: dict[str, str], key: str, default: float) -> float:
    raw = annotations.get(key)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        return default
    return value if value > 0 else default


@dataclass(frozen=True, slots=True)
class ServerCosts:
    """What one ModelServer's annotations add to the cost model (computed per snapshot)."""

    scope: str
    pool: PoolSettings
    #: Seconds to pull one token of KV from the pool.
    pull_s_per_token: float
    #: TTFT target of the SLO gate, seconds (0: none).
    slo_target_s: float

    @classmethod
    def of(
        cls,
        server: ModelServer,
        cost: CostModel,
        pool_enabled: bool,
        pool_capacity_tokens: int,
        slo_default_s: float,
    ) -> ServerCosts:
        meta = server.meta
        notes = meta.annotations
        kv_bytes = _positive(notes, KV_BYTES_ANNOTATION, float(cost.kv_bytes_per_token))
        gbytes = _positive(notes, POOL_BANDWIDTH_ANNOTATION, cost.pool_gbytes_per_sec)
        pool = pool_settings(notes, False, pool_capacity_tokens)
        if not pool_enabled:
            pool = PoolSettings(False, pool.capacity_tokens)
        slo = slo_default_s
        raw = notes.get(SLO_ANNOTATION)
        if raw is not None:
            try:
                slo = float(parse_duration(raw))
            except ValueError:
                pass
        return cls(f"{meta.namespace}/{meta.name}", pool, kv_bytes / (gbytes * 1e9), slo)


class LoadEstimator:
    """Running mean of uncached prompt tokens per request: one request's prefill time."""

    __slots__ = ("mean_uncached_tokens",)

    def __init__(self, initial_tokens: float = INITIAL_MEAN_UNCACHED_TOKENS) -> None:
        self.mean_uncached_tokens = initial_tokens

    def observe(self, uncached_tokens: float, alpha: float) -> None:
        self.mean_uncached_tokens += alpha * (uncached_tokens - self.mean_uncached_tokens)

    def mean_prefill_s(self, cost: CostModel) -> float:
        """One queued request's prefill: the fixed overhead plus its mean uncached tokens.

        The overhead counts: behind a queue of cache hits it is most of the wait.
        """
        return max(
            cost.min_request_prefill_s,
            cost.prefill_overhead_s + self.mean_uncached_tokens * cost.prefill_s_per_token,
        )


def _session_key(session: str) -> str | bytes:
    """`session` as the session table keeps it: itself, or its 16-byte digest when it is
    long (bytes, so never equal to an id kept as it is)."""
    if len(session) <= MAX_SESSION_ID_CHARS:
        return session
    return hashlib.blake2b(session.encode("utf-8", "surrogatepass"), digest_size=16).digest()


@dataclass(slots=True)
class SessionTable:
    """Session id -> pod key per role, an LRU bounded by `max_sessions`, each id kept in at
    most `MAX_SESSION_ID_CHARS` characters (a longer one by its digest: the id is the
    client's header, up to the head's size limit, and the table holds tens of thousands)."""

    max_sessions: int
    _table: OrderedDict[tuple[str, str | bytes], str]

    @classmethod
    def create(cls, max_sessions: int) -> SessionTable:
        return cls(max_sessions, OrderedDict())

    def get(self, role: str, session: str) -> str | None:
        return self._table.get((role, _session_key(session)))

    def put(self, role: str, session: str, key: str) -> None:
        table = self._table
        entry = (role, _session_key(session))
        table[entry] = key
        table.move_to_end(entry)
        while len(table) > self.max_sessions:
            table.popitem(last=False)

    def __len__(self) -> int:
        return len(self._table)


@dataclass(slots=True)
class SchedulerDeps:
    """The long-lived state scorers and filters read; shared by every profile."""

    inflight: InFlight
    engines: EngineMetricsStore
    approx: ApproximatePrefixIndex
    precise: PrecisePrefixIndex
    hasher: PreciseHasher
    sessions: SessionTable
    rng: random.Random
    is_ejected: Callable[[str], bool]
    estimator: LoadEstimator
    tokenizers: TokenizerRegistry | None = None  # per-ModelServer tokenizers (precise)
    tokenize_pool: TokenizePool | None = None  # big prompts are tokenized off the loop
    #: The dispatch-fed view of each server's shared KV pool (approximate keys).
    pools: PoolView = field(default_factory=PoolView)
    #: Pool records waiting for their prefill's predicted end.
    pending: PendingWrites = field(default_factory=PendingWrites)
    #: Per-server prefill curves, calibrated from measured prefill durations.
    ttft: TTFTModels = field(
        default_factory=lambda: TTFTModels(CostModel().seed(), FitSettings())
    )
    fallback: PreciseFallback | None = None  # servers the precise scorer scores approximately
    #: Prefill seconds dispatched to each pod and predicted not yet done.
    backlog: PrefillBacklog = field(default_factory=PrefillBacklog)
    #: Prompts the precise scorer placed whose blocks the engines have not published yet.
    inflight_prefixes: InFlightPrefixes = field(default_factory=InFlightPrefixes)
    #: Approximate block hashes with a memo of the leading messages' blocks.
    approx_hasher: ApproximateHasher = field(default_factory=ApproximateHasher)
    #: Asks the router process that places new prompts (`router.sync`'s leader) where this
    #: one should go: (server key, model, path, flow, body) -> pod keys, or None to place
    #: it here. None: this process places every prompt itself.
    place: (
        Callable[[str, str, str, str, Mapping[str, Any]], Awaitable[tuple[str, ...] | None]]
        | None
    ) = None
    #: Sends what this router process changed and has not sent yet, and applies what the
    #: other workers of its host sent (`router.sync.SyncNode.catch_up`); called before
    #: every pick. None: no other router process.
    catch_up: Callable[[], None] | None = None

    def precise_fallen_back(self, server: ModelServer) -> bool:
        """Whether the precise scorer scores `server` with the approximate index instead
        (`fallback`: its tokens cannot be trusted)."""
        fallback = self.fallback
        return fallback is not None and fallback.reason(server) is not None


class PromptInfo:
    """The request's prompt, hashed lazily and at most once per request."""

    __slots__ = (
        "_approx",
        "_approx_hasher",
        "_block_bytes",
        "_chars_per_token",
        "_estimate",
        "_hasher",
        "_lead",
        "_leading",
        "_leading_space",
        "_max_blocks",
        "_precise",
        "_precise_space",
        "_rendered",
        "_server",
        "_tokens",
        "request",
    )

    def __init__(
        self,
        request: ScheduleRequest,
        hasher: PreciseHasher,
        block_bytes: int,
        max_blocks: int,
        chars_per_token: float,
        server: ModelServer | None = None,
        approx_hasher: ApproximateHasher | None = None,
    ) -> None:
        self.request = request
        self._server = server
        self._approx_hasher = approx_hasher
        self._lead = 0
        self._estimate = -1  # token_count's estimate from the rendered bytes, once
        self._hasher = hasher
        self._block_bytes = block_bytes
        self._max_blocks = max_blocks
        self._chars_per_token = chars_per_token
        self._rendered: bytes | bool | None = False
        self._approx: list[int] | None = None
        self._tokens: PromptTokens | bool | None = False
        self._precise: list[int] | None = None
        self._precise_space: KeySpace | None = None
        self._leading: LeadingBlocks | None = None
        self._leading_space: KeySpace | None = None

    def rendered(self) -> bytes | None:
        if self._rendered is False:
            req = self.request
            rendered = render_prompt(req.path, req.body)
            self._rendered = None if rendered is None else rendered[0]
            if rendered is not None:
                self._lead = rendered[1]
        return self._rendered if isinstance(self._rendered, bytes) else None

    def approx_hashes(self) -> list[int]:
        if self._approx is None:
            data = self.rendered()
            body = self.request.body
            model = body.get("model")
            if not isinstance(model, str):
                model = self.request.model
            if data is None:
                self._approx = []
            elif self._approx_hasher is None:
                self._approx = approximate_block_hashes(
                    data, model, salt_of(body), self._block_bytes, self._max_blocks
                )
            else:
                self._approx = self._approx_hasher.hashes(
                    data, self._lead, model, salt_of(body), self._block_bytes, self._max_blocks
                )
        return self._approx

    def tokens(self) -> PromptTokens | None:
        if self._tokens is False:
            req = self.request
            self._tokens = (
                PromptTokens(req.tokens)
                if req.tokens is not None
                else self._hasher.tokens(req.path, req.body, self._server)
            )
            if req.tokens is None and isinstance(self._tokens, PromptTokens):
                req.tokens = self._tokens.ids  # a retry of this request reuses them
        return self._tokens if isinstance(self._tokens, PromptTokens) else None

    def precise_hashes(self, space: KeySpace | None = None) -> list[int]:
        """The prompt's block keys in `space` (None: the hasher's default), computed once
        per request and key space."""
        space = space or self._hasher.space
        if self._precise is None or self._precise_space is not space:
            tokens = self.tokens()
            salt = salt_of(self.request.body)
            self._precise_space = space
            self._precise = (
                []
                if tokens is None
                else self._hasher.block_hashes(
                    tokens.ids, salt, tokens.message_ends, space, self.request.lora_name
                )
            )
        return self._precise

    def leading_hashes(self, space: KeySpace | None, known: Callable[[int], bool]) -> list[int]:
        """The prompt's block keys in `space` up to the first block `known` says no pod or
        pool holds (`PreciseHasher.leading_hashes`): all a precise match needs, without
        encoding the rest of the prompt. All of them when the token ids are known anyway."""
        space = space or self._hasher.space
        if (
            (self._precise is not None and self._precise_space is space)
            or isinstance(self._tokens, PromptTokens)
            or self.request.tokens is not None
        ):
            return self.precise_hashes(space)
        if self._leading is None or self._leading_space is not space:
            req = self.request
            prepared = req.leading
            if prepared is not None and prepared[0] == space.ident:
                leading = prepared[1]
            else:
                stream = self._hasher.id_stream(req.path, req.body, self._server)
                leading = (
                    LeadingBlocks([], -1, False)
                    if stream is None
                    else self._hasher.leading_hashes(
                        stream, salt_of(req.body), space, known, req.lora_name
                    )
                )
            self._leading, self._leading_space = leading, space
            req.leading = (space.ident, leading)  # a retry of this request reuses them
        return self._leading.keys

    def token_count(self) -> int:
        """Exact when the token ids were computed, estimated from what was encoded of them
        when only leading blocks were, else from the rendered bytes."""
        if isinstance(self._tokens, PromptTokens):
            return len(self._tokens.ids)
        if self._leading is not None and self._leading.tokens >= 0:
            return self._leading.tokens
        estimate = self._estimate
        if estimate < 0:
            data = self.rendered()
            estimate = 0 if data is None else int(len(data) / self._chars_per_token)
            self._estimate = estimate
        return estimate

    @property
    def approx_block_bytes(self) -> int:
        return self._block_bytes

    def tokens_per_approx_block(self) -> float:
        """The prompt tokens one approximate block covers: its share of the rendered bytes
        (so a full match still leaves the tail after the last full block to compute)."""
        data = self.rendered()
        tokens = float(self.token_count())
        if data:
            return tokens * self._block_bytes / len(data)
        total = len(self.approx_hashes())
        return tokens / total if total else 0.0


T = TypeVar("T")


class EngineMemo(Generic[T]):
    """The last value a scorer or filter computed from the engine loads alone.

    `EngineMetricsStore.get_many` returns the same list object until a scrape lands (or
    a load goes stale), so a value computed from `cands.engine` holds while
    `cands.engine` is that object: the per-pod work is done once per scrape, not once
    per decision. Shared results are read, never changed."""

    __slots__ = ("_source", "_value")

    def __init__(self) -> None:
        self._source: object = None
        self._value: T | None = None

    def get(self, source: object) -> T | None:
        return self._value if source is self._source else None

    def put(self, source: object, value: T) -> T:
        self._source, self._value = source, value
        return value


class Candidates:
    """The pods still in the running for one role, with their loads read once."""

    __slots__ = ("engine", "inflight", "keys", "pods")

    def __init__(
        self,
        pods: list[Endpoint],
        keys: list[str],
        inflight: list[int],
        engine: list[EngineLoad | None],
    ) -> None:
        self.pods = pods
        self.keys = keys
        self.inflight = inflight
        self.engine = engine

    @classmethod
    def read(
        cls, pods: list[Endpoint], keys: list[str], deps: SchedulerDeps, now: float
    ) -> Candidates:
        return cls(pods, keys, deps.inflight.get_many(keys), deps.engines.get_many(keys, now))

    def subset(self, keep: list[int]) -> Candidates:
        return Candidates(
            [self.pods[i] for i in keep],
            [self.keys[i] for i in keep],
            [self.inflight[i] for i in keep],
            [self.engine[i] for i in keep],
        )

    def __len__(self) -> int:
        return len(self.pods)

    def loads(self, memo: EngineMemo[list[float]] | None = None) -> list[float]:
        """Router in-flight plus the engine's waiting queue when known: the guard's measure.
        `memo` keeps the waiting queues per scrape."""
        waiting = None if memo is None else memo.get(self.engine)
        if waiting is None:
            waiting = [
                e.waiting if e is not None and e.waiting is not None else 0.0
                for e in self.engine
            ]
            if memo is not None:
                memo.put(self.engine, waiting)
        return [n + w for n, w in zip(self.inflight, waiting)]  # noqa: B905 (same lengths)


class PickContext:
    """One request's decision: inputs, and what scorers found that the pipeline reports."""

    __slots__ = (
        "approx_depths",
        "approx_hashes",
        "backlog_s",
        "compute_tokens",
        "cost",
        "counts",
        "deps",
        "fit",
        "mean_prefill_s",
        "now",
        "precise_hashes",
        "precise_held",
        "precise_local",
        "precise_reach",
        "prefix_scale_s",
        "prompt",
        "pull_tokens",
        "ready_at",
        "request",
        "role",
        "server",
        "server_costs",
        "store_factor",
        "ttft_unit",
    )

    def __init__(
        self,
        request: ScheduleRequest,
        server: ServerPods,
        prompt: PromptInfo,
        deps: SchedulerDeps,
        cost: CostModel,
        now: float,
        counts: DecisionCounts,
        server_costs: ServerCosts | None = None,
    ) -> None:
        self.request = request
        #: Where this decision's observations go (`metrics.DecisionCounts`).
        self.counts = counts
        self.server = server
        self.prompt = prompt
        self.deps = deps
        self.cost = cost
        self.now = now
        self.role: RoleName = "aggregated"
        self.server_costs = server_costs or ServerCosts.of(server.server, cost, False, 1, 0.0)
        self.fit: PrefillFit = deps.ttft.get(self.server_costs.scope)
        self.mean_prefill_s = max(
            cost.min_request_prefill_s,
            self.fit.predict(deps.estimator.mean_uncached_tokens),
        )
        self.ttft_unit = True
        # Filled by the prefix scorers (ttft unit): the prefill seconds between no cache
        # and a full hit, and per candidate the tokens to compute and to pull from the pool.
        self.prefix_scale_s = 0.0
        self.compute_tokens: list[float] | None = None
        self.pull_tokens: list[float] | None = None
        #: When the chosen prefill is predicted to end (its blocks are then in the pool).
        self.ready_at = now
        # Filled by the prefix scorers for the candidates they scored (same order).
        self.approx_depths: list[int] | None = None
        self.approx_hashes = 0
        self.precise_local: list[int] | None = None
        self.precise_reach: list[int] | None = None
        #: precise_local plus the blocks of prompts in flight to each candidate
        #: (`inflight_prefixes.py`): what the candidate will hold when the prompt arrives.
        self.precise_held: list[int] | None = None
        self.precise_hashes = 0
        self.store_factor = 1.0
        # Filled by the `prefill-backlog` scorer: each candidate's predicted wait.
        self.backlog_s: list[float] | None = None

    def session_id(self) -> str | None:
        headers = self.request.headers
        value = headers.get(SESSION_HEADER)
        if value is None:
            value = headers.get("X-Session-Id")
        return value or None

    def prefix_scores(
        self, total: float, local: list[float], reach: list[float]
    ) -> list[float]:
        """Scores of the Conductor cost: per candidate, prefill of what is not cached
        locally, or prefill of what the pool lacks plus the pull of the rest from the pool,
        whichever is faster. `total`, `local`, `reach` are tokens (reach >= local: local
        or in the pool; `reach is local`: nothing in the pool). Sets `prefix_scale_s`
        (what a score of 0 costs), `compute_tokens` and `pull_tokens`."""
        curve = self.fit.coefficients
        a, b, c = curve.a, curve.b, curve.c  # P(x) = a + x (b + x c), x >= 0 (inlined)
        base = curve(0.0)
        scale = curve(total) - base
        self.prefix_scale_s = max(0.0, scale)
        if reach is local:  # nothing to pull: the same formula in three flat passes
            uncached = [total - held for held in local]
            self.compute_tokens = uncached
            self.pull_tokens = [0.0] * len(uncached)
            if not scale > 0:
                return [0.0] * len(uncached)
            xs = uncached if min(uncached) > 0.0 else [x if x > 0.0 else 0.0 for x in uncached]
            return [1.0 - (a + x * (b + x * c) - base) / scale for x in xs]
        pull = self.server_costs.pull_s_per_token
        scores: list[float] = []
        compute: list[float] = []
        pulled: list[float] = []
        for held, both in zip(local, reach, strict=True):
            x = total - held
            if not x > 0.0:
                x = 0.0
            recompute = a + x * (b + x * c) - base
            if both > held:
                via_pool = curve(total - both) - base + pull * (both - held)
                if via_pool < recompute:
                    compute.append(total - both)
                    pulled.append(both - held)
                    scores.append(1.0 - via_pool / scale if scale > 0 else 0.0)
                    continue
            compute.append(total - held)
            pulled.append(0.0)
            scores.append(1.0 - recompute / scale if scale > 0 else 0.0)
        self.compute_tokens = compute
        self.pull_tokens = pulled
        return scores

    def per_request_s(self) -> float:
        """The wait one request ahead in the queue adds, for the current role (seconds)."""
        if self.role == "decode":
            return self.cost.decode_admission_s
        if self.role == "aggregated":
            return self.mean_prefill_s * self.cost.aggregated_load_factor
        return self.mean_prefill_s
