"""TTFT-SLO admission on real processes: one PD group of `engine_sim` pods behind a real
Mooncake Store, the router in-process, the official `openai` SDK as the client.

The prefill pod runs one prefill at a time at 2 ms a prompt token, and the router's cost
model is told so. The SLO target is 1.5 s: a ~600-token prompt on an idle pair is predicted
at ~1.2 s and admitted; the same prompt while another one is prefilling is predicted at
~1.2 s of queue + ~1.2 s of prefill and refused with a 429 and Retry-After, before anything
is sent to a pod (the engines' counters do not move, nothing stays in flight).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import yaml

from benchmarks.sched_policies import MODEL, PolicyCluster
from benchmarks.words import single_token_words
from engine_sim.kvstore import mooncake_import_error
from router.scheduling.config import parse_scheduler_config
from tests.integration.harness import loopback_net

pytestmark = pytest.mark.integration

SLO_DOCUMENT: dict[str, Any] = {
    "apiVersion": "pdgate.io/v1alpha1",
    "kind": "SchedulerConfig",
    "costModel": {"prefillSecondsPerToken": 0.002},
    "sloAdmission": {"enabled": True, "ttftTarget": "1500ms", "action": "reject"},
    "reload": {"interval": "100ms"},
}


@pytest.fixture(scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[PolicyCluster]:
    reason = mooncake_import_error()
    if reason is not None:
        pytest.skip(f"Mooncake store unavailable: {reason}")
    flags = ("--max-num-seqs", "1", "--prefill-per-token-ms", "2", "--itl-ms", "2")
    async with PolicyCluster(
        tmp_path_factory.mktemp("slo"), groups=1, subnet=loopback_net(),
        prefill_flags=flags, decode_flags=("--itl-ms", "2"),
    ) as made:
        path = made.scheduler_file
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(yaml.safe_dump(SLO_DOCUMENT))
        tmp.replace(path)
        expected = parse_scheduler_config(SLO_DOCUMENT)
        deadline = time.monotonic() + 10
        while made.runtime.config != expected:
            assert time.monotonic() < deadline, "the router did not reload the SLO config"
            await asyncio.sleep(0.02)
        yield made


def _prompt(seed: int, words: int = 600) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choices(single_token_words(), k=words))


async def test_over_target_is_refused_with_429_and_retry_after(cluster: PolicyCluster) -> None:
    client = openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0)
    # Idle: predicted ~1.2 s, within 1.5 s.
    first = asyncio.create_task(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": _prompt(1)}], max_tokens=4,
    ))  # fmt: skip
    deadline = time.monotonic() + 5
    while cluster.inflight_total() == 0:  # the first one is prefilling now
        assert time.monotonic() < deadline and not first.done()
        await asyncio.sleep(0.01)
    before = await cluster.prefix_counters()
    with pytest.raises(openai.RateLimitError) as caught:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": _prompt(2)}], max_tokens=4,
        )
    error = caught.value
    assert error.status_code == 429
    assert int(error.response.headers["retry-after"]) >= 1
    body = error.body
    assert isinstance(body, dict) and body.get("code") == "ttft_slo"
    assert "target" in str(body.get("message"))
    answer = await first
    assert answer.choices[0].message.content
    # The refused request reached no engine: only the first one was counted there.
    after = await cluster.prefix_counters()
    assert after[1] - before[1] <= 700  # the first prompt's tokens at most, not a second one
    assert cluster.inflight_total() == 0
    assert cluster.state is not None
    registry = cluster.state.registry
    assert registry.get_sample_value(
        "pdgate_scheduler_slo_admission_total", {"outcome": "rejected"}) == 1
    assert registry.get_sample_value(
        "pdgate_scheduler_slo_admission_total", {"outcome": "admitted"}) == 1
    # Idle again: admitted.
    again = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": _prompt(3)}], max_tokens=4,
    )
    assert again.choices[0].message.content
