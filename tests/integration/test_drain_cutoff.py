"""What a client sees when a router's drain cannot wait for its request: a clean ending.

A real router process serves streams from a slow simulated PD pair (long answers at a
slow inter-token latency), then gets SIGTERM with a short `--drain-grace`, or two
SIGTERMs in a row. Every open stream must end with one OpenAI error event and `[DONE]`
(never cut mid-chunk), a non-streaming request still waiting gets a 503 OpenAI error, the
process exits 0 promptly, and its log says what happened in one line, with no traceback.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest

from tests.integration.harness import SimCluster, SimPodSpec, free_port, loopback_net, write_yaml
from tests.integration.test_faults_kit import (
    FaultCluster,
    Router,
    server_manifests,
    sse_payloads,
    stream_text,
)

pytestmark = pytest.mark.integration

MODEL = "sim-drain-model"
APP = "cutoff"
ITL_MS = 40
#: Far more tokens than any drain here waits for (~80 s of decode at ITL_MS).
LONG = 2000
#: How long the process may take from the deciding signal to its exit.
EXIT_BOUND_S = 8.0
STREAMS = 3


@pytest.fixture(scope="module")
def slow(mooncake_master: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
    FaultCluster
]:
    net = loopback_net()
    specs = [
        SimPodSpec(name=f"g0-{role}", ip=ip, role=role, group="g0",
                   labels={"app": APP, "group": "g0", "role": role})
        for role, ip in (("prefill", f"{net}.11"), ("decode", f"{net}.12"))
    ]
    port = free_port([s.ip for s in specs])
    cluster = FaultCluster(SimCluster(mooncake_master, tmp_path_factory.mktemp("cutoff")),
                           port, specs)
    try:
        cluster.start_pods(MODEL, ["--itl-ms", str(ITL_MS), "--prefill-overhead-ms", "1"])
        write_yaml(cluster.sim.config_dir / "servers.yaml",
                   server_manifests("cutoff", MODEL, app=APP, port=port, timeout="300s"))
        yield cluster
    finally:
        cluster.stop()


def chat(content: str, stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": LONG, "stream": stream}


async def open_streams(session: aiohttp.ClientSession, router: Router, n: int
                       ) -> list[tuple[aiohttp.ClientResponse, bytes]]:
    """`n` raw SSE streams, each read up to its first event."""
    opened = []
    for i in range(n):
        response = await session.post(f"{router.url}/v1/chat/completions",
                                      json=chat(f"cut me {i}", stream=True))
        assert response.status == 200
        first = await response.content.readline()
        assert first.startswith(b"data: {")
        opened.append((response, first))
    return opened


async def sdk_stream(router: Router, started: asyncio.Event) -> BaseException | None:
    """Read a stream with the openai SDK; what it raised at the end (None: nothing)."""
    client = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "cut the sdk"}],
            max_tokens=LONG, stream=True,
        )
        async for _ in stream:
            started.set()
    except Exception as exc:  # what the SDK makes of the stream's end
        return exc
    finally:
        started.set()
        await client.close()
    return None


async def non_streaming(session: aiohttp.ClientSession, router: Router
                        ) -> tuple[int, dict[str, Any]]:
    async with session.post(f"{router.url}/v1/chat/completions",
                            json=chat("cut the json", stream=False)) as response:
        return response.status, await response.json()


def assert_ended_cleanly(body: bytes) -> None:
    """An SSE body that relayed some answer, then one error event, then `[DONE]`."""
    assert body.endswith(b"\n\n"), body[-200:]
    payloads = sse_payloads(body)
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    errors = [p for p in payloads if isinstance(p, dict) and "error" in p]
    assert len(errors) == 1 and payloads[-2] is errors[0], payloads[-3:]
    error = errors[0]["error"]
    assert error["code"] == "shutting_down" and error["type"] == "service_unavailable"
    assert set(error) == {"message", "type", "param", "code"}
    assert stream_text(payloads)  # part of the answer came first


def assert_quiet_log(router: Router) -> str:
    log = router.process.log()
    for marker in ("Traceback", "CancelledError", "Exception in ASGI"):
        assert marker not in log, log
    return log


async def run_cutoff(router: Router, signals: list[float]) -> tuple[float, int, str]:
    """Open streams and one JSON request, send SIGTERM at each delay of `signals`, check
    every client's ending; (seconds from the last signal to exit, exit code, log)."""
    assert router.process.popen is not None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        streams = await open_streams(session, router, STREAMS)
        sdk_started = asyncio.Event()
        sdk = asyncio.create_task(sdk_stream(router, sdk_started))
        waiting = asyncio.create_task(non_streaming(session, router))
        try:
            await asyncio.wait_for(sdk_started.wait(), 10)
            await asyncio.sleep(0.2)  # the JSON request is in decode by now
            for delay in signals:
                await asyncio.sleep(delay)
                router.terminate()
            last = time.monotonic()
            for response, first in streams:
                assert_ended_cleanly(first + await response.read())
            raised = await sdk
            assert isinstance(raised, openai.APIError), raised
            assert "shutting down" in raised.message
            status, body = await waiting
            assert status == 503 and body["error"]["code"] == "shutting_down"
        finally:
            for task in (sdk, waiting):
                task.cancel()
            for response, _ in streams:
                response.release()
    code = await asyncio.to_thread(router.process.popen.wait, EXIT_BOUND_S + 5)
    return time.monotonic() - last, code, assert_quiet_log(router)


async def test_grace_running_out_ends_every_stream_with_an_error_and_done(
    slow: FaultCluster,
) -> None:
    router = slow.start_router(["--drain-grace", "1.5"], name="grace")
    took, code, log = await run_cutoff(router, [0.0])
    print(f"\ngrace 1.5 s over: exit {code} {took:.2f} s after SIGTERM")
    assert code == 0
    assert took < 1.5 + EXIT_BOUND_S
    ended = [line for line in log.splitlines() if "grace period over" in line]
    assert len(ended) == 1 and f"{STREAMS + 2} request(s)" in ended[0], log


async def test_second_sigterm_ends_every_stream_with_an_error_and_done(
    slow: FaultCluster,
) -> None:
    router = slow.start_router(["--drain-grace", "60"], name="twice")
    took, code, log = await run_cutoff(router, [0.0, 0.3])
    print(f"\nsecond SIGTERM: exit {code} {took:.2f} s after it")
    assert code == 0
    assert took < EXIT_BOUND_S
    ended = [line for line in log.splitlines() if "again" in line]
    assert len(ended) == 1 and f"{STREAMS + 2} request(s)" in ended[0], log
