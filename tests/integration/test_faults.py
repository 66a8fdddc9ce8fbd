"""Each fault on real processes: Mooncake master, simulated PD pods, router processes.

Pods are made faulty at runtime through `/sim/faults`, usually only for requests that
carry a marker in their prompt (`match`), so a test faults exactly what it sends. After
every test the faults are cleared and the router's counters must return to zero: nothing
in flight, nobody queued, no pod left ejected.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest

from engine_sim.generation import expected_text
from tests.integration.harness import SimCluster, free_port, write_yaml
from tests.integration.test_faults_kit import (
    FaultCluster,
    Router,
    assert_no_leak,
    metric_sum,
    pd_specs,
    server_manifests,
    sse_payloads,
    stream_text,
    wait_for,
)
from tests.sim_tokens import chat_ids

pytestmark = pytest.mark.integration

MODEL = "sim-fault-model"  # what the pods serve; also the main route's name
SHORT = "short-model"  # 1.5 s timeout
NORETRY = "noretry-model"  # no retries
APP = "faulty"
ITL_MS = 4
ROUTER_FLAGS = [
    "--outlier-failures", "2", "--outlier-base-ejection", "0.3", "--outlier-max-ejection", "2",
    "--health-check-interval", "0.3", "--health-check-timeout", "0.5",
    "--unhealthy-threshold", "2",
]


@pytest.fixture(scope="module")
def faulty(mooncake_master: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
    tuple[FaultCluster, Router]
]:
    specs = pd_specs(APP)
    port = free_port([s.ip for s in specs])
    cluster = FaultCluster(SimCluster(mooncake_master, tmp_path_factory.mktemp("faults")),
                           port, specs)
    try:
        cluster.start_pods(MODEL, ["--itl-ms", str(ITL_MS), "--prefill-overhead-ms", "1"])
        docs = [
            *server_manifests("faulty", MODEL, app=APP, port=port, timeout="20s"),
            *server_manifests("faulty-short", SHORT, app=APP, port=port, upstream_model=MODEL,
                              timeout="1500ms", retry_attempts=1),
            *server_manifests("faulty-noretry", NORETRY, app=APP, port=port,
                              upstream_model=MODEL, retry_attempts=0),
        ]
        write_yaml(cluster.sim.config_dir / "servers.yaml", docs)
        router = cluster.start_router(ROUTER_FLAGS)
        yield cluster, router
    finally:
        cluster.stop()


@pytest.fixture(autouse=True)
def back_to_normal(faulty: tuple[FaultCluster, Router]) -> Iterator[None]:
    """Clear every fault after a test, then check the router's counters returned to zero."""
    yield
    cluster, router = faulty
    cluster.clear_faults()

    def settled() -> bool:
        text = router.metrics()
        return (
            metric_sum(text, "pdgate_inflight_requests") == 0
            and metric_sum(text, "pdgate_pods_ejected") == 0
        )

    wait_for(settled, timeout=10)


def chat(content: str, max_tokens: int = 6, model: str = MODEL, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, **extra}


def expected(content: str, max_tokens: int) -> str:
    return expected_text(chat_ids([{"role": "user", "content": content}]), max_tokens,
                         kv_from_store=True, model=MODEL)


async def post(url: str, body: dict[str, Any], limit_s: float = 30.0
               ) -> tuple[int, dict[str, str], bytes]:
    """POST a chat request; (status, headers with lower-case names, body)."""
    async with aiohttp.ClientSession() as session, session.post(
        f"{url}/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=limit_s)
    ) as response:
        headers = {k.lower(): v for k, v in response.headers.items()}
        return response.status, headers, await response.read()


