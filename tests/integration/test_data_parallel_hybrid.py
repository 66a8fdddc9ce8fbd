"""A data-parallel deployment across pods end to end, as llm-d's wide-EP guide runs vLLM.

Four ranks over two pods of two: each pod runs `--data-parallel-size 4
--data-parallel-size-local 2 --data-parallel-start-rank S --data-parallel-hybrid-lb`
behind an API server of its own that serves only its ranks, and the header names a
rank's LOCAL index there; each rank keeps its global rank for its KV events ports, its
batches and its `engine` metric series. The ModelServers say so
(`pdgate.io/data-parallel-size: "4"`, `pdgate.io/data-parallel-size-local: "2"`,
`pdgate.io/data-parallel-lb: hybrid`), and each pod's first rank comes from its
LeaderWorkerSet worker-index label (times 2), as the guide's `START_RANK`.

- Aggregated: a prompt computed on global rank 3 (the second pod's local engine 1, sent
  to it directly) is found through rank 3's own stream (events port + 3) and served
  there through the router, which pins it with the local index.
- PD over upstream vLLM's Mooncake flow, the prefill pod the second node (global ranks 2
  and 3): its own bootstrap server lists its engines by local index, and the picked
  rank's engine id is the one decode reads from.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

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

AGG_MODEL = "m-hybrid"
PD_MODEL = "m-hybrid-pd"
NET = loopback_net()
WORKER = "leaderworkerset.sigs.k8s.io/worker-index"
LEADER = SimPodSpec("hya-0", f"{NET}.91", "both", labels={"app": "hya", WORKER: "0"})
FOLLOWER = SimPodSpec("hya-1", f"{NET}.92", "both", labels={"app": "hya", WORKER: "1"})
PREFILL = SimPodSpec("hyp-p", f"{NET}.93", "prefill", "g0",
                     {"app": "hyp", "group": "g0", "role": "prefill", WORKER: "1"})
DECODE = SimPodSpec("hyp-d", f"{NET}.94", "decode", "g0",
                    {"app": "hyp", "group": "g0", "role": "decode", WORKER: "0"})
PODS = (LEADER, FOLLOWER, PREFILL, DECODE)
RANKS = {"pdgate.io/data-parallel-size": "4", "pdgate.io/data-parallel-size-local": "2",
         "pdgate.io/data-parallel-lb": "hybrid"}


def node_flags(spec: SimPodSpec) -> list[str]:
    """vLLM's flags for the pod's node: ranks 2 x its worker index, and the next."""
    start = int(spec.labels[WORKER]) * 2
    return ["--data-parallel-size", "4", "--data-parallel-size-local", "2",
            "--data-parallel-start-rank", str(start), "--data-parallel-hybrid-lb"]


@pytest.fixture(scope="module")
def cluster(
    mooncake_master: object, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DPCluster]:
    with running_cluster(
        mooncake_master, tmp_path_factory.mktemp("data-parallel-hybrid"),
        DPServer("hya", AGG_MODEL, [LEADER, FOLLOWER]),
        DPServer("hyp", PD_MODEL, [PREFILL, DECODE]), RANKS, node_flags,
        [(LEADER, 0), (LEADER, 1), (FOLLOWER, 0), (FOLLOWER, 1)],
    ) as cluster:
        yield cluster


async def test_a_rank_of_the_second_node_is_found_and_pinned_by_its_local_index(
    cluster: DPCluster,
) -> None:
    """Global rank 3 is the second pod's engine 1: the router reads its events on the
    events port + 3, names it hya-1/dp3, and reaches it with the header 1."""
    topic = "glaciers"
    batches = cluster.batches()
    await asyncio.to_thread(cluster.compute_at, FOLLOWER, 1, topic)
    assert cluster.last_record(FOLLOWER, 3)["cached_tokens"] == 0
    await eventually(lambda: cluster.batches() > batches)
    raw = await cluster.client().chat.completions.with_raw_response.create(
        model=AGG_MODEL, messages=messages(topic, "through the router"),  # type: ignore[arg-type]
        max_tokens=2)
    raw.parse()
    assert served_by(raw.headers["x-pdgate-decode-pod"]) == (FOLLOWER.name, 3)
    record = cluster.last_record(FOLLOWER, 3)
    assert record["rank"] == 3 and record["cached_tokens"] > 0


async def test_a_pd_pair_across_nodes_hands_kv_over(cluster: DPCluster) -> None:
    chat = [{"role": "user", "content": "Tell me a story about glaciers and seas. " * 12}]
    raw = await cluster.client().chat.completions.with_raw_response.create(
        model=PD_MODEL, messages=chat, max_tokens=8)  # type: ignore[arg-type]
    answer = raw.parse()
    assert answer.choices[0].message.content == expected_text(
        chat_ids(chat), 8, kv_from_store=True, model=PD_MODEL)
    prefill_pod, prefill_rank = served_by(raw.headers["x-pdgate-prefill-pod"])
    decode_pod, decode_rank = served_by(raw.headers["x-pdgate-decode-pod"])
    assert (prefill_pod, decode_pod) == (PREFILL.name, DECODE.name)
    assert prefill_rank in (2, 3) and decode_rank in (0, 1)
    prefilled = cluster.last_record(PREFILL, prefill_rank)
    decoded = cluster.last_record(DECODE, decode_rank)
    assert prefilled["kind"] == "prefill" and prefilled["rank"] == prefill_rank
    assert decoded["kind"] == "decode" and decoded["kv_from_store"] and decoded["blocks"] > 0
