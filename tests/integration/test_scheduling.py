"""Scheduling on simulated PD pods with the latency model on: cache locality against load.

Three PD groups (prefill + decode each) of `engine_sim` pods sharing a real Mooncake
Store (a master of this module's own: the last test kills pods, which a shared store would
feel); prefill pods have a small KV cache (256 blocks, three and a half of the
~1,100-token system prompts), run at most two prefills at once and spend 0.2 ms per
uncached prompt token.
The router runs in-process (uvicorn in the test loop) so a test can read its scheduler
state; policies are switched by rewriting the --scheduler-config file (hot reload). The
workload, the policies and the cluster are `benchmarks.sched_policies`'s, so these
tests and the figures measure the same thing. Each run sends its own `cache_salt`: the
same token sequence, no KV left over from an earlier run.

The tests run in file order and share the pods; the last one kills pods.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

import pytest

from benchmarks.sched_policies import (
    DECODE_FLAGS,
    MODEL,
    PodPlan,
    PolicyCluster,
    SharedPrefix,
    hot_prefix,
    prefill_flags,
    shared_prefix,
    stream_chat,
)
from engine_sim.kvstore import mooncake_import_error
from router.scheduling.kv_events import PodEventStream, scope_of
from tests.integration.harness import loopback_net, metric_values
from tests.polling import eventually as _eventually

pytestmark = pytest.mark.integration
#: KV-event streams and router counters settle within seconds here: wait up to 10 s.
eventually = functools.partial(_eventually, within=10.0)

#: 8 system prompts x 12 questions: 96 requests; the prompts fill two prefill caches.
WORKLOAD = SharedPrefix(groups=8, questions=12, system_tokens=1024, seed=4)


@pytest.fixture(scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[PolicyCluster]:
    reason = mooncake_import_error()
    if reason is not None:
        pytest.skip(f"Mooncake store unavailable: {reason}")
    async with PolicyCluster(
        tmp_path_factory.mktemp("scheduling"), groups=3, subnet=loopback_net(),
        prefill_flags=prefill_flags(), decode_flags=DECODE_FLAGS,
    ) as made:
        # Warm connections, caches and the running mean of prefill time (own salt).
        await made.run(shared_prefix(WORKLOAD)[:8], salt="warm-up", concurrency=2)
        yield made


def _caught_up(stream: PodEventStream, seq: int) -> bool:
    return stream.last_seq is not None and stream.last_seq >= seq


async def test_shared_prefix_prefix_cache_beats_random_and_round_robin(
    cluster: PolicyCluster,
) -> None:
    prompts = shared_prefix(WORKLOAD)
    runs = {}
    for policy in ("random", "round-robin", "prefix-cache"):
        await cluster.use(policy)
        runs[policy] = await cluster.run(prompts, salt=f"a-{policy}", concurrency=6)
        assert runs[policy].errors == 0
    for name, run in runs.items():
        print(f"{name}: hit rate {run.hit_rate:.1%} (best {run.best_hit_rate:.1%}), TTFT p50 "
              f"{1e3 * run.ttft_quantile(0.5):.0f} ms p90 {1e3 * run.ttft_quantile(0.9):.0f} ms,"
              f" per prefill pod {dict(run.per_prefill)}")
    prefix = runs["prefix-cache"]
    # Close to the best possible: every group's first request misses, a few spill for load.
    assert prefix.hit_rate >= 0.85 * prefix.best_hit_rate
    for baseline in ("random", "round-robin"):
        other = runs[baseline]
        assert prefix.hit_rate >= other.hit_rate + 0.2, baseline
        assert prefix.ttft_quantile(0.5) < 0.6 * other.ttft_quantile(0.5), baseline
        assert sum(prefix.ttfts()) < 0.7 * sum(other.ttfts()), baseline  # the mean
    assert min(prefix.per_prefill.values()) >= len(prompts) // 6  # no pod left idle
    assert cluster.inflight_total() == 0


async def test_hot_prefix_spreads_over_pods_instead_of_queueing_on_one(
    cluster: PolicyCluster,
) -> None:
    await cluster.use("prefix-cache")
    prompts = hot_prefix(48, WORKLOAD)
    run = await cluster.run(prompts, salt="b-hot", concurrency=12)
    assert run.errors == 0
    shares = {pod.name: run.per_prefill.get(pod.name, 0) for pod in cluster.prefill_pods}
    print(f"hot prefix: per prefill pod {shares}, hit rate {run.hit_rate:.1%}, TTFT p90 "
          f"{1e3 * run.ttft_quantile(0.9):.0f} ms")
    # Spread, not piled up: at least two pods each took a sixth or more (fair: 16 each),
    # and none took more than 60%. Not "every pod": when two pods holding the prefix keep
    # the queue short, a cold prefill on the third costs more than it saves (TTFT-costed
    # picks; a fresh clone once saw 23 / 0 / 25 after the previous test's calibration).
    assert sum(1 for n in shares.values() if n >= len(prompts) // 6) >= 2, shares
    assert max(shares.values()) <= 0.6 * len(prompts), shares
    # Spreading costs one miss per pod, not one per request.
    assert run.hit_rate >= run.best_hit_rate - 0.06


async def test_precise_index_matches_the_engines_caches_after_evictions(
    cluster: PolicyCluster,
) -> None:
    await cluster.use("precise-prefix-cache")
    run = await cluster.run(shared_prefix(WORKLOAD), salt="d-precise", concurrency=6)
    assert run.errors == 0
    runtime = cluster.runtime
    for pod in cluster.prefill_pods:
        cache = await cluster.sim_json(pod, "/sim/cache")
        stats = await cluster.sim_json(pod)
        # The cache is full: the run stored more blocks than it holds, so it evicted.
        assert stats["kv_cache"]["cached_blocks"] >= cache["capacity_blocks"] - 8
        last_seq = cache["kv_events"]["last_seq"]
        stream = runtime.kv_events.stream(pod.key)
        assert stream is not None
        await eventually(functools.partial(_caught_up, stream, last_seq))
        held = runtime.precise.blocks_of(pod.key)
        engine = set(cache["block_hashes"])
        assert held == engine, (pod.name, len(held - engine), len(engine - held))
    assert runtime.precise.overflow_evictions == 0
    # Every block a prefill pod wrote to the store is in the server's shared pool.
    assert cluster.state is not None
    server = next(iter(cluster.state.view.snapshot.servers.values()))
    assert len(runtime.precise.store_blocks(scope_of(server))) >= 8 * 64
    assert run.hit_rate >= 0.85 * run.best_hit_rate


async def test_precise_hits_equal_the_engines_own_prefix_cache_hits(
    cluster: PolicyCluster,
) -> None:
    """Before each request, the router's precise index predicts every prefill pod's prefix
    hit; the pod it picks then reports exactly that hit for the request. The pods run with
    a PYTHONHASHSEED the router is not told, so the index keys blocks by their token ids
    (`router.kvhash.keyspace`), as it must in front of vLLM's default random roots."""
    await cluster.use("precise-prefix-cache")
    runtime = cluster.runtime
    assert cluster.state is not None and cluster.http is not None
    server = next(iter(cluster.state.view.snapshot.servers.values()))
    scope = scope_of(server)
    space = runtime.precise.space(scope)
    assert space is not None and space.mode == "tokens"
    pods = {pod.key: pod for pod in cluster.prefill_pods}
    # Repeats of earlier runs' prompts under a fresh salt, then of this run's: misses and
    # deep hits, on pods whose caches are full and evicting.
    prompts = shared_prefix(WORKLOAD)[:10]
    checked = hits = 0
    for prompt in prompts + prompts[::2]:
        for pod in pods.values():  # let the index catch up with every engine first
            cache = await cluster.sim_json(pod, "/sim/cache")
            stream = runtime.kv_events.stream(pod.key)
            assert stream is not None
            await eventually(functools.partial(_caught_up, stream, cache["kv_events"]["last_seq"]))
        body = prompt.body(MODEL, 2, "e-parity")
        tokens = runtime.deps.hasher.tokens("/v1/chat/completions", body, server.server)
        assert tokens is not None
        keys = runtime.deps.hasher.block_hashes(tokens.ids, "e-parity", tokens.message_ends, space)
        local, _ = runtime.precise.match(list(pods), scope, keys)
        usable = (len(tokens.ids) - 1) // space.block_size
        predicted = {pods[k].name: min(d, usable) * space.block_size
                     for k, d in zip(pods, local, strict=True)}
        result = await stream_chat(cluster.http, cluster.url, body)
        assert result.status == 200 and result.completed and result.prefill is not None
        record = (await cluster.sim_json(pods_by_name(pods)[result.prefill]))["recent"][-1]
        assert record["prompt_tokens"] == len(tokens.ids)  # token parity with the engine
        assert record["cached_tokens"] == predicted[result.prefill], (predicted, record)
        checked += 1
        hits += record["cached_tokens"] > 0
    assert checked == 15 and hits >= 5  # the repeats hit, and were predicted exactly
    assert runtime.precise.unkeyed_blocks == 0