async def test_failing_prefill_is_retried_ejected_and_readmitted(
    faulty: tuple[FaultCluster, Router],
) -> None:
    cluster, router = faulty
    cluster.set_faults("g0-prefill", error_rate=1.0)
    # The two idle groups tie for these short prompts and the tie is drawn at random, so
    # how many of a fixed number of requests try g0 first is luck (with 8, fewer than the
    # two failures that eject it about 1 run in 28): send until g0 has failed twice.
    # Fewer than two tries in 64 requests has a chance of about 4e-18.
    for i in range(64):
        status, headers, body = await post(router.url, chat(f"eject me {i}"))
        assert status == 200, body
        assert headers["x-pdgate-prefill-pod"] == "g1-prefill"
        if cluster.injected("error", ["g0-prefill"]) >= 2:
            break
    assert cluster.injected("error", ["g0-prefill"]) >= 2
    text = router.metrics()
    assert metric_sum(text, "pdgate_pod_ejections_total") >= 1
    assert metric_sum(text, "pdgate_retries_total") >= 1
    cluster.clear_faults()
    # The backoff ends, a probe of /health succeeds, and the pod is back.
    wait_for(lambda: metric_sum(router.metrics(), "pdgate_pods_ejected") == 0, timeout=10)
    assert metric_sum(router.metrics(), "pdgate_pod_readmissions_total") >= 1
    prefills = set()
    for i in range(16):
        status, headers, _ = await post(router.url, chat(f"back {i}", max_tokens=1))
        assert status == 200
        prefills.add(headers["x-pdgate-prefill-pod"])
    assert prefills == {"g0-prefill", "g1-prefill"}


async def test_every_decode_failing_is_a_clean_502(faulty: tuple[FaultCluster, Router]) -> None:
    cluster, router = faulty
    for pod in ("g0-decode", "g1-decode"):
        cluster.set_faults(pod, error_rate=1.0, match="ALL-FAIL")
    for stream in (False, True):
        status, headers, body = await post(router.url, chat("ALL-FAIL", stream=stream))
        assert status == 502
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert_no_leak(body.decode())
        assert headers["content-type"] == "application/json"
    assert cluster.injected("error") >= 2


async def test_hang_ends_in_504_and_the_engine_sees_the_cancel(
    faulty: tuple[FaultCluster, Router],
) -> None:
    cluster, router = faulty
    prefills = ["g0-prefill", "g1-prefill"]
    for pod in prefills:
        cluster.set_faults(pod, hang_rate=1.0, match="HANG-ME")
    before = cluster.cancelled(prefills)
    began = time.monotonic()
    status, _, body = await post(router.url, chat("HANG-ME", model=SHORT))
    took = time.monotonic() - began
    assert status == 504, body
    assert 1.4 <= took < 3.0
    assert json.loads(body)["error"]["code"] == "upstream_timeout"
    wait_for(lambda: cluster.cancelled(prefills) > before, timeout=1.0)
    assert cluster.injected("hang", prefills) == 1


async def test_slow_start_is_only_slow(faulty: tuple[FaultCluster, Router]) -> None:
    cluster, router = faulty
    for pod in cluster.pods:
        cluster.set_faults(pod, slow_start_ms=300, match="SLOW")
    began = time.monotonic()
    status, _, body = await post(router.url, chat("SLOW start", max_tokens=4))
    assert status == 200
    assert time.monotonic() - began >= 0.6  # prefill and decode each waited
    assert json.loads(body)["choices"][0]["message"]["content"] == expected(
        "SLOW start", 4)
    assert cluster.injected("slow_start") == 2


async def test_dropped_stream_ends_with_an_error_event_and_done(
    faulty: tuple[FaultCluster, Router],
) -> None:
    cluster, router = faulty
    for pod in ("g0-decode", "g1-decode"):
        cluster.set_faults(pod, drop_rate=1.0, drop_after_chunks=3, match="DROP-ME")
    content = "DROP-ME mid stream"
    status, _, body = await post(router.url, chat(content, max_tokens=12, stream=True))
    assert status == 200
    payloads = sse_payloads(body)
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    errors = [p for p in payloads if isinstance(p, dict) and "error" in p]
    assert len(errors) == 1 and payloads[-2] is errors[0]
    assert errors[0]["error"]["type"] == "upstream_error"
    text = stream_text(payloads)
    assert 0 < len(text) < len(expected(content, 12))
    assert expected(content, 12).startswith(text)  # a prefix of one answer, never spliced
    roles = [p for p in payloads if isinstance(p, dict) and p.get("choices")
             and p["choices"][0].get("delta", {}).get("role")]
    assert len(roles) == 1
    # The openai SDK turns the error event into an exception.
    client = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIError):
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=12,
            stream=True,
        )
        async for _ in stream:
            pass


async def test_dropped_answer_before_any_byte_is_retried(
    faulty: tuple[FaultCluster, Router],
) -> None:
    cluster, router = faulty
    cluster.set_faults("g0-decode", drop_rate=1.0, match="DROP-NS")
    for i in range(8):
        status, headers, _ = await post(router.url, chat(f"DROP-NS {i}"))
        assert status == 200
        assert headers["x-pdgate-decode-pod"] == "g1-decode"


