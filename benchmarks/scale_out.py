"""One router process vs `--workers 2` vs two peer replicas, same pods, same requests.

    .venv/bin/python -m benchmarks.scale_out [--rounds 2] [--no-fast]
                                             [--policy precise-prefix-cache]

The simulated PD cluster of `benchmarks.sched_policies` (prefill pods with a small KV
cache, so where a prompt goes decides whether it hits), and the router as real
`pdgate serve` processes in three setups: one process; `--workers 2` (SO_REUSEPORT);
two replicas peered over `--sync-port`, the client alternating between them request by
request (the hard case: consecutive rounds of one chat land on different replicas).
Every setup runs the `shared-prefix` and the `multi-round` workload, each request with a
cache salt of its own run, so no run finds KV an earlier one left. Setups are run in
`--rounds` rounds, the order rotated each round, and their figures pooled: on a shared
machine the load of the moment weighs on all three alike.

How each setup is measured, and why (each was a cause of the earlier figures):

- Warm before measuring. Every router process must be ready (each one answers its own
  `/readyz`, peers see each other live), have served warm-up requests (own salt) and
  have gone quiet (CPU below `SETTLED_CPU` of a core): a process loads its tokenizer
  in the background after it is ready (seconds of CPU holding the GIL on this machine),
  and counting that start-up made 2 processes look 5x costlier per request and put
  seconds into their TTFT p90.
- Keep-alive connections, as real clients use, spread evenly over the workers (the
  pool is reopened until each worker holds its share; `/readyz` names the worker that
  answers). A fresh connection per request charged the router one TCP accept per
  request, the same for every setup but not what a client does.
- CPU is the router processes' (psutil, each process tree: the supervisor and its
  workers) over the measured requests only.

Reported per setup and workload: prefix hit rate at the prefill engines, the best
possible, TTFT p50/p90, router CPU per request, errors, and the prompts computed on more
than one prefill pod (a shared-prefix system prompt, a multi-round chat: each such prompt
was computed again, a miss one process seldom has), with 2 replicas also how many of them
the two routers' first requests already sent to different pods (from the pods pdgate
names in its response headers); each multi-router run's line also gives the new prompts
the processes asked the leader to place, by outcome (`pdgate_sync_placements_total`: an
ask not answered in time is placed where it arrived). Then, unless `--no-fast`,
throughput with `--fast` pods and tiny prompts (the router is the bottleneck): requests
per second and CPU per request of each setup, and their ratio to one process. And the
same tiny requests open loop at `--fixed-rate` (a rate no setup is saturated at): CPU per
request there is what a request costs each setup at equal load, without the batching a
saturated loop gets (a router-bound run gives one process fuller loop turns than two);
two routers that share nothing show what running two processes costs by itself, and the
sync is the difference between them and `--workers 2` / 2 replicas. Wake-ups per request
there are the router processes' voluntary context switches (each time a thread slept
and something had to wake it: a loop turn, a ZMQ I/O thread's read): the part of a
request's CPU that more processes multiply.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import aiohttp
import orjson
import psutil
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.cluster import MODEL as FAST_MODEL
from benchmarks.cluster import ClusterShape, SimCluster
from benchmarks.sched_policies import (
    DECODE_FLAGS,
    MODEL,
    PolicyCluster,
    Prompt,
    RequestResult,
    SharedPrefix,
    best_hit_tokens,
    prefill_flags,
    shared_prefix,
    stream_chat,
)
from benchmarks.workloads import MultiRoundParams, multi_round
from engine_sim.ports import free_ports, wait_http

SETUPS: Final = ("one process", "--workers 2", "2 replicas")
#: The control of the router-bound part: two routers that share nothing (no sync).
UNSYNCED: Final = "2 routers, no sync"
FAST_SETUPS: Final = (*SETUPS, UNSYNCED)
#: A router setup is quiet when its processes use less than this share of a core.
SETTLED_CPU: Final = 0.05
#: Longest wait for a setup to go quiet after its warm-up (seconds).
SETTLE_TIMEOUT_S: Final = 30.0
#: Seconds of idle CPU measured after a router-bound run (its background work).
IDLE_SAMPLE_S: Final = 2.0
#: Times the connection pool is reopened to spread it evenly over the workers.
MAX_POOL_ATTEMPTS: Final = 50

#: A multi-round chat: a session is the list of its rounds, sent one after the other.
Session = list[Prompt]


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one request went: its prompt's group (a shared-prefix system prompt, a
    multi-round chat), the router URL it was sent to (index), the prefill pod that
    computed it (None: failed)."""

    group: int
    router: int
    prefill: str | None


