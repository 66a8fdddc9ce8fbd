"""Data-parallel pods end to end: vLLM `--data-parallel-size 2` pods behind the router.

Each simulated pod runs two engine cores (ranks) behind one API server, as vLLM does: each
rank its own prefix cache, its KV events on the events port + rank, its series of the
pod's `/metrics` labelled `engine`, and `X-data-parallel-rank` pins a request to it. The
ModelServers say so (`pdgate.io/data-parallel-size: "2"`), so the router scores each rank
as a target of its own and pins the one it picks. A router that saw only the pod would
leave the rank to vLLM's balancer, which knows the ranks' queues but not their caches.

- An aggregated pod under the precise prefix index: a prompt goes back to the rank that
  holds it, and a prompt that only rank 1 computed (sent to the pod directly) is found
  there, which needs rank 1's own stream on port + 1.
- A PD pair of such pods over upstream vLLM's Mooncake flow: prefill is pinned to the rank
  picked, and the bootstrap server's engine id of that rank is the one decode reads from.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from engine_sim.generation import expected_text
from tests.integration.data_parallel_cluster import (
    DPCluster,
    DPServer,
    messages,
    running_cluster,
    served_by,
)
from tests.integration.harness import SimPodSpec, loopback_net
from tests.polling import eventually
from tests.sim_tokens import chat_ids

pytestmark = pytest.mark.integration

AGG_MODEL = "m-dp"
PD_MODEL = "m-dp-pd"
NET = loopback_net()
AGG = SimPodSpec("dpa", f"{NET}.61", "both", labels={"app": "dpa"})
PREFILL = SimPodSpec("dpp-p", f"{NET}.62", "prefill", "g0",
                     {"app": "dpp", "group": "g0", "role": "prefill"})
DECODE = SimPodSpec("dpp-d", f"{NET}.63", "decode", "g0",
                    {"app": "dpp", "group": "g0", "role": "decode"})
PODS = (AGG, PREFILL, DECODE)
RANKS = {"pdgate.io/data-parallel-size": "2"}


@pytest.fixture(scope="module")
def cluster(
    mooncake_master: object, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DPCluster]:
    with running_cluster(
        mooncake_master, tmp_path_factory.mktemp("data-parallel"),
        DPServer("dpa", AGG_MODEL, [AGG]), DPServer("dpp", PD_MODEL, [PREFILL, DECODE]),
        RANKS, lambda _spec: ["--data-parallel-size", "2"], [(AGG, 0), (AGG, 1)],
    ) as cluster:
        yield cluster


async def ask(
    cluster: DPCluster, topic: str, question: str, *, stores: bool = False
) -> tuple[int, dict[str, Any]]:
    """One chat through the router: the rank that served it (the router's header) and that
    rank's record of it; when the prompt `stores` new blocks, once the rank's KV events of
    them reached the router."""
    batches = cluster.batches()
    raw = await cluster.client().chat.completions.with_raw_response.create(
        model=AGG_MODEL, messages=messages(topic, question), max_tokens=2)  # type: ignore[arg-type]
    raw.parse()
    pod, rank = served_by(raw.headers["x-pdgate-decode-pod"])
    assert pod == AGG.name
    record = cluster.last_record(AGG, rank)
    assert record["rank"] == rank  # the rank the router pinned served it
    if stores:
        await eventually(lambda: cluster.batches() > batches)
    return rank, record


async def test_a_prompt_goes_back_to_the_rank_that_holds_it(cluster: DPCluster) -> None:
    blocks = len(chat_ids(messages("rivers", "q"))) // 16
    assert blocks >= 10
    rank, record = await ask(cluster, "rivers", "q1", stores=True)
    assert record["cached_tokens"] == 0
    hits = cluster.metric("pdgate_prefix_cache_hits_total")
    again, record = await ask(cluster, "rivers", "q2")
    assert again == rank and record["cached_tokens"] >= (blocks - 1) * 16
    assert cluster.metric("pdgate_prefix_cache_hits_total") - hits >= blocks - 1


async def test_each_ranks_own_events_are_indexed(cluster: DPCluster) -> None:
    """Rank 1 computes a prompt sent to the pod directly (pinned, past the router): the
    router learns it only from rank 1's stream (events port + 1) and sends it there."""
    for rank in (1, 0):
        topic = f"mountains-{rank}"
        batches = cluster.batches()
        await asyncio.to_thread(cluster.compute_at, AGG, rank, topic)
        assert cluster.last_record(AGG, rank)["cached_tokens"] == 0
        await eventually(lambda before=batches: cluster.batches() > before)
        served, record = await ask(cluster, topic, "through the router")
        assert served == rank and record["cached_tokens"] > 0


async def test_a_pd_pair_of_ranks_hands_kv_over(cluster: DPCluster) -> None:
    chat = [{"role": "user", "content": "Tell me a story about rivers and mountains. " * 12}]
    raw = await cluster.client().chat.completions.with_raw_response.create(
        model=PD_MODEL, messages=chat, max_tokens=8)  # type: ignore[arg-type]
    answer = raw.parse()
    assert answer.choices[0].message.content == expected_text(
        chat_ids(chat), 8, kv_from_store=True, model=PD_MODEL)
    prefill_pod, prefill_rank = served_by(raw.headers["x-pdgate-prefill-pod"])
    decode_pod, decode_rank = served_by(raw.headers["x-pdgate-decode-pod"])
    assert (prefill_pod, decode_pod) == (PREFILL.name, DECODE.name)
    prefilled = cluster.last_record(PREFILL, prefill_rank)
    decoded = cluster.last_record(DECODE, decode_rank)
    assert prefilled["kind"] == "prefill" and prefilled["rank"] == prefill_rank
    assert decoded["kind"] == "decode" and decoded["kv_from_store"] and decoded["blocks"] > 0
