"""A bounded soak: thousands of mixed requests, 5% hitting injected faults, a pod killed midway.

Every request must end in a complete answer or a clear error (an OpenAI error body, or an
error event then `[DONE]` in a stream); none may hang, break off silently, or come back
spliced from two answers. The router's memory must not grow after warm-up and its counters
must return to zero. `SOAK_REQUESTS` sets the size (default 2,000; the figures in the
report come from `SOAK_REQUESTS=5000`); the figures are printed and written to
`soak-figures.json` in the test's temporary directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from engine_sim.generation import expected_text
from tests.integration.harness import SimCluster, free_port, write_yaml
from tests.integration.test_faults_kit import (
    FaultCluster,
    Router,
    metric_sum,
    pd_specs,
    server_manifests,
    sse_payloads,
    stream_text,
    wait_for,
)
from tests.sim_tokens import chat_ids, prompt_ids

pytestmark = pytest.mark.integration

MODEL = "soak-model"
SHORT = "soak-short"  # a 1 s timeout, for the hang fault
REQUESTS = int(os.environ.get("SOAK_REQUESTS", "2000"))
CONCURRENCY = 32
FAULT_SHARE = 0.05
CLIENT_TIMEOUT_S = 20.0
# Marker -> (the pod it faults, that pod's fault spec). A marked request is faulted only if
# it lands on that pod; the report counts the faults the pods actually injected.
FAULTS: dict[str, tuple[str, dict[str, Any]]] = {
    "F-ERR": ("g0-prefill", {"error_rate": 1.0}),
    "F-NOKV": ("g1-prefill", {"no_kv_params_rate": 1.0, "slow_start_ms": 30.0}),
    "F-KVMISS": ("g0-decode", {"kv_missing_rate": 1.0}),
    "F-DROPHANG": ("g1-decode", {"drop_rate": 0.6, "hang_rate": 0.3, "drop_after_chunks": 2,
                                 "seed": 1}),
}
KILLED = "g1-decode"


@pytest.fixture(scope="module")
def soak_cluster(mooncake_master: object, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[tuple[FaultCluster, Router]]:
    specs = pd_specs("soak")
    port = free_port([s.ip for s in specs])
    cluster = FaultCluster(SimCluster(mooncake_master, tmp_path_factory.mktemp("soak")),
                           port, specs)
    try:
        cluster.start_pods(MODEL, ["--fast"])
        write_yaml(cluster.sim.config_dir / "servers.yaml", [
            *server_manifests("soak", MODEL, app="soak", port=port, retry_attempts=3,
                              timeout="10s"),
            *server_manifests("soak-short", SHORT, app="soak", port=port, upstream_model=MODEL,
                              retry_attempts=1, timeout="1s"),
        ])
        router = cluster.start_router([
            "--outlier-failures", "3", "--outlier-base-ejection", "0.5",
            "--outlier-max-ejection", "4", "--health-check-interval", "0.5",
            "--health-check-timeout", "1", "--unhealthy-threshold", "2",
        ])
        yield cluster, router
    finally:
        cluster.stop()


def arm_faults(cluster: FaultCluster, only: str | None = None) -> None:
    for marker, (pod, spec) in FAULTS.items():
        if only is None or pod == only:
            cluster.set_faults(pod, replace=True, match=marker, **spec)


def plan(rng: random.Random, i: int) -> dict[str, Any]:
    """One request: its body, path, expected text and fault marker (or None)."""
    marker = rng.choice(list(FAULTS)) if rng.random() < FAULT_SHARE else None
    stream = rng.random() < 0.5
    chat = rng.random() < 0.8
    tokens = rng.randint(1, 16)
    words = f"soak request {i} about {rng.choice(['rivers', 'stars', 'tea', 'maps'])} " * (
        rng.randint(1, 8))
    text = f"{marker} {words}" if marker else words
    model = SHORT if marker == "F-DROPHANG" else MODEL
    if chat:
        messages = [{"role": "user", "content": text}]
        body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": tokens}
        prompt = chat_ids(messages)
        path = "/v1/chat/completions"
    else:
        body = {"model": model, "prompt": text, "max_tokens": tokens}
        prompt = prompt_ids(text)
        path = "/v1/completions"
    if stream:
        body["stream"] = True
    # The pod answers a marked request as any other; marked or not, the answer's text is
    # this (the fault only decides whether there is an answer).
    want = expected_text(prompt, tokens, kv_from_store=True, model=MODEL)
    return {"body": body, "path": path, "want": want, "marker": marker, "stream": stream,
            "chat": chat}


def _error_text(raw: bytes) -> str:
    for payload in reversed(sse_payloads(raw)) if raw.startswith(b"data") else []:
        if isinstance(payload, dict) and "error" in payload:
            return str(payload["error"].get("message"))
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw[:80].decode(errors="replace")


def classify(job: dict[str, Any], status: int, raw: bytes) -> str:
    """complete | clear_error | broken (a silent cut, a spliced or wrong answer)."""
    if status != 200:
        try:
            error = json.loads(raw)["error"]
        except (ValueError, KeyError, TypeError):
            return "broken"
        return "clear_error" if error.get("message") else "broken"
    if not job["stream"]:
        answer = json.loads(raw)
        choice = answer["choices"][0]
        text = choice["message"]["content"] if job["chat"] else choice["text"]
        return "complete" if text == job["want"] else "broken"
    payloads = sse_payloads(raw)
    if not payloads or payloads[-1] != "[DONE]" or payloads.count("[DONE]") != 1:
        return "broken"
    errors = [p for p in payloads if isinstance(p, dict) and "error" in p]
    roles = [p for p in payloads if isinstance(p, dict) and p.get("choices")
             and (p["choices"][0].get("delta") or {}).get("role")]
    if job["chat"] and len(roles) > 1:
        return "broken"  # two answers spliced together
    text = stream_text(payloads)
    if not errors:
        return "complete" if text == job["want"] else "broken"
    if len(errors) == 1 and payloads[-2] is errors[0] and job["want"].startswith(text):
        return "clear_error"
    return "broken"


async def test_soak(soak_cluster: tuple[FaultCluster, Router], tmp_path: Path) -> None:
    cluster, router = soak_cluster
    arm_faults(cluster)
    rng = random.Random(20261202)
    jobs = [plan(rng, i) for i in range(REQUESTS)]
    outcomes: Counter[str] = Counter()
    by_fault: Counter[str] = Counter()
    latencies: list[float] = []
    done = 0
    rss: dict[str, int] = {}
    kill_at, warm_at = int(REQUESTS * 0.4), int(REQUESTS * 0.2)
    killed = asyncio.Event()
    errors: Counter[str] = Counter()
    injected: Counter[str] = Counter()  # faults counted by pods that were killed since
    sem = asyncio.Semaphore(CONCURRENCY)
    connector = aiohttp.TCPConnector(limit=CONCURRENCY * 2)

    async with aiohttp.ClientSession(connector=connector) as session:
        async def one(job: dict[str, Any]) -> None:
            nonlocal done
            async with sem:
                began = time.monotonic()
                try:
                    async with session.post(
                        router.url + job["path"], json=job["body"],
                        timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S),
                    ) as response:
                        raw = await response.read()
                        result = classify(job, response.status, raw)
                        if result != "complete":
                            errors[f"{response.status} {job['marker']} "
                                   f"{'stream' if job['stream'] else 'json'} "
                                   f"{_error_text(raw)}"] += 1
                except TimeoutError:
                    result = "hung"
                except aiohttp.ClientError:
                    result = "broken"
                latencies.append(time.monotonic() - began)
                outcomes[result] += 1
                if job["marker"]:
                    by_fault[f"{job['marker']}:{result}"] += 1
                done += 1
                if done == warm_at:
                    rss["warm"] = router.rss_kib()
                if done == kill_at:
                    killed.set()

        async def chaos() -> None:
            await killed.wait()
            before = await asyncio.to_thread(cluster.faults, KILLED)
            cluster.sim.pods[KILLED].kill()  # SIGKILL; the pod stays listed as Ready
            injected.update(before["injected"])
            await asyncio.sleep(1.5)
            await asyncio.to_thread(cluster.restart_pod, KILLED, MODEL, ["--fast"])
            await asyncio.to_thread(arm_faults, cluster, KILLED)

        began = time.monotonic()
        chaos_task = asyncio.create_task(chaos())
        await asyncio.gather(*(one(job) for job in jobs))
        elapsed = time.monotonic() - began
        await chaos_task

    rss["end"] = router.rss_kib()
    for pod in cluster.pods:
        for kind, count in cluster.faults(pod)["injected"].items():
            injected[kind] += count
    metrics = router.metrics()
    lost = outcomes["broken"] + outcomes["hung"]
    latencies.sort()
    figures = {
        "requests_sent": REQUESTS,
        "completed": outcomes["complete"],
        "failed_with_clear_error": outcomes["clear_error"],
        "lost": lost,
        "faulted_requests": sum(1 for job in jobs if job["marker"]),
        "faults_injected_by_kind": {k: v for k, v in sorted(injected.items()) if v},
        "outcomes_of_faulted_requests": dict(sorted(by_fault.items())),
        "pod_killed_and_restarted": KILLED,
        "router_retries": metric_sum(metrics, "pdgate_retries_total"),
        "router_ejections": metric_sum(metrics, "pdgate_pod_ejections_total"),
        "router_readmissions": metric_sum(metrics, "pdgate_pod_readmissions_total"),
        "elapsed_s": round(elapsed, 1),
        "requests_per_s": round(REQUESTS / elapsed, 1),
        "p50_ms": round(latencies[len(latencies) // 2] * 1e3, 1),
        "p99_ms": round(latencies[int(len(latencies) * 0.99)] * 1e3, 1),
        "router_rss_kib": rss,
        "errors": dict(errors.most_common(12)),
        "marked_requests_seen_by_pod": {pod: cluster.faults(pod)["requests"]
                          for pod in cluster.pods},
    }
    print("\nsoak figures:", json.dumps(figures, indent=2))
    (tmp_path / "soak-figures.json").write_text(json.dumps(figures, indent=2))

    assert sum(outcomes.values()) == REQUESTS
    assert lost == 0, outcomes
    assert outcomes["complete"] >= REQUESTS * 0.9
    assert router.process.alive()
    wait_for(lambda: metric_sum(router.metrics(), "pdgate_inflight_requests") == 0, 5)
    # Memory: what the router holds after warm-up stays put (allocator noise allowed).
    assert rss["end"] - rss["warm"] < 24 * 1024, rss