async def test_prefill_without_kv_params_is_retried(faulty: tuple[FaultCluster, Router]) -> None:
    cluster, router = faulty
    cluster.set_faults("g0-prefill", no_kv_params_rate=1.0, match="NO-KV")
    for i in range(30):
        status, headers, _ = await post(router.url, chat(f"NO-KV {i}"))
        assert status == 200
        assert headers["x-pdgate-prefill-pod"] == "g1-prefill"
        if cluster.injected("no_kv_params") >= 2:
            break
    assert cluster.injected("no_kv_params") >= 1
    assert metric_sum(router.metrics(), "pdgate_upstream_errors_total",
                      reason="missing_kv_params") >= 1


async def test_missing_kv_gets_a_fresh_prefill_without_retries(
    faulty: tuple[FaultCluster, Router],
) -> None:
    cluster, router = faulty
    cluster.set_faults("g0-decode", kv_missing_rate=1.0, match="KV-MISS")
    for i in range(30):
        content = f"KV-MISS {i}"
        status, headers, body = await post(router.url, chat(content, model=NORETRY))
        assert status == 200, body
        assert headers["x-pdgate-decode-pod"] == "g1-decode"
        assert headers["x-pdgate-prefill-pod"] == "g1-prefill"  # a whole new pair
        assert json.loads(body)["choices"][0]["message"]["content"] == \
            expected(content, 6)
        if cluster.injected("kv_missing") >= 1:
            break
    assert cluster.injected("kv_missing") == 1
    assert metric_sum(router.metrics(), "pdgate_retries_total", phase="decode") >= 1


async def test_client_disconnect_cancels_decode_and_prefill(
    faulty: tuple[FaultCluster, Router],
) -> None:
    cluster, router = faulty
    decodes, prefills = ["g0-decode", "g1-decode"], ["g0-prefill", "g1-prefill"]
    # Mid-stream, during decode.
    before = cluster.cancelled(decodes)
    async with aiohttp.ClientSession() as session:
        response = await session.post(
            f"{router.url}/v1/chat/completions", json=chat("long one", 500, stream=True)
        )
        await response.content.readline()
        response.close()  # the client goes away
    gone = time.monotonic()
    wait_for(lambda: cluster.cancelled(decodes) > before, timeout=1.0, interval=0.01)
    decode_cancel_s = time.monotonic() - gone
    # During prefill (the prefill is slow to start).
    for pod in prefills:
        cluster.set_faults(pod, slow_start_ms=5000, match="SLOW-PREFILL")
    before = cluster.cancelled(prefills)
    with pytest.raises(TimeoutError):
        await post(router.url, chat("SLOW-PREFILL"), limit_s=0.3)
    gone = time.monotonic()
    wait_for(lambda: cluster.cancelled(prefills) > before, timeout=1.0, interval=0.01)
    prefill_cancel_s = time.monotonic() - gone
    print(f"\ncancel seen by the engine: decode {decode_cancel_s * 1e3:.0f} ms, "
          f"prefill {prefill_cancel_s * 1e3:.0f} ms after the client left")
    wait_for(lambda: metric_sum(router.metrics(), "pdgate_inflight_requests") == 0, timeout=2)
    assert metric_sum(router.metrics(), "pdgate_requests_total", status="499") >= 2


async def test_admission_bounds_answer_503_with_retry_after(
    faulty: tuple[FaultCluster, Router],
) -> None:
    cluster, _ = faulty
    router = cluster.start_router(["--max-inflight", "2", "--max-queue", "2",
                                   "--queue-timeout", "0.2"], name="admission")
    try:
        results = await asyncio.gather(*(
            post(router.url, chat(f"busy {i}", max_tokens=100)) for i in range(10)
        ))
        statuses = sorted(status for status, _, _ in results)
        assert statuses.count(200) >= 2 and statuses.count(503) >= 1
        assert set(statuses) == {200, 503}
        for status, headers, body in results:
            if status == 503:
                assert headers["retry-after"] == "1"
                assert json.loads(body)["error"]["type"] == "service_unavailable"
        text = router.metrics()
        assert metric_sum(text, "pdgate_admission_rejected_total") >= 1
        assert metric_sum(text, "pdgate_admission_queue") == 0
    finally:
        router.process.stop()
    per_model = cluster.start_router(["--max-inflight-per-model", "1", "--max-queue", "0"],
                                     name="per-model")
    try:
        busy = [asyncio.ensure_future(post(per_model.url, chat("hog", max_tokens=150)))]
        await asyncio.sleep(0.15)
        refused, other = await asyncio.gather(
            post(per_model.url, chat("same model", max_tokens=2)),
            post(per_model.url, chat("other model", max_tokens=2, model=SHORT)),
        )
        assert refused[0] == 503 and other[0] == 200
        assert (await busy[0])[0] == 200
    finally:
        per_model.process.stop()