def pods_by_name(pods: dict[str, PodPlan]) -> dict[str, PodPlan]:
    return {pod.name: pod for pod in pods.values()}


async def test_inflight_returns_to_zero_after_disconnects_and_upstream_errors(
    cluster: PolicyCluster,
) -> None:
    await cluster.use("prefix-cache")
    http = cluster.http
    assert http is not None
    prompts = shared_prefix(WORKLOAD)

    def body(i: int, tokens: int = 60) -> dict[str, object]:
        return prompts[i % len(prompts)].body(MODEL, tokens, f"c-{i}")

    # Clients that go away after the first token (the streams would run ~120 ms more).
    gone = await asyncio.gather(*(
        stream_chat(http, cluster.url, body(i), cancel_after_first=True) for i in range(12)
    ))  # fmt: skip
    assert all(r.ttft is not None for r in gone)
    await eventually(lambda: cluster.inflight_total() == 0)

    # Upstream errors: a decode pod dies mid-stream (its streams break), then a prefill pod
    # dies (its Mooncake segment goes with it: the other pods' store writes fail for a while).
    streams = [asyncio.create_task(stream_chat(http, cluster.url, body(i, 200)))
               for i in range(12)]  # fmt: skip
    await eventually(lambda: cluster.inflight_total() >= 12)  # 12 decode legs at least
    await asyncio.sleep(0.15)
    cluster.kill("g1-decode")
    finished = await asyncio.gather(*streams)
    cluster.kill("g2-prefill")
    after = await asyncio.gather(*(stream_chat(http, cluster.url, body(100 + i, 4))
                                   for i in range(9)))  # fmt: skip
    print(f"decode pods {sorted(str(r.decode) for r in finished)}, cut: "
          f"{[r.error for r in finished if not r.completed]}; "
          f"after the prefill kill: {[r.status for r in after]}")
    assert any(not r.completed for r in finished)  # the kill broke streams mid-way
    await eventually(lambda: cluster.inflight_total() == 0)
    async with http.get(f"{cluster.url}/metrics") as response:
        samples = metric_values(await response.text(), "pdgate_inflight_requests")
    assert samples and all(value == 0 for _, value in samples)