@dataclass(frozen=True, slots=True)
class Splits:
    """Prompts whose requests were computed on more than one prefill pod."""

    prompts: int
    split: int
    #: Of those, the ones whose first request through each router went to different
    #: pods (the routers disagreed from the start, rather than one moving it later);
    #: None with one router URL (the workers of one port cannot be told apart).
    apart: int | None

    def __add__(self, other: Splits) -> Splits:
        apart = (None if self.apart is None or other.apart is None
                 else self.apart + other.apart)
        return Splits(self.prompts + other.prompts, self.split + other.split, apart)


def split_prompts(placements: Sequence[Placement], routers: int) -> Splits:
    """Count the prompts computed on more than one prefill pod (each such prompt was
    computed twice: a miss one process, which sees every pick, would not have had)."""
    pods: dict[int, set[str]] = {}
    first: dict[int, dict[int, str]] = {}
    for p in placements:
        if p.prefill is None:
            continue
        pods.setdefault(p.group, set()).add(p.prefill)
        first.setdefault(p.group, {}).setdefault(p.router, p.prefill)
    split = [g for g, held in pods.items() if len(held) > 1]
    apart = sum(1 for g in split if len(set(first[g].values())) > 1)
    return Splits(len(pods), len(split), apart if routers > 1 else None)


class _PodsOnly(PolicyCluster):
    """The pods and their config, no in-process router. The routers' policy is fixed per
    run, so their precise index is pdgate's default ("auto": off for `prefix-cache`);
    always on, every process applied every KV event to an index no scorer read, which
    `--workers 2` and two replicas paid twice."""

    precise = "auto"

    async def _start_router(self) -> None:
        return None


def _tree_sum(
    processes: Sequence[psutil.Process], measure: Callable[[psutil.Process], float]
) -> float:
    """`measure` summed over the router processes, each one and its children (the
    workers); a process tree that went away counts what was read of it."""
    total = 0.0
    for process in processes:
        with contextlib.suppress(psutil.Error):
            for p in [process, *process.children(recursive=True)]:
                total += measure(p)
    return total


def _cpu_s(p: psutil.Process) -> float:
    times = p.cpu_times()
    return float(times.user + times.system)


def _cpu(processes: Sequence[psutil.Process]) -> float:
    """CPU seconds of the router processes and their children."""
    return _tree_sum(processes, _cpu_s)


def _wakeups(processes: Sequence[psutil.Process]) -> int:
    """Voluntary context switches of the router processes and their children: how often
    their threads went to sleep, so how often something had to wake them."""
    return int(_tree_sum(processes, lambda p: p.num_ctx_switches().voluntary))


@dataclass(slots=True)
class Routers:
    """One setup's router processes, the URLs a client uses, one keep-alive pool per URL."""

    setup: str
    urls: list[str]
    procs: list[psutil.Popen]
    processes: int
    pools: list[aiohttp.ClientSession] = field(default_factory=list)

    def cpu(self) -> float:
        return _cpu(self.procs)

    def wakeups(self) -> int:
        return _wakeups(self.procs)


