"""Tokenizer parity with the engines, checked at run time: never a silent zero.

The precise prefix-cache index only matches when the router's token ids equal the
engine's. So whenever a pod of a ModelServer with a tokenizer (`pdgate.io/tokenizer`)
appears, whenever that server's tokenizer changes, and every `PARITY_INTERVAL_S` after
that, the router asks the pod's engine to tokenize two probe requests with vLLM's
`POST /tokenize` (`PROBES`: the chat form, a system prompt + a user turn + the generation
prompt, and the completions prompt form) and compares the answer with its own tokens.

Off the request path: one background task (`run`), at most `MAX_CONCURRENT_PROBES`
probes at once, each POST bounded by `PROBE_TIMEOUT_S`. The probes carry no `model`
(vLLM then uses its served model), so a 404 can only mean "no such route": an engine
that does not serve `/tokenize` is `unknown`, logged once per server, never a mismatch.
Timeouts, refused connections and other answers are `unknown` as well (logged once per
transition), and are probed again at the next round.

A server's parity is `mismatch` if any of its probed pods differs, else `match` if any
pod matched, else `unknown`. Results count only for the tokenizer they were taken with:
a changed tokenizer is probed again and is `unknown` meanwhile.

What it reports (README, "Tokenizer parity"):

- `pdgate_tokenizer_parity{namespace,server}`: 1 match, 0 mismatch, -1 unknown (not
  probed yet, the engine has no `/tokenize`, or it did not answer); present for every
  ModelServer that names a tokenizer, absent for the others;
- `pdgate_tokenizer_parity_mismatches_total{namespace,server}`: pod probes that differed;
- `pdgate_tokenizer_parity_probes_total{result}`: probes by result (one an API server:
  the data-parallel ranks of a pod share theirs, and its answer);
- one WARNING log per transition to `mismatch`, naming the server, the pod, the probe form
  and the first differing token position (with both ids there); one INFO back to `match`;
- `notify(server, reason, message)` on a transition to `mismatch` (reason
  `TokenizerMismatch`): with the Kubernetes source, a Warning Event on the ModelServer.

`mismatched(key)` is what the precise scorer asks per request (a set lookup): a
mismatched server is scored with the approximate index instead
(`router.scheduling.fallback`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import aiohttp
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from router.resources import ModelServer
from router.tokenization.messages import ChatInputError
from router.tokenization.registry import TokenizerRegistry
from router.tokenization.tokenizer import Endpoint as PromptKind
from router.tokenization.tokenizer import ModelTokenizer
from router.view import Endpoint, Snapshot

log = logging.getLogger("pdgate.tokenization.parity")

#: Seconds between two rounds of probes of every pod (a new pod is probed at once).
PARITY_INTERVAL_S: Final = 300.0
#: Bound of one `/tokenize` call (connect + answer).
PROBE_TIMEOUT_S: Final = 5.0
#: Probes in flight at once (and connections the prober holds).
MAX_CONCURRENT_PROBES: Final = 4
#: While a tokenizer is still loading, look again after this long.
LOADING_POLL_S: Final = 0.2
#: A pod whose probe failed (timeout, refused, 5xx; not a 404) is probed again this soon.
UNKNOWN_RETRY_S: Final = 10.0
#: Token ids shown on each side of the first difference in the warning.
DIFF_CONTEXT: Final = 3
TOKENIZE_PATH: Final = "/tokenize"
MISMATCH_REASON: Final = "TokenizerMismatch"

Parity = Literal["match", "mismatch", "unknown"]
PARITY_VALUE: Final[Mapping[Parity, float]] = {"match": 1.0, "mismatch": 0.0, "unknown": -1.0}

#: The probe requests: (form, body). Non-ASCII, digits and punctuation on purpose, and a
#: system prompt, so template and pre-tokenizer differences both show.
PROBES: Final[tuple[tuple[PromptKind, Mapping[str, Any]], ...]] = (
    ("chat", {
        "messages": [
            {"role": "system", "content": "You are pdgate's parity probe. Réponds en 1 mot; "
                                          "東京 → Tokyo, 42 ≠ 4.2."},
            {"role": "user", "content": "Which tokens does the engine see?\n  Count: 1, 22, "
                                        "333 — done."},
        ],
        "add_generation_prompt": True,
    }),
    ("completion", {"prompt": "The quick brown fox (ü, 東京, 3.14) jumps:\n\tover  it."}),
)  # fmt: skip

Notify = Callable[[ModelServer, str, str], None]


def first_difference(mine: Sequence[int], theirs: Sequence[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts)."""
    for i, (a, b) in enumerate(zip(mine, theirs, strict=False)):
        if a != b:
            return i
    return None if len(mine) == len(theirs) else min(len(mine), len(theirs))


