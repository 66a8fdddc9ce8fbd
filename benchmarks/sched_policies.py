"""Scheduling policies side by side on simulated PD pods: prefix hit rate and TTFT.

    .venv/bin/python -m benchmarks.sched_policies [--groups 3] [--no-store] [--no-decision]

One Mooncake master, G PD groups (one prefill and one decode `engine_sim` pod each, the
latency model on, a small KV cache so that where a prompt goes decides whether it hits),
and the router in-process (uvicorn in this event loop, so the scheduler's state can be
read). Every policy runs the same seeded shared-prefix workload (S system prompts, Q
questions each, arriving shuffled) through the same pods; policies are switched by
rewriting the `--scheduler-config` file, which the router hot-reloads. Each run sends its
own `cache_salt`, so no run finds KV an earlier run left (engine caches, the store) while
the token sequence is identical.

Two engine setups, each with every policy: prefill engines that compute whatever their own
cache lacks, then engines that also read prefix blocks other pods wrote to the Mooncake
Store (`--store-prefix-cache`): the store credit of the Mooncake-aware policy only pays
off with the second.

Reported per policy: the prefix-cache hit rate measured at the prefill engines (tokens,
`/sim/stats` deltas; local cache, and read from the store), the best possible (every
request of a group on one pod that never evicts), client TTFT p50/p90 (first content chunk
of the stream), and requests per prefill pod. Then the scheduler's decision time per
request at 8, 64 and 512 pods (`benchmarks.decision`). This module is also the tests'
workload and cluster (`tests/integration/test_scheduling.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import aiohttp
import orjson
import uvicorn
import yaml

from benchmarks.cluster import loopback_net
from benchmarks.decision import default_prefill_with
from benchmarks.words import sim_tokenizer, single_token_words
from engine_sim.ports import common_free_port as free_port
from engine_sim.prompts import DEFAULT_CHAT_TEMPLATE, DEFAULT_TOKENIZER
from router.data_parallel import DP_SIZE_ANNOTATION
from router.kvhash.keyspace import KeySpace
from router.local_cluster import owned_child
from router.scheduling.config import SchedulerConfig, parse_scheduler_config
from router.scheduling.runtime import SchedulerRuntime
from router.state import AppState, RouterConfig
from router.tokenization import CHAT_TEMPLATE_ANNOTATION, TOKENIZER_ANNOTATION

#: PYTHONHASHSEED of the simulated pods: one root for all, as pods sharing a KV store need.
POD_HASH_SEED: Final = "0"

MODEL: Final = "sched-model"
SERVER: Final = "sched-pd"
API_VERSION: Final = "networking.serving.volcano.sh/v1alpha1"
BLOCK_SIZE: Final = 16
CHAT_PATH: Final = "/v1/chat/completions"
STARTUP_TIMEOUT_S: Final = 60.0
#: `loopback_net` salt of a policy cluster's pods (a `SimCluster` of the same run uses 0).
POLICY_NET_SALT: Final = 75
#: The pods' KV events port (rank r's: + r).
EVENTS_PORT: Final = 5557
# -- workloads ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """S groups x Q questions; every group has its own long system prompt."""

    groups: int = 8
    questions: int = 8
    system_tokens: int = 1024
    question_tokens: int = 32
    output_tokens: int = 4
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Prompt:
    group: int
    messages: tuple[tuple[str, str], ...]  # (role, content)

    def body(self, model: str, max_tokens: int, salt: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": r, "content": c} for r, c in self.messages],
            "max_tokens": max_tokens,
            "stream": True,
        }
        if salt:
            body["cache_salt"] = salt
        return body


def _text(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choices(single_token_words(), k=max(1, tokens)))


def shared_prefix(spec: SharedPrefix) -> list[Prompt]:
    """The seeded request sequence: every group's questions, shuffled together."""
    rng = random.Random(f"pdgate-sched:{spec.seed}")
    systems = [f"Group {g}. " + _text(rng, spec.system_tokens) for g in range(spec.groups)]
    pairs = [(g, q) for g in range(spec.groups) for q in range(spec.questions)]
    questions = {pair: _text(rng, spec.question_tokens) + "?" for pair in pairs}
    rng.shuffle(pairs)
    return [
        Prompt(g, (("system", systems[g]), ("user", questions[(g, q)]))) for g, q in pairs
    ]