async def start_routers(
    config: list[str], setup: str, workdir: Path
) -> Routers:
    """`config`: the `--config` (and `--scheduler-config`) flags of every process."""
    base = [sys.executable, "-m", "router", "serve", *config, "--host", "127.0.0.1",
            "--log-level", "warning"]  # fmt: skip
    drawn = free_ports(4)  # together, so no HTTP port is also a sync port
    ports, syncs = drawn[:2], drawn[2:]
    if setup == "one process":
        argvs = [[*base, "--port", str(ports[0])]]
    elif setup == "--workers 2":
        argvs = [[*base, "--port", str(ports[0]), "--workers", "2"]]
    elif setup == UNSYNCED:
        argvs = [[*base, "--port", str(ports[i])] for i in range(2)]
    else:
        argvs = [[*base, "--port", str(ports[i]), "--sync-port", str(syncs[i]),
                  "--peers", f"127.0.0.1:{syncs[1 - i]}"] for i in range(2)]
    procs = []
    for i, argv in enumerate(argvs):
        log = (workdir / f"router-{setup.replace(' ', '_')}-{i}.log").open("ab")
        procs.append(psutil.Popen(argv, stdout=log, stderr=log))
    urls = [f"http://127.0.0.1:{ports[i]}" for i in range(len(argvs))]
    routers = Routers(setup, urls, procs, 1 if setup == "one process" else 2)
    for url in urls:
        await asyncio.to_thread(wait_http, f"{url}/readyz")
    return routers


async def stop_routers(routers: Routers) -> None:
    for pool in routers.pools:
        await pool.close()
    for p in routers.procs:
        p.terminate()
    for p in routers.procs:
        with contextlib.suppress(psutil.TimeoutExpired):
            await asyncio.to_thread(p.wait, 20)


async def _origin(http: aiohttp.ClientSession, url: str) -> str:
    """Which router process answers on this connection (`/readyz` names it)."""
    async with http.get(f"{url}/readyz") as response:
        body = await response.json(loads=orjson.loads)
        if response.status != 200:
            return ""
        return str(body.get("origin") or url)


async def open_pools(routers: Routers, connections: int) -> None:
    """Keep-alive pools of `connections` per URL, spread evenly over the processes behind it.

    Each pool is opened with `connections` concurrent `/readyz` requests (one connection
    each); when the processes behind a URL (the workers) do not hold an even share of
    them, or one is not ready, the pool is closed and opened again.
    """
    per_url = routers.processes // len(routers.urls)
    for url in routers.urls:
        for _ in range(MAX_POOL_ATTEMPTS):
            pool = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=connections, keepalive_timeout=60),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=60),
            )
            origins = Counter(await asyncio.gather(
                *(_origin(pool, url) for _ in range(connections))
            ))
            if "" not in origins and len(origins) == per_url and (
                max(origins.values()) - min(origins.values()) <= 1
            ):
                routers.pools.append(pool)
                break
            await pool.close()
            await asyncio.sleep(0.2)
        else:
            raise RuntimeError(f"{routers.setup}: cannot spread {connections} connections "
                               f"over {per_url} ready processes at {url}")


async def wait_peers(routers: Routers) -> None:
    """Until every process has heard all the others (`pdgate_peers{state="live"}`)."""
    if routers.processes == 1 or routers.setup == UNSYNCED:
        return
    deadline = time.monotonic() + 30
    while True:
        lives = []
        for url, pool in zip(routers.urls, routers.pools, strict=True):
            async with pool.get(f"{url}/metrics") as response:
                text = await response.text()
            lives += [float(line.rpartition(" ")[2]) for line in text.splitlines()
                      if line.startswith('pdgate_peers{') and 'state="live"' in line]
        if lives and all(n >= routers.processes - 1 for n in lives):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{routers.setup}: peers not live: {lives}")
        await asyncio.sleep(0.2)


def placed_text(placed: Counter[str]) -> str:
    """The placements of a run for its line, e.g. "[placed 4 answered, 1 timeout] "
    (nothing for a setup whose processes asked none)."""
    asked = {k: v for k, v in sorted(placed.items()) if k != "served" and v}
    if not asked:
        return ""
    return "[placed " + ", ".join(f"{v} {k}" for k, v in asked.items()) + "] "