@dataclass(frozen=True, slots=True)
class PodParity:
    """One pod's probe result, for the tokenizer it was taken with."""

    status: Parity
    detail: str
    tokenizer: ModelTokenizer
    at: float
    no_route: bool = False  # unknown because the engine answered 404 (no /tokenize)


def _window(ids: Sequence[int], at: int) -> list[int]:
    return list(ids[max(0, at - DIFF_CONTEXT) : at + DIFF_CONTEXT + 1])


class ParityProber:
    """Probes engines' `/tokenize` and keeps each ModelServer's parity (module docstring)."""

    def __init__(
        self,
        tokenizers: TokenizerRegistry,
        registry: CollectorRegistry | None = None,
        *,
        interval_s: float = PARITY_INTERVAL_S,
        timeout_s: float = PROBE_TIMEOUT_S,
        max_concurrency: int = MAX_CONCURRENT_PROBES,
        notify: Notify | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tokenizers = tokenizers
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._max_concurrency = max_concurrency
        self._notify = notify
        self._clock = clock
        self._snapshot = Snapshot()
        self._pods: dict[str, PodParity] = {}  # pod key -> last result (pods in the view)
        self._status: dict[tuple[str, str], Parity] = {}
        self._mismatched: set[tuple[str, str]] = set()
        self._no_route_logged: set[tuple[str, str]] = set()
        self._next_round = clock()
        self._wake = asyncio.Event()
        self._mismatch_counter: Counter | None = None
        self._probes: Counter | None = None
        if registry is not None:
            self._mismatch_counter = Counter(
                "pdgate_tokenizer_parity_mismatches",
                "Engine /tokenize probes whose tokens differed from the router's, by "
                "ModelServer.", ["namespace", "server"], registry=registry,
            )
            self._probes = Counter(
                "pdgate_tokenizer_parity_probes",
                "Engine /tokenize probes, by result (match, mismatch, unknown).",
                ["result"], registry=registry,
            )
            registry.register(_ParityCollector(self))

    # -- what the scheduler and the metrics read ------------------------------------------------

    def mismatched(self, key: tuple[str, str]) -> bool:
        """Whether the ModelServer `key` (namespace, name) failed its parity check."""
        return key in self._mismatched

    def status(self, key: tuple[str, str]) -> Parity:
        return self._status.get(key, "unknown")

    def pod_result(self, pod_key: str) -> PodParity | None:
        return self._pods.get(pod_key)

    def set_notifier(self, notify: Notify | None) -> None:
        """Where mismatch notices go besides the log (the Kubernetes Event recorder)."""
        self._notify = notify

    def servers(self) -> Iterator[ModelServer]:
        """The ModelServers of the current view that name a tokenizer."""
        for pods in self._snapshot.servers.values():
            if self._tokenizers.spec(pods.server) is not None:
                yield pods.server

    # -- the view ---------------------------------------------------------------------------------

    def on_snapshot(self, snapshot: Snapshot) -> None:
        """Forget pods and servers that left; wake the loop to probe the new ones."""
        self._snapshot = snapshot
        present = set(snapshot.endpoints())
        for pod_key in [k for k in self._pods if k not in present]:
            del self._pods[pod_key]
        servers = set(snapshot.servers)
        for gone in [k for k in self._status if k not in servers]:
            self._forget_server(gone)
        self._no_route_logged &= servers
        for server_key in snapshot.servers:
            self._refresh(server_key)
        self._wake.set()

    def _forget_server(self, key: tuple[str, str]) -> None:
        self._status.pop(key, None)
        self._mismatched.discard(key)
        if self._mismatch_counter is not None:
            try:
                self._mismatch_counter.remove(*key)
            except KeyError:
                pass

    # -- the loop ---------------------------------------------------------------------------------

    def due(self, now: float) -> tuple[list[tuple[ModelServer, Endpoint, ModelTokenizer]], bool]:
        """Pods to probe now, and whether some server's tokenizer is still loading."""
        full_round = now >= self._next_round
        todo: list[tuple[ModelServer, Endpoint, ModelTokenizer]] = []
        loading = False
        for pods in self._snapshot.servers.values():
            server = pods.server
            state = self._tokenizers.state(server)
            if state == "loading":
                loading = True
            tokenizer = self._tokenizers.get(server) if state == "loaded" else None
            if tokenizer is None:
                continue
            for pod in pods.endpoints():
                last = self._pods.get(pod.key)
                if (
                    full_round
                    or last is None
                    or last.tokenizer is not tokenizer
                    or (last.status == "unknown" and not last.no_route
                        and now >= last.at + UNKNOWN_RETRY_S)
                ):
                    todo.append((server, pod, tokenizer))
        if full_round:
            self._next_round = now + self.interval_s
        return todo, loading

    async def run(self) -> None:
        """Probe until cancelled (see the module docstring)."""
        connector = aiohttp.TCPConnector(
            limit=self._max_concurrency, limit_per_host=self._max_concurrency,
            keepalive_timeout=4.0,
        )
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            while True:
                self._wake.clear()
                loading = await self.probe_due(session)
                # `loading` as `due()` saw it: a tokenizer that finished loading since then
                # was skipped by this pass, so poll again soon rather than sleep to the
                # next round (the last server to load was left unprobed for 300 s).
                wait = LOADING_POLL_S if loading else self._until_due()
                # Not `wait_for`: on 3.11 it swallows a cancel that lands as the event is
                # set (a view change during shutdown), and the loop would go on forever.
                try:
                    async with asyncio.timeout(wait):
                        await self._wake.wait()
                except TimeoutError:
                    pass

    def _until_due(self) -> float:
        """Seconds until the next round or the next retry of a failed probe."""
        due = self._next_round
        for result in self._pods.values():
            if result.status == "unknown" and not result.no_route:
                due = min(due, result.at + UNKNOWN_RETRY_S)
        return max(0.0, due - self._clock())

    async def probe_due(self, session: aiohttp.ClientSession) -> bool:
        """Probe every pod that is due; returns whether a tokenizer was still loading.

        The data-parallel ranks of a pod share its API server and its tokenizer: that
        server is probed once, and its answer recorded for each rank."""
        todo, loading = self.due(self._clock())
        if not todo:
            return loading
        gate = asyncio.Semaphore(self._max_concurrency)
        # (API server, tokenizer) -> the targets it answers for, each with its server
        by_server: dict[tuple[str, ModelTokenizer], list[tuple[ModelServer, Endpoint]]] = {}
        for server, pod, tokenizer in todo:
            by_server.setdefault((pod.base_url, tokenizer), []).append((server, pod))

        async def one(at: tuple[str, ModelTokenizer],
                      targets: list[tuple[ModelServer, Endpoint]]) -> None:
            async with gate:
                result = await self.probe(session, targets[0][1], at[1])
            if self._probes is not None:
                self._probes.labels(result.status).inc()
            if result.status == "mismatch" and self._mismatch_counter is not None:
                for key in {server.meta.key for server, _ in targets}:  # once a server
                    self._mismatch_counter.labels(*key).inc()
            for server, pod in targets:
                self._record(server, pod, result)

        await asyncio.gather(*(one(at, targets) for at, targets in by_server.items()))
        return loading

    async def probe(
        self, session: aiohttp.ClientSession, pod: Endpoint, tokenizer: ModelTokenizer
    ) -> PodParity:
        """Both probe forms against one pod's engine."""
        url = pod.base_url + TOKENIZE_PATH
        for form, body in PROBES:
            try:
                mine = tokenizer.request_ids(form, body)[0]
            except ChatInputError as exc:
                return self._result("mismatch", f"the router cannot tokenize the {form} "
                                    f"probe: {exc}", tokenizer)
            try:
                async with session.post(url, json=body) as response:
                    if response.status == 404:
                        return self._result(
                            "unknown", f"pod {pod.key} does not serve {TOKENIZE_PATH} (404)",
                            tokenizer, no_route=True,
                        )
                    if response.status != 200:
                        text = (await response.text())[:200]
                        return self._result(
                            "unknown", f"pod {pod.key} answered {TOKENIZE_PATH} ({form}) with "
                            f"{response.status}: {text}", tokenizer,
                        )
                    answer = await response.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                return self._result(
                    "unknown", f"pod {pod.key}: {TOKENIZE_PATH} failed: "
                    f"{type(exc).__name__} {exc}".rstrip(), tokenizer,
                )
            theirs = answer.get("tokens") if isinstance(answer, dict) else None
            if not isinstance(theirs, list) or not all(type(t) is int for t in theirs):
                return self._result(
                    "unknown", f"pod {pod.key}: {TOKENIZE_PATH} answered no token list",
                    tokenizer,
                )
            at = first_difference(mine, theirs)
            if at is not None:
                return self._result(
                    "mismatch",
                    f"pod {pod.key}, {form} probe: first difference at token position {at} "
                    f"(router {len(mine)} tokens, {_window(mine, at)} from position "
                    f"{max(0, at - DIFF_CONTEXT)}; engine {len(theirs)} tokens, "
                    f"{_window(theirs, at)})",
                    tokenizer,
                )
        return self._result("match", f"pod {pod.key}: chat and prompt probes match", tokenizer)

    def _result(
        self, status: Parity, detail: str, tokenizer: ModelTokenizer, no_route: bool = False
    ) -> PodParity:
        return PodParity(status, detail, tokenizer, self._clock(), no_route)

    # -- results ----------------------------------------------------------------------------------

    def _record(self, server: ModelServer, pod: Endpoint, result: PodParity) -> None:
        key = server.meta.key
        pods = self._snapshot.servers.get(key)
        if pods is None or pod not in pods.endpoints():
            return  # the pod left while it was probed
        last = self._pods.get(pod.key)
        if result.no_route and key not in self._no_route_logged:
            self._no_route_logged.add(key)
            log.warning(
                "ModelServer %s/%s: tokenizer parity unknown: %s; precise prefix-cache "
                "scoring runs unverified for it", key[0], key[1], result.detail,
            )
        elif result.status == "unknown" and not result.no_route and (
            last is None or last.status != "unknown"
        ):
            log.warning("ModelServer %s/%s: tokenizer parity probe failed, retrying in %.0f s:"
                        " %s", key[0], key[1], UNKNOWN_RETRY_S, result.detail)
        self._pods[pod.key] = result
        self._refresh(key)

    def _refresh(self, key: tuple[str, str]) -> None:
        """Recompute one server's parity from its pods' results; log the transition."""
        pods = self._snapshot.servers.get(key)
        if pods is None:
            return
        server = pods.server
        tokenizer = self._tokenizers.get(server)
        if self._tokenizers.spec(server) is None:
            self._forget_server(key)
            return
        results = [
            r for p in pods.endpoints()
            if (r := self._pods.get(p.key)) is not None and r.tokenizer is tokenizer
        ]
        bad = next((r for r in results if r.status == "mismatch"), None)
        new: Parity = (
            "mismatch" if bad is not None
            else "match" if any(r.status == "match" for r in results)
            else "unknown"
        )
        old = self._status.get(key, "unknown")
        self._status[key] = new
        if new == "mismatch":
            self._mismatched.add(key)
        else:
            self._mismatched.discard(key)
        if new == old:
            return
        name = f"{key[0]}/{key[1]}"
        if bad is not None:
            message = (
                f"ModelServer {name}: the router's tokenizer "
                f"({self._tokenizers.spec(server)}) disagrees with the engine's /tokenize: "
                f"{bad.detail}; precise prefix-cache scoring falls back to the approximate "
                "index for this server"
            )
            log.warning("%s", message)
            if self._notify is not None:
                self._notify(server, MISMATCH_REASON, message)
        elif new == "match":
            match = next(r for r in results if r.status == "match")
            log.info("ModelServer %s: tokenizer parity verified (%s)", name, match.detail)
        elif old == "mismatch":
            log.info("ModelServer %s: tokenizer parity no longer known to differ", name)


class _ParityCollector(Collector):
    """`pdgate_tokenizer_parity`, computed from the prober's state at scrape time."""

    def __init__(self, prober: ParityProber) -> None:
        self._prober = prober

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "pdgate_tokenizer_parity",
            "Router tokens vs the engine's /tokenize, per ModelServer naming a tokenizer: "
            "1 match, 0 mismatch, -1 unknown.",
            labels=["namespace", "server"],
        )
        prober = self._prober
        for server in prober.servers():
            key = server.meta.key
            family.add_metric(list(key), PARITY_VALUE[prober.status(key)])
        yield family

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())