async def test_default_admission_sheds_an_open_loop_burst_with_503s(
    faulty: tuple[FaultCluster, Router],
) -> None:
    """No bound given: the router sizes one from its pods (here 3 per decode pod, 2 pods)
    and sheds what goes beyond at once, before parsing, rather than queueing it."""
    cluster, _ = faulty
    router = cluster.start_router(["--inflight-per-pod", "3"], name="default-admission")
    try:
        bodies = [chat(f"burst {i}", max_tokens=150) for i in range(40)]
        bodies[7] = {"not": "even a chat request"}  # refused before parsing, not a 400

        async def arrive(i: int) -> tuple[int, dict[str, str], bytes]:
            await asyncio.sleep(0.005 * i)  # open loop: arrivals ignore the answers
            return await post(router.url, bodies[i], limit_s=20.0)

        results = await asyncio.gather(*(arrive(i) for i in range(len(bodies))))
        statuses = [status for status, _, _ in results]
        assert set(statuses) <= {200, 503}, statuses
        assert statuses.count(200) >= 6 and statuses.count(503) >= 1
        assert results[7][0] == 503
        for status, headers, body in results:
            if status == 503:
                assert headers["retry-after"] == "1"
                assert json.loads(body)["error"]["type"] == "service_unavailable"
            else:
                assert json.loads(body)["choices"][0]["message"]["content"]
        text = router.metrics()
        assert metric_sum(text, "pdgate_admission_rejected_total") == statuses.count(503)
        assert metric_sum(text, "pdgate_requests_total", status="503") == statuses.count(503)
        wait_for(lambda: metric_sum(router.metrics(), "pdgate_inflight_requests") == 0,
                 timeout=5)
        # The burst is over: the next request is served.
        assert (await post(router.url, chat("after the burst")))[0] == 200
    finally:
        router.process.stop()


async def test_a_saturated_router_checks_the_key_before_it_sheds(
    faulty: tuple[FaultCluster, Router],
) -> None:
    """At its bound the router refuses from the request's head (router/http/protocol.py),
    but only what the app would have shed: a missing key is still a 401, a wrong method a
    405; a keyed request gets the 503 on a connection that serves the next request."""
    cluster, _ = faulty
    key = "shed-key-1"
    keys = cluster.sim.workdir / "shed-keys"
    keys.write_text(f"{key}\n")
    router = cluster.start_router(["--max-inflight", "1", "--api-keys", str(keys)],
                                  name="early-shed")
    auth = {"authorization": f"Bearer {key}"}
    try:
        async with aiohttp.ClientSession(headers=auth) as keyed, aiohttp.ClientSession() as bare:
            url = f"{router.url}/v1/chat/completions"
            # ~1.2 s of decode: it holds the one slot while the requests below are answered.
            hog = asyncio.ensure_future(keyed.post(url, json=chat("hog", max_tokens=300)))
            for _ in range(500):  # until the hog holds the slot (the loop sends it)
                await asyncio.sleep(0.01)
                if metric_sum(router.metrics(key), "pdgate_inflight_requests") == 1:
                    break
            else:
                pytest.fail("the hog never reached the router")
            async with bare.post(url, json=chat("no key")) as response:
                assert response.status == 401
            async with keyed.get(url) as response:
                assert response.status == 405
            for i in range(3):  # one kept-alive connection: each answer leaves it usable
                async with keyed.post(url, json=chat(f"shed {i}")) as response:
                    assert response.status == 503
                    assert response.headers["retry-after"] == "1"
                    assert (await response.json())["error"]["type"] == "service_unavailable"
            async with await hog as response:
                assert response.status == 200
                assert (await response.json())["choices"][0]["message"]["content"]
            async with keyed.post(url, json=chat("after")) as response:
                assert response.status == 200
        text = router.metrics(key)
        assert metric_sum(text, "pdgate_admission_rejected_total") == 3
        assert metric_sum(text, "pdgate_requests_total", status="503") == 3
        assert metric_sum(text, "pdgate_requests_total", status="401") == 1
    finally:
        router.process.stop()