def placement_counts(exposition: str) -> Counter[str]:
    """`pdgate_sync_placements_total` summed by outcome over the samples of one `/metrics`
    exposition (with `--workers N`, every worker's): new prompts the leader placed for
    another process ("served"), and at the asker "answered", "none" or "timeout" (placed
    where it arrived)."""
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(exposition):
        if family.name == "pdgate_sync_placements":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    counts[sample.labels["outcome"]] += int(sample.value)
    return counts


async def placements(routers: Routers) -> Counter[str]:
    """`placement_counts` summed over the setup's URLs (none for one process)."""
    total: Counter[str] = Counter()
    for url, pool in zip(routers.urls, routers.pools, strict=True):
        async with pool.get(f"{url}/metrics") as response:
            total += placement_counts(await response.text())
    return total


async def settle(routers: Routers) -> float:
    """Wait until the routers go quiet; the seconds it took."""
    started = time.monotonic()
    while time.monotonic() - started < SETTLE_TIMEOUT_S:
        if await idle_cpu(routers, 0.5) < SETTLED_CPU:
            break
    return time.monotonic() - started


async def idle_cpu(routers: Routers, seconds: float) -> float:
    """The routers' CPU (in cores) over `seconds` without traffic: their background work
    (heartbeats, engine scrapes, the sync's own traffic)."""
    cpu0 = routers.cpu()
    await asyncio.sleep(seconds)
    return (routers.cpu() - cpu0) / seconds


@dataclass(slots=True)
class Run:
    """One workload through one setup (or several pooled)."""

    setup: str
    workload: str
    results: list[RequestResult] = field(default_factory=list)
    hit_tokens: int = 0
    query_tokens: int = 0
    best_hit_tokens: int = 0
    best_query_tokens: int = 0
    cpu_s: float = 0.0
    seconds: float = 0.0
    #: Router CPU seconds the same processes spend in as long without traffic.
    idle_cpu_s: float = 0.0
    splits: Splits = Splits(0, 0, 0)
    #: Voluntary context switches of the router processes (the fixed-rate part).
    wakeups: int = 0
    #: New-prompt placements by outcome (`placement_counts`) during the run.
    placed: Counter[str] = field(default_factory=Counter)

    def add(self, other: Run) -> None:
        self.splits += other.splits
        self.placed += other.placed
        self.wakeups += other.wakeups
        self.idle_cpu_s += other.idle_cpu_s
        self.results += other.results
        self.hit_tokens += other.hit_tokens
        self.query_tokens += other.query_tokens
        self.best_hit_tokens += other.best_hit_tokens
        self.best_query_tokens += other.best_query_tokens
        self.cpu_s += other.cpu_s
        self.seconds += other.seconds

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def best_hit_rate(self) -> float:
        return self.best_hit_tokens / self.best_query_tokens if self.best_query_tokens else 0.0

    def ttft(self, q: float) -> float:
        values = sorted(r.ttft for r in self.results if r.ttft is not None)
        if not values:
            return float("nan")
        return values[min(len(values) - 1, int(q * len(values)))]

    @property
    def errors(self) -> int:
        return sum(1 for r in self.results if r.status != 200 or r.ttft is None)

    @property
    def cpu_per_request(self) -> float:
        return self.cpu_s / max(1, len(self.results))

    @property
    def busy_cpu_per_request(self) -> float:
        """CPU per request net of what the processes spend anyway (`idle_cpu`)."""
        return max(0.0, self.cpu_s - self.idle_cpu_s) / max(1, len(self.results))

    @property
    def requests_per_s(self) -> float:
        return len(self.results) / self.seconds if self.seconds else 0.0