def hot_prefix(count: int, spec: SharedPrefix) -> list[Prompt]:
    """`count` different questions behind ONE system prompt."""
    rng = random.Random(f"pdgate-sched-hot:{spec.seed}")
    system = "Hot. " + _text(rng, spec.system_tokens)
    return [
        Prompt(0, (("system", system), ("user", _text(rng, spec.question_tokens) + f" {i}?")))
        for i in range(count)
    ]


def best_hit_tokens(prompts: Sequence[Prompt], block_size: int = BLOCK_SIZE) -> tuple[int, int]:
    """(hit tokens, prompt tokens) if every prompt found every block an earlier one left.

    The best any placement can do: one cache that never evicts. Counted like the engine
    counts (whole blocks, the last prompt token always computed).
    """
    tokenizer = sim_tokenizer()
    space = KeySpace.of(keys="tokens", block_size=block_size)
    seen: set[int] = set()
    hits = total = 0
    for prompt in prompts:
        messages = [{"role": r, "content": c} for r, c in prompt.messages]
        ids = tokenizer.chat_ids({"messages": messages})
        hashes = space.chain(ids)
        matched = 0
        for block_hash in hashes:
            if block_hash not in seen:
                break
            matched += 1
        hits += min(matched, (len(ids) - 1) // block_size) * block_size
        total += len(ids)
        seen.update(hashes)
    return hits, total


# -- policies -------------------------------------------------------------------------------------

_GUARD_OFF: Final = {"guard": {"absolute": 0, "relative": 0}}


def _pd(prefill: Sequence[dict[str, Any]], decode: Sequence[dict[str, Any]] | None = None,
        picker: dict[str, Any] | None = None) -> dict[str, Any]:
    profiles: dict[str, Any] = {"prefill": {"scorers": list(prefill)}}
    if decode is not None:
        profiles["decode"] = {"scorers": list(decode)}
    if picker is not None:
        for body in profiles.values():
            body["picker"] = picker
    return profiles


#: name -> the `profiles` section of the scheduler YAML ({}: pdgate's defaults).
POLICIES: Final[dict[str, dict[str, Any]]] = {
    "random": _pd([{"type": "random"}], [{"type": "random"}], _GUARD_OFF),
    "round-robin": _pd([{"type": "round-robin"}], [{"type": "round-robin"}], _GUARD_OFF),
    "prefix-cache": {},
    # The default prefill profile (its load and cache-pressure scorers) with the precise
    # index in place of the approximate one, without and with the Mooncake Store credit.
    "precise-prefix-cache": _pd(default_prefill_with(
        {"type": "precise-prefix-cache", "weight": 1.0, "storeHitFactor": 0.0})),
    "mooncake-aware": _pd(default_prefill_with(
        {"type": "precise-prefix-cache", "weight": 1.0, "storeHitFactor": 0.7})),
}


def policy_document(
    name: str, profiles: dict[str, Any] | None = None, precise: bool | Literal["auto"] = True
) -> dict[str, Any]:
    """The whole scheduler YAML of a policy. `precise`: the precise index's `enabled`
    (on by default: a cluster whose router is switched between policies may run a precise
    one next; "auto": only when a profile uses it, pdgate's own default)."""
    return {
        "apiVersion": "pdgate.io/v1alpha1",
        "kind": "SchedulerConfig",
        "profiles": POLICIES[name] if profiles is None else profiles,
        "preciseIndex": {"enabled": precise},
        # Told what the pods' prefill costs (`prefill_flags`), as `make bench` tells its
        # routers: pdgate's default (0.1 ms a token) would price a cold prompt at half its
        # time on these pods against the wait behind a busy one.
        "costModel": {"prefillSecondsPerToken": PREFILL_MS_PER_TOKEN / 1e3},
        "reload": {"interval": "100ms"},
    }


# -- the cluster ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PodPlan:
    name: str
    ip: str
    role: str
    group: str

    @property
    def key(self) -> str:
        return f"default/{self.name}"


def _write_yaml(path: Path, docs: Sequence[Any]) -> None:
    """Atomically: the router's file readers never see half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(yaml.safe_dump_all(list(docs), sort_keys=False))
    tmp.replace(path)


def _manifests(
    port: int, pods: Sequence[PodPlan], annotations: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    labels = {"app": SERVER}
    docs: list[dict[str, Any]] = [
        {
            "apiVersion": API_VERSION, "kind": "ModelRoute",
            "metadata": {"name": f"{SERVER}-route", "namespace": "default"},
            "spec": {"modelName": MODEL,
                     "rules": [{"name": "default", "targetModels": [{"modelServerName": SERVER}]}]},
        },
        {
            "apiVersion": API_VERSION, "kind": "ModelServer",
            "metadata": {"name": SERVER, "namespace": "default", "annotations": {
                TOKENIZER_ANNOTATION: DEFAULT_TOKENIZER,
                CHAT_TEMPLATE_ANNOTATION: str(DEFAULT_CHAT_TEMPLATE),
                **(annotations or {}),
            }},
            "spec": {
                "inferenceEngine": "vLLM",
                "workloadPort": {"port": port, "protocol": "http"},
                "workloadSelector": {
                    "matchLabels": labels,
                    "pdGroup": {"groupKey": "group", "prefillLabels": {"role": "prefill"},
                                "decodeLabels": {"role": "decode"}},
                },
                "trafficPolicy": {"timeout": "60s",
                                  "retry": {"attempts": 2, "retryInterval": "50ms"}},
                "kvConnector": {"type": "nixl"},
            },
        },
    ]  # fmt: skip
    for pod in pods:
        docs.append({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod.name, "namespace": "default",
                         "labels": {**labels, "group": pod.group, "role": pod.role}},
            "status": {"phase": "Running", "podIP": pod.ip,
                       "conditions": [{"type": "Ready", "status": "True"}]},
        })  # fmt: skip
    return docs


@dataclass(slots=True)
class RequestResult:
    ttft: float | None
    status: int
    prefill: str | None
    decode: str | None
    error: str | None = None
    completed: bool = False  # the stream ended with `data: [DONE]` and carried no error


@dataclass(slots=True)
class RunResult:
    policy: str
    results: list[RequestResult]
    hit_tokens: int
    query_tokens: int
    best_hit_tokens: int
    best_query_tokens: int
    seconds: float
    per_prefill: Counter[str] = field(default_factory=Counter)
    store_hit_tokens: int = 0

    @property
    def store_hit_rate(self) -> float:
        """Prompt tokens read from the Mooncake Store (`--store-prefix-cache` engines)."""
        return self.store_hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def best_hit_rate(self) -> float:
        return self.best_hit_tokens / self.best_query_tokens if self.best_query_tokens else 0.0

    def ttfts(self) -> list[float]:
        return sorted(r.ttft for r in self.results if r.ttft is not None)

    def ttft_quantile(self, q: float) -> float:
        values = self.ttfts()
        if not values:
            return float("nan")
        return values[min(len(values) - 1, int(q * len(values)))]

    @property
    def errors(self) -> int:
        return sum(1 for r in self.results if r.status != 200 or r.ttft is None)


class PolicyCluster:
    """Mooncake master (or a given one), G PD groups of simulated pods, an in-process router."""

    #: The scheduler YAML's `preciseIndex.enabled` (see `policy_document`).
    precise: bool | Literal["auto"] = True

    def __init__(
        self,
        workdir: Path,
        *,
        groups: int = 3,
        subnet: str | None = None,
        prefill_flags: Sequence[str] = (),
        decode_flags: Sequence[str] = (),
        mooncake: tuple[str, str] | None = None,
        policy: str = "prefix-cache",
        data_parallel: int = 1,
    ) -> None:
        self.workdir = workdir
        self.config_dir = workdir / "config"
        self.scheduler_file = workdir / "scheduler.yaml"
        # Its own net (spread by pid, another salt than `SimCluster`'s): runs rarely meet.
        subnet = subnet or f"127.0.{loopback_net(salt=POLICY_NET_SALT)}"
        self.pods = [
            PodPlan(f"g{g}-{role}", f"{subnet}.{10 * g + 11 + r}", role, f"g{g}")
            for g in range(groups)
            for r, role in enumerate(("prefill", "decode"))
        ]
        self.prefill_flags = list(prefill_flags)
        self.decode_flags = list(decode_flags)
        #: Engine cores a pod (`--data-parallel-size`); the router is told of them while
        #: `rank_aware` (`set_rank_aware`), else it sees each pod as one engine.
        self.data_parallel = data_parallel
        self.rank_aware = data_parallel > 1
        self._mooncake = mooncake
        self._master: Any = None
        self._processes: dict[str, subprocess.Popen[bytes]] = {}
        self.port = 0
        self.router_port = 0
        self.policy = policy
        self.state: AppState | None = None
        self._server: uvicorn.Server | None = None
        self._serving: asyncio.Task[None] | None = None
        self.http: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    @property
    def prefill_pods(self) -> list[PodPlan]:
        return [p for p in self.pods if p.role == "prefill"]

    def pod_url(self, pod: PodPlan) -> str:
        return f"http://{pod.ip}:{self.port}"

    async def __aenter__(self) -> PolicyCluster:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        self.config_dir.mkdir(parents=True, exist_ok=True)
        if self._mooncake is None:
            from engine_sim.mooncake_master import MooncakeMaster

            self._master = MooncakeMaster(
                log_path=self.workdir / "mooncake-master.log",
                preexec_fn=owned_child(os.getpid()),
            )
            self._master.start()
            self._mooncake = (self._master.rpc_address, self._master.metadata_url)
        self.port = free_port([p.ip for p in self.pods])
        for pod in self.pods:
            self._spawn(pod)
        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=256, limit_per_host=128),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=60),
        )
        await asyncio.gather(*(self._wait_healthy(pod) for pod in self.pods))
        self._write_cluster()
        _write_yaml(self.scheduler_file, [policy_document(self.policy, precise=self.precise)])
        await self._start_router()

    def _spawn(self, pod: PodPlan) -> None:
        assert self._mooncake is not None
        rpc, metadata = self._mooncake
        flags = self.prefill_flags if pod.role == "prefill" else self.decode_flags
        argv = [
            sys.executable, "-m", "engine_sim", "--role", pod.role, "--host", pod.ip,
            "--port", str(self.port), "--model", MODEL, "--pod-name", pod.name,
            "--engine-id", pod.name, "--mooncake-master", rpc, "--metadata-server", metadata,
            # Explicit KV events ports: a pod that cannot publish fails instead of going quiet.
            "--kv-events-port", str(EVENTS_PORT), "--kv-events-replay-port", str(self.replay_port),
            "--data-parallel-size", str(self.data_parallel),
            "--python-hash-seed", POD_HASH_SEED, *flags,
        ]  # fmt: skip
        with (self.workdir / f"pod-{pod.name}.log").open("wb") as log:
            self._processes[pod.name] = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=dict(os.environ),
            )

    async def _wait_healthy(self, pod: PodPlan) -> None:
        assert self.http is not None
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            process = self._processes[pod.name]
            if process.poll() is not None:
                log = (self.workdir / f"pod-{pod.name}.log").read_text(errors="replace")
                raise RuntimeError(f"pod {pod.name} exited: {log[-2000:]}")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with self.http.get(f"{self.pod_url(pod)}/health") as response:
                    if response.status == 200:
                        return
            if time.monotonic() > deadline:
                raise RuntimeError(f"pod {pod.name} not healthy after {STARTUP_TIMEOUT_S} s")
            await asyncio.sleep(0.1)

    async def _start_router(self) -> None:
        from router.app import PDGateApp

        self.state = AppState(
            RouterConfig(config_dir=self.config_dir, scheduler_config=self.scheduler_file)
        )
        self.router_port = free_port()
        self._server = uvicorn.Server(uvicorn.Config(
            PDGateApp(self.state), host="127.0.0.1", port=self.router_port, lifespan="on",
            log_level="warning",
        ))  # fmt: skip
        self._serving = asyncio.create_task(self._server.serve())
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not (self._server.started and self.state.ready and self._view_complete()):
            if self._serving.done() or time.monotonic() > deadline:
                raise RuntimeError("the router did not become ready")
            await asyncio.sleep(0.05)

    @property
    def replay_port(self) -> int:
        """Past the events ports of every rank (rank r binds both + r)."""
        return EVENTS_PORT + max(1, self.data_parallel)

    def _write_cluster(self) -> None:
        annotations = {"pdgate.io/kv-events-replay-port": str(self.replay_port)}
        if self.rank_aware:
            annotations[DP_SIZE_ANNOTATION] = str(self.data_parallel)
        _write_yaml(self.config_dir / "cluster.yaml",
                    _manifests(self.port, self.pods, annotations))

    async def set_rank_aware(self, rank_aware: bool) -> None:
        """Tell the router of the pods' data-parallel ranks, or not (each pod one target,
        the rank left to the engine's own balancer), and wait until its view says so."""
        self.rank_aware = rank_aware
        self._write_cluster()
        assert self.state is not None
        deadline = time.monotonic() + 10
        while True:
            targets = self.state.view.snapshot.endpoints().values()
            if targets and all((t.dp_rank is not None) == rank_aware for t in targets):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the router did not take the data-parallel setting")
            await asyncio.sleep(0.02)

    def _view_complete(self) -> bool:
        assert self.state is not None
        servers = self.state.view.snapshot.servers.values()
        names = {p.pod_name for s in servers for g in s.groups for p in g.prefill + g.decode}
        return names == {p.name for p in self.pods}

    @property
    def runtime(self) -> SchedulerRuntime:
        assert self.state is not None
        return self.state.scheduler_runtime

    async def use(self, policy: str, profiles: dict[str, Any] | None = None) -> None:
        """Rewrite the scheduler file and wait until the router has reloaded it.

        `profiles` replaces the named policy's profiles (a variant for one test).
        """
        document = policy_document(policy, profiles, precise=self.precise)
        expected: SchedulerConfig = parse_scheduler_config(document)
        _write_yaml(self.scheduler_file, [document])
        deadline = time.monotonic() + 10
        while self.runtime.config != expected:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router did not reload the {policy} policy")
            await asyncio.sleep(0.02)
        self.policy = policy

    async def sim_json(self, pod: PodPlan, path: str = "/sim/stats") -> dict[str, Any]:
        assert self.http is not None
        async with self.http.get(f"{self.pod_url(pod)}{path}") as response:
            data: dict[str, Any] = await response.json(loads=orjson.loads)
            return data

    async def prefix_counters(self) -> tuple[int, int, int]:
        """(local hit tokens, query tokens, store hit tokens) over the prefill engines."""
        pods = await asyncio.gather(*(self.sim_json(p) for p in self.prefill_pods))
        stats = [rank for pod in pods for rank in pod.get("ranks", [pod])]  # each engine core
        return (sum(s["prefix_cache"]["hits"] for s in stats),
                sum(s["prefix_cache"]["queries"] for s in stats),
                sum((s.get("store_prefix_cache") or {}).get("hits", 0) for s in stats))  # fmt: skip

    async def run(
        self,
        prompts: Sequence[Prompt],
        *,
        salt: str,
        concurrency: int,
        output_tokens: int = 4,
        policy: str | None = None,
    ) -> RunResult:
        """Send `prompts` (closed loop, `concurrency` at a time); measure at both ends."""
        http = self.http
        assert http is not None
        hits0, queries0, store0 = await self.prefix_counters()
        started = time.perf_counter()
        results: list[RequestResult | None] = [None] * len(prompts)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(len(prompts)):
            queue.put_nowait(i)

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                body = prompts[i].body(MODEL, output_tokens, salt)
                results[i] = await stream_chat(http, self.url, body)

        await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
        seconds = time.perf_counter() - started
        hits1, queries1, store1 = await self.prefix_counters()
        best_hits, best_total = best_hit_tokens(prompts)
        done = [r for r in results if r is not None]
        return RunResult(
            policy or self.policy, done, hits1 - hits0, queries1 - queries0, best_hits,
            best_total, seconds, Counter(r.prefill for r in done if r.prefill), store1 - store0,
        )

    def inflight_total(self) -> int:
        assert self.state is not None
        return self.state.inflight.total()

    def kill(self, name: str) -> None:
        process = self._processes.get(name)
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    async def close(self) -> None:
        if self._server is not None and self._serving is not None:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._serving
        if self.http is not None:
            await self.http.close()
        for process in self._processes.values():
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        for process in self._processes.values():
            try:
                await asyncio.to_thread(process.wait, 15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._processes.clear()
        if self._master is not None:
            self._master.stop()
            self._master = None


async def stream_chat(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    *,
    cancel_after_first: bool = False,
) -> RequestResult:
    """POST one streaming chat request; TTFT = the first chunk carrying content."""
    started = time.perf_counter()
    ttft: float | None = None
    try:
        async with http.post(f"{url}{CHAT_PATH}", data=orjson.dumps(body),
                             headers={"content-type": "application/json"}) as response:
            prefill = response.headers.get("x-pdgate-prefill-pod")
            decode = response.headers.get("x-pdgate-decode-pod")
            if response.status != 200:
                await response.read()
                return RequestResult(None, response.status, prefill, decode)
            done = False
            error: str | None = None
            async for line in response.content:
                if ttft is None and line.startswith(b"data: {") and _has_content(line[6:]):
                    ttft = time.perf_counter() - started
                    if cancel_after_first:
                        response.close()  # the client goes away mid-stream
                        break
                elif line.startswith(b'data: {"error"'):
                    error = line[6:].decode(errors="replace").strip()  # a mid-stream error
                elif line.startswith(b"data: [DONE]"):
                    done = True
            return RequestResult(ttft, 200, prefill, decode, error, done and error is None)
    except (TimeoutError, aiohttp.ClientError) as exc:
        return RequestResult(ttft, 0, None, None, f"{type(exc).__name__}: {exc}")


def _has_content(data: bytes) -> bool:
    try:
        chunk = orjson.loads(data)
    except orjson.JSONDecodeError:
        return False
    for choice in chunk.get("choices") or ():
        if (choice.get("delta") or {}).get("content"):
            return True
    return False


# -- the command ----------------------------------------------------------------------------------

#: Engines for the figures: a small KV cache (256 blocks of 16 tokens: three and a half of
#: the ~1,100-token system prompts) so that spreading every group over every pod evicts, at
#: most 2 requests admitted at once (prefilled one after the other, `engine_sim.compute`: a
#: busy pod queues), and 0.2 ms a prompt token (a 1,100-token miss: ~0.23 s; a hit: ~15 ms).
KV_CAPACITY_BLOCKS: Final = 256
#: The pods' prefill cost a prompt token (`--prefill-per-token-ms`), told to pdgate's
#: cost model by `policy_document`.
PREFILL_MS_PER_TOKEN: Final = 0.2


def prefill_flags(capacity_blocks: int = KV_CAPACITY_BLOCKS) -> tuple[str, ...]:
    return ("--kv-capacity-blocks", str(capacity_blocks), "--max-num-seqs", "2",
            "--prefill-per-token-ms", str(PREFILL_MS_PER_TOKEN), "--itl-ms", "2")  # fmt: skip


DECODE_FLAGS: Final = ("--itl-ms", "2", "--prefill-per-token-ms", str(PREFILL_MS_PER_TOKEN))


def _table(runs: Sequence[RunResult]) -> str:
    lines = [
        "| policy | prefix hit rate (local) | + read from store | best possible "
        "| TTFT p50 (ms) | TTFT p90 (ms) | requests per prefill pod | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        spread = " / ".join(str(n) for _, n in sorted(run.per_prefill.items()))
        lines.append(
            f"| {run.policy} | {run.hit_rate:.1%} | {run.store_hit_rate:.1%} "
            f"| {run.best_hit_rate:.1%} | {1e3 * run.ttft_quantile(0.5):.0f} "
            f"| {1e3 * run.ttft_quantile(0.9):.0f} | {spread} | {run.errors} |"
        )
    return "\n".join(lines)


#: The engine setups every policy runs on: (title, extra prefill flags).
SETUPS: Final = (
    ("prefill engines compute every block their own cache lacks", ()),
    ("prefill engines also read prefix blocks from the Mooncake Store "
     "(--store-prefix-cache, KV moved at 70,272 B a token over 12.5 GB/s)",
     ("--store-prefix-cache",)),
)


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The shared-prefix workload's flags and the prefill engines' cache, as the benches on
    this cluster take them (`workload_prompts` reads them back)."""
    parser.add_argument("--prompts", type=int, default=8, help="system prompts")
    parser.add_argument("--questions", type=int, default=16, help="questions per system prompt")
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--kv-capacity-blocks", type=int, default=KV_CAPACITY_BLOCKS,
                        help="KV cache of each prefill engine, in blocks")
    parser.add_argument("--seed", type=int, default=0)


def workload_prompts(args: argparse.Namespace) -> list[Prompt]:
    """The prompts `add_workload_args`' flags describe."""
    return shared_prefix(SharedPrefix(groups=args.prompts, questions=args.questions,
                                      seed=args.seed, system_tokens=args.system_tokens))


async def bench(args: argparse.Namespace) -> list[tuple[str, list[RunResult]]]:
    prompts = workload_prompts(args)
    out: list[tuple[str, list[RunResult]]] = []
    for title, extra in SETUPS[: 1 if args.no_store else 2]:
        workdir = Path(tempfile.mkdtemp(prefix="pdgate-bench-policies-"))
        flags = (*prefill_flags(args.kv_capacity_blocks), *extra)
        runs: list[RunResult] = []
        print(f"{title}:", flush=True)
        async with PolicyCluster(workdir, groups=args.groups, prefill_flags=flags,
                                 decode_flags=DECODE_FLAGS) as cluster:
            # Warm-up (own salt): connections, tokenizer caches, the mean prefill estimate.
            await cluster.run(prompts[: 2 * args.groups], salt="warm-up", concurrency=2)
            for name in args.policies.split(","):
                await cluster.use(name)
                run = await cluster.run(prompts, salt=f"run-{name}",
                                        concurrency=args.concurrency, policy=name)
                runs.append(run)
                print(f"  {name}: {run.hit_rate:.1%} local + {run.store_hit_rate:.1%} store "
                      f"hits, TTFT p50 {1e3 * run.ttft_quantile(0.5):.0f} ms, "
                      f"{run.seconds:.1f} s", flush=True)
                if cluster.inflight_total():
                    raise RuntimeError(f"{name}: requests still counted in flight")
        out.append((title, runs))
    return out


def decision_table(requests: int, sizes: tuple[int, ...] = (8, 64, 512)) -> str:
    """Decision time per request (`benchmarks.decision`), as a Markdown table."""
    from benchmarks import decision

    times = decision.run(requests, sizes)
    lines = [
        "| pods | PD pair, default (us p50 / p90) | PD pair, precise (us p50 / p90) "
        "| aggregated, default (us p50 / p90) |",
        "| --- | --- | --- | --- |",
    ]
    for size in sizes:
        cells = [times[f"{size} pods, {case}"] for case in ("PD", "PD, precise", "aggregated")]
        lines.append(f"| {size} | " + " | ".join(f"{a:.0f} / {b:.0f}" for a, b in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=3, help="PD groups (1 prefill + 1 decode)")
    add_workload_args(parser)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--decision-requests", type=int, default=1000)
    parser.add_argument("--no-decision", action="store_true")
    parser.add_argument("--no-store", action="store_true", help="skip the store-reuse setup")
    args = parser.parse_args()
    results = asyncio.run(bench(args))
    print(f"\nShared prefix: {args.prompts} system prompts (~{args.system_tokens} tokens) x "
          f"{args.questions} questions, shuffled; {args.groups} PD groups; concurrency "
          f"{args.concurrency}; prefill engines {' '.join(prefill_flags(args.kv_capacity_blocks))}")
    for title, runs in results:
        print(f"\n{title[:1].upper()}{title[1:]}:\n")
        print(_table(runs))
    if not args.no_decision:
        print()
        print(decision_table(args.decision_requests))


if __name__ == "__main__":
    main()