async def test_sigterm_drains_streams_then_exits_zero(
    faulty: tuple[FaultCluster, Router],
) -> None:
    cluster, _ = faulty
    router = cluster.start_router(["--drain-grace", "10"], name="drain")
    tokens = 150  # ~0.6 s of decode each
    async with aiohttp.ClientSession() as session:
        responses = [
            await session.post(f"{router.url}/v1/chat/completions",
                               json=chat(f"drain me {i}", tokens, stream=True))
            for i in range(4)
        ]
        firsts = [await r.content.readline() for r in responses]
        assert all(line.startswith(b"data: ") for line in firsts)
        router.terminate()
        signalled = time.monotonic()
        await asyncio.sleep(0.05)
        async with session.get(f"{router.url}/readyz") as ready:
            assert ready.status == 503
            assert (await ready.json())["draining"] is True
        async with session.post(f"{router.url}/v1/chat/completions",
                                json=chat("too late")) as late:
            assert late.status == 503
            assert (await late.json())["error"]["code"] == "shutting_down"
        for i, (response, first) in enumerate(zip(responses, firsts, strict=True)):
            body = first + await response.read()
            payloads = sse_payloads(body)
            assert payloads[-1] == "[DONE]"
            assert stream_text(payloads) == expected(f"drain me {i}", tokens)
    assert router.process.popen is not None
    code = router.process.popen.wait(timeout=15)
    drained_s = time.monotonic() - signalled
    print(f"\ndrain: 4 streams in flight, SIGTERM to exit {drained_s:.2f} s, exit code {code}")
    assert code == 0
    assert drained_s < 10


async def test_crashed_pod_is_routed_around_and_readmitted_after_restart(
    faulty: tuple[FaultCluster, Router],
) -> None:
    cluster, router = faulty
    cluster.set_faults("g1-decode", crash_on_request=1, match="CRASH")
    victim = cluster.sim.pods["g1-decode"]
    for i in range(40):  # until a request lands on g1-decode, which dies of it
        status, headers, _ = await post(router.url, chat(f"CRASH {i}"))
        assert status == 200
        await asyncio.sleep(0.05)
        if not victim.alive():
            assert headers["x-pdgate-decode-pod"] == "g0-decode"  # retried elsewhere
            break
    assert not victim.alive()
    assert cluster.sim.pods["g1-decode"].popen.returncode == 137  # type: ignore[union-attr]
    wait_for(lambda: metric_sum(router.metrics(), "pdgate_pod_ejected",
                                pod="default/g1-decode") == 1, timeout=5)
    for i in range(6):
        status, headers, _ = await post(router.url, chat(f"after crash {i}"))
        assert status == 200 and headers["x-pdgate-decode-pod"] == "g0-decode"
    cluster.restart_pod("g1-decode", MODEL, ["--itl-ms", str(ITL_MS)])
    wait_for(lambda: metric_sum(router.metrics(), "pdgate_pods_ejected") == 0, timeout=10)
    decodes = set()
    for i in range(16):
        status, headers, _ = await post(router.url, chat(f"restarted {i}", max_tokens=1))
        decodes.add(headers["x-pdgate-decode-pod"])
    assert decodes == {"g0-decode", "g1-decode"}


def test_fault_flags_and_admin_endpoint_validate(faulty: tuple[FaultCluster, Router]) -> None:
    cluster, _ = faulty
    request = urllib.request.Request(f"{cluster.pod_url('g0-decode')}/sim/faults",
                                     data=b'{"error_rate": 2}', method="POST")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=5)
    assert caught.value.code == 400
    state = cluster.set_faults("g0-decode", error_rate=0.5, seed=7)
    assert state["spec"]["error_rate"] == 0.5 and state["spec"]["seed"] == 7
    assert cluster.set_faults("g0-decode", replace=True)["spec"]["error_rate"] == 0.0