async def send(
    routers: Routers, sessions: Sequence[Session], salt: str, concurrency: int,
    max_tokens: int = 4, model: str = MODEL, placements: list[Placement] | None = None,
) -> tuple[list[RequestResult], float, float]:
    """`sessions` (closed loop, `concurrency` sessions at a time; a session's rounds in
    order); request n goes to URL n mod the URLs. (results, seconds, router CPU seconds);
    each request's `Placement` is appended to `placements` when given."""
    results: list[RequestResult] = []
    todo = list(reversed(sessions))
    sent = 0

    async def client() -> None:
        nonlocal sent
        while todo:
            session = todo.pop()
            for prompt in session:
                n, sent = sent, sent + 1
                router = n % len(routers.urls)
                pool = routers.pools[n % len(routers.pools)]
                result = await stream_chat(pool, routers.urls[router],
                                           prompt.body(model, max_tokens, salt))
                results.append(result)
                if placements is not None:
                    placements.append(Placement(prompt.group, router, result.prefill))

    cpu0 = routers.cpu()
    client0 = time.process_time()
    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    seconds = time.perf_counter() - started
    if sent:
        print(f"    (client CPU {1e3 * (time.process_time() - client0) / sent:.2f} ms/request, "
              f"{100 * (time.process_time() - client0) / seconds:.0f}% of a core)", flush=True)
    return results, seconds, routers.cpu() - cpu0


async def send_at_rate(
    routers: Routers, sessions: Sequence[Session], salt: str, rate: float, model: str
) -> tuple[list[RequestResult], float, float]:
    """The first request of each session, open loop at `rate` a second (request n at
    n / rate s, to URL n mod the URLs). (results, seconds, router CPU seconds)."""
    cpu0 = routers.cpu()
    started = time.perf_counter()
    tasks: list[asyncio.Task[RequestResult]] = []
    for n, session in enumerate(sessions):
        delay = started + n / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        pool, url = routers.pools[n % len(routers.pools)], routers.urls[n % len(routers.urls)]
        body = session[0].body(model, 4, salt)
        tasks.append(asyncio.create_task(stream_chat(pool, url, body)))
    results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - started, routers.cpu() - cpu0


async def measure(
    cluster: PolicyCluster, routers: Routers, workload: str, sessions: Sequence[Session],
    salt: str, concurrency: int,
) -> Run:
    hits0, queries0, _ = await cluster.prefix_counters()
    placed0 = await placements(routers)
    where: list[Placement] = []
    results, seconds, cpu = await send(routers, sessions, salt, concurrency, placements=where)
    hits1, queries1, _ = await cluster.prefix_counters()
    placed = await placements(routers)
    placed.subtract(placed0)
    best_hits, best_total = best_hit_tokens([p for s in sessions for p in s])
    return Run(routers.setup, workload, results, hits1 - hits0, queries1 - queries0,
               best_hits, best_total, cpu, seconds,
               splits=split_prompts(where, len(routers.urls)), placed=+placed)


def workloads(args: argparse.Namespace) -> dict[str, list[Session]]:
    """shared-prefix: one-request sessions; multi-round: chats of `--rounds-per-user`."""
    shared = shared_prefix(SharedPrefix(groups=args.prompts, questions=args.questions,
                                        seed=args.seed))
    chats = multi_round(
        MultiRoundParams(users=args.users, rounds=args.chat_rounds,
                         system_tokens=args.chat_system_tokens, question_tokens=32,
                         answer_tokens=32),
        MODEL, args.seed,
    )
    sessions = []
    for user, turns in enumerate(chats.sessions):
        rounds = []
        for spec in turns:
            messages = orjson.loads(spec.body)["messages"]
            rounds.append(Prompt(user, tuple((m["role"], m["content"]) for m in messages)))
        sessions.append(rounds)
    return {"shared-prefix": [[p] for p in shared], "multi-round": sessions}


async def warm(
    routers: Routers, sessions: Sequence[Session], salt: str, model: str = MODEL
) -> float:
    """Warm-up requests through every connection of every pool, then quiet; seconds."""
    connections = sum(p.connector.limit if p.connector else 0 for p in routers.pools)
    warmup = [s[:1] for s in sessions][: 2 * connections]
    await send(routers, warmup, salt, len(warmup), model=model)
    await wait_peers(routers)
    return await settle(routers)


async def bench_workloads(args: argparse.Namespace, workdir: Path) -> dict[tuple[str, str], Run]:
    loads = workloads(args)
    pooled: dict[tuple[str, str], Run] = {}
    async with _PodsOnly(workdir, groups=args.groups, prefill_flags=prefill_flags(),
                         decode_flags=DECODE_FLAGS, policy=args.policy) as cluster:
        config = ["--config", str(cluster.config_dir),
                  "--scheduler-config", str(cluster.scheduler_file)]
        for round_index in range(args.rounds):
            order = SETUPS[round_index % 3:] + SETUPS[: round_index % 3]
            for setup in order:
                routers = await start_routers(config, setup, workdir)
                try:
                    await open_pools(routers, args.concurrency)
                    quiet = await warm(routers, loads["shared-prefix"], f"warm-{round_index}")
                    for name, sessions in loads.items():
                        run = await measure(cluster, routers, name, sessions,
                                            f"r{round_index}-{setup}-{name}", args.concurrency)
                        pooled.setdefault((setup, name), Run(setup, name)).add(run)
                        print(f"  round {round_index + 1} {setup} {name}: hit "
                              f"{run.hit_rate:.1%}, TTFT p50/p90 {1e3 * run.ttft(0.5):.0f}/"
                              f"{1e3 * run.ttft(0.9):.0f} ms, CPU "
                              f"{1e3 * run.cpu_per_request:.2f} ms/request, {run.errors} errors, "
                              f"{split_text(run.splits)} prompts on 2+ pods "
                              f"{placed_text(run.placed)}(quiet after {quiet:.1f} s)",
                              flush=True)
                        await settle(routers)
                finally:
                    await stop_routers(routers)
    return pooled


def tiny_prompts(count: int) -> list[Session]:
    return [[Prompt(0, (("user", f"ping {i}"),))] for i in range(count)]


async def bench_fast(
    args: argparse.Namespace, workdir: Path
) -> tuple[dict[str, Run], dict[str, Run]]:
    """Router-bound: `--fast` aggregated pods (the main bench's overhead phase: the PD
    simulator's KV transfer, not the router, bounds a PD cluster here), tiny prompts;
    then the same open loop at `--fixed-rate`. (router-bound, fixed-rate) runs."""
    pooled: dict[str, Run] = {}
    fixed: dict[str, Run] = {}
    cluster = SimCluster(ClusterShape("agg", args.fast_pods, fast=True), workdir / "fast")
    await asyncio.to_thread(cluster.start)
    try:
        config = ["--config", str(cluster.pdgate_config(workdir / "fast" / "config"))]
        for round_index in range(args.rounds):
            shift = round_index % len(FAST_SETUPS)
            for setup in FAST_SETUPS[shift:] + FAST_SETUPS[:shift]:
                routers = await start_routers(config, setup, workdir)
                try:
                    await open_pools(routers, args.fast_concurrency)
                    await warm(routers, tiny_prompts(64), "warm", FAST_MODEL)
                    results, seconds, cpu = await send(
                        routers, tiny_prompts(args.fast_requests), f"fast-{round_index}",
                        args.fast_concurrency, model=FAST_MODEL,
                    )
                    idle = await idle_cpu(routers, IDLE_SAMPLE_S)
                    run = Run(setup, "fast", results, cpu_s=cpu, seconds=seconds,
                              idle_cpu_s=idle * seconds)
                    pooled.setdefault(setup, Run(setup, "fast")).add(run)
                    print(f"  round {round_index + 1} {setup} fast: {run.requests_per_s:.0f} "
                          f"req/s, CPU {1e3 * run.cpu_per_request:.2f} ms/request, "
                          f"{run.errors} errors", flush=True)
                    if args.fixed_requests > 0:
                        await settle(routers)
                        wakeups = routers.wakeups()
                        results, seconds, cpu = await send_at_rate(
                            routers, tiny_prompts(args.fixed_requests),
                            f"fixed-{round_index}", args.fixed_rate, FAST_MODEL,
                        )
                        run = Run(setup, "fixed", results, cpu_s=cpu, seconds=seconds,
                                  idle_cpu_s=idle * seconds,
                                  wakeups=routers.wakeups() - wakeups)
                        fixed.setdefault(setup, Run(setup, "fixed")).add(run)
                        print(f"  round {round_index + 1} {setup} at {args.fixed_rate:g} "
                              f"req/s: CPU {1e3 * run.cpu_per_request:.2f} ms/request, "
                              f"{run.errors} errors", flush=True)
                finally:
                    await stop_routers(routers)
    finally:
        await asyncio.to_thread(cluster.stop)
    return pooled, fixed


def split_text(splits: Splits) -> str:
    """Like "2 of 24"; with how many two routers placed apart from the start, "2 of 24 (1
    apart)"."""
    text = f"{splits.split} of {splits.prompts}"
    return text if not splits.split or splits.apart is None else f"{text} ({splits.apart} apart)"


def workload_table(pooled: dict[tuple[str, str], Run]) -> str:
    lines = ["| workload | setup | prefix hit rate | best possible | TTFT p50 (ms) "
             "| TTFT p90 (ms) | p90 vs one process | router CPU ms / request | errors "
             "| prompts on 2+ pods |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in ("shared-prefix", "multi-round"):
        base = pooled.get(("one process", name))
        for setup in SETUPS:
            run = pooled.get((setup, name))
            if run is None:
                continue
            ratio = run.ttft(0.9) / base.ttft(0.9) if base is not None else float("nan")
            lines.append(
                f"| {name} | {setup} | {run.hit_rate:.1%} | {run.best_hit_rate:.1%} "
                f"| {1e3 * run.ttft(0.5):.0f} | {1e3 * run.ttft(0.9):.0f} | {ratio:.2f}x "
                f"| {1e3 * run.cpu_per_request:.2f} | {run.errors} | {split_text(run.splits)} |"
            )
    return "\n".join(lines)


def _against_one(pooled: dict[str, Run]) -> Iterator[tuple[Run, float, float, float]]:
    """Each setup's run, with its requests/s, CPU per request and the same net of idle as
    ratios to one process's (NaN without one)."""
    base = pooled.get("one process")
    nan = float("nan")
    for setup in FAST_SETUPS:
        run = pooled.get(setup)
        if run is None:
            continue
        if base is None:
            yield run, nan, nan, nan
            continue
        yield (run, run.requests_per_s / base.requests_per_s,
               run.cpu_per_request / base.cpu_per_request,
               run.busy_cpu_per_request / base.busy_cpu_per_request)


def fixed_table(pooled: dict[str, Run]) -> str:
    """CPU per request at the same offered load (`--fixed-rate`), against one process."""
    lines = ["| setup (`--fast` pods) | achieved requests / s | router CPU ms / request "
             "| vs one process | net of idle CPU ms / request | vs one process "
             "| wake-ups / request | TTFT p50 (ms) | errors |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run, _, cpu, busy in _against_one(pooled):
        wakeups = run.wakeups / len(run.results) if run.results else 0.0
        lines.append(f"| {run.setup} | {run.requests_per_s:.0f} "
                     f"| {1e3 * run.cpu_per_request:.2f} | {cpu:.2f}x "
                     f"| {1e3 * run.busy_cpu_per_request:.2f} | {busy:.2f}x | {wakeups:.2f} "
                     f"| {1e3 * run.ttft(0.5):.1f} | {run.errors} |")
    return "\n".join(lines)


def fast_table(pooled: dict[str, Run]) -> str:
    lines = ["| setup (`--fast` pods) | requests / s | vs one process "
             "| router CPU ms / request | vs one process | net of idle CPU ms / request "
             "| vs one process | idle CPU (% of a core) | errors |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run, tput, cpu, busy in _against_one(pooled):
        idle = 100 * run.idle_cpu_s / run.seconds if run.seconds else 0.0
        lines.append(f"| {run.setup} | {run.requests_per_s:.0f} | {tput:.2f}x "
                     f"| {1e3 * run.cpu_per_request:.2f} | {cpu:.2f}x "
                     f"| {1e3 * run.busy_cpu_per_request:.2f} | {busy:.2f}x | {idle:.1f}% "
                     f"| {run.errors} |")
    return "\n".join(lines)


async def bench(args: argparse.Namespace) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="pdgate-bench-scale-"))
    print(f"{args.rounds} rounds; load average {psutil.getloadavg()[0]:.1f} on "
          f"{psutil.cpu_count()} CPUs; logs in {workdir}", flush=True)
    pooled = {} if args.no_workloads else await bench_workloads(args, workdir)
    fast, fixed = (None, None) if args.no_fast else await bench_fast(args, workdir)
    print(f"\nshared-prefix: {args.prompts} system prompts x {args.questions} questions; "
          f"multi-round: {args.users} users x {args.chat_rounds} rounds "
          f"(system ~{args.chat_system_tokens} tokens); {args.groups} PD groups; "
          f"{args.concurrency} keep-alive connections; {args.rounds} rounds pooled; "
          f"policy {args.policy}; load average {psutil.getloadavg()[0]:.1f}\n")
    if pooled:
        print(workload_table(pooled))
    if fast is not None:
        print(f"\n{args.fast_requests} tiny streams x {args.rounds} rounds, "
              f"{args.fast_concurrency} keep-alive connections, {args.fast_pods} aggregated "
              "--fast pods:\n")
        print(fast_table(fast))
    if fixed:
        print(f"\nThe same tiny streams open loop at {args.fixed_rate:g} requests/s "
              f"({args.fixed_requests} x {args.rounds} rounds; no setup is saturated):\n")
        print(fixed_table(fixed))


def main() -> None:
    parser = argparse.ArgumentParser(prog="benchmarks.scale_out", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--groups", type=int, default=3, help="PD groups")
    parser.add_argument("--prompts", type=int, default=8, help="shared-prefix system prompts")
    parser.add_argument("--questions", type=int, default=12, help="questions per prompt")
    parser.add_argument("--users", type=int, default=9, help="multi-round chats")
    parser.add_argument("--chat-rounds", type=int, default=5, help="rounds per chat")
    parser.add_argument("--chat-system-tokens", type=int, default=768)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--policy", default="prefix-cache",
                        choices=("prefix-cache", "precise-prefix-cache"),
                        help="the routers' scheduling policy (benchmarks.sched_policies): "
                             "the default profile, or its precise index in place of the "
                             "approximate one (KV events from every pod)")
    parser.add_argument("--fast-requests", type=int, default=1500)
    parser.add_argument("--fast-concurrency", type=int, default=32)
    parser.add_argument("--fast-pods", type=int, default=2, help="aggregated --fast pods")
    parser.add_argument("--fixed-rate", type=float, default=300.0,
                        help="requests/s of the open-loop part (below every setup's maximum)")
    parser.add_argument("--fixed-requests", type=int, default=1500,
                        help="requests of the open-loop part per setup and round (0: skip)")
    parser.add_argument("--no-fast", action="store_true", help="skip the router-bound part")
    parser.add_argument("--no-workloads", action="store_true",
                        help="only the router-bound part")
    parser.add_argument("--seed", type=int, default=0)
    asyncio.run(bench(parser.parse_args()))


if __name__ == "__main__":
    main()
