"""pdgate's upstream-vLLM Mooncake connector against the simulator's bootstrap server, in
process, over real HTTP (the router's own `Upstream` client): every way `/query` can break
is one retryable `bad_bootstrap`, and a sound answer becomes decode's rendezvous fields."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web

from engine_sim.bootstrap import BootstrapFault, BootstrapServer
from kv_connectors import get_connector
from kv_connectors.base import PDCall, UpstreamError
from router.upstream import Upstream
from tests.local_http import serve


@dataclass(frozen=True)
class Pod:
    ip: str
    port: int
    dp_rank: int | None = None
    rank_pin: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.ip}:{self.port}"


class Prefill:
    """A stand-in prefill engine that records what it is sent."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        self.runner, self.port = await serve(app)

    async def complete(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        self.headers.append(dict(request.headers))
        return web.json_response({"choices": [], "kv_transfer_params": None})


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    client = Upstream()
    yield client
    await client.close()


def _call(bootstrap_port: int, prefill_port: int) -> PDCall:
    annotations = {
        "pdgate.io/mooncake-protocol": "vllm",
        "pdgate.io/mooncake-bootstrap-port": str(bootstrap_port),
    }
    return PDCall(
        path="/v1/completions",
        body={"model": "m", "prompt": "hi", "max_tokens": 9, "stream": True},
        headers={"x-request-id": "r1"},
        request_id="r1",
        prefill=Pod("127.0.0.1", prefill_port),
        decode=Pod("127.0.0.1", 1),
        deadline=asyncio.get_running_loop().time() + 10,
        annotations=annotations,
    )


async def test_sound_answer_becomes_decodes_rendezvous(upstream: Upstream) -> None:
    bootstrap = BootstrapServer("127.0.0.1", 0)
    prefill = Prefill()
    await bootstrap.start()
    await prefill.start()
    assert bootstrap.port is not None
    bootstrap.register_self("eng-p", "127.0.0.1", prefill.port)
    try:
        call = _call(bootstrap.port, prefill.port)
        connector = get_connector("mooncake", "vLLM", call.annotations)
        handoff = await connector.start(call, upstream)
        assert handoff.prefill_task is not None
        await asyncio.wait_for(handoff.prefill_task, 5)
        params = handoff.decode_body["kv_transfer_params"]
        assert params == {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "transfer_id": params["transfer_id"],
            "remote_bootstrap_addr": f"http://127.0.0.1:{bootstrap.port}",
            "remote_engine_id": "eng-p",
        }
        assert params["transfer_id"].startswith("xfer-r1-")
        sent = prefill.bodies[0]
        assert sent["kv_transfer_params"] == {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": params["transfer_id"],
        }
        assert (sent["max_tokens"], sent["min_tokens"], sent["stream"]) == (1, 1, False)
        assert prefill.headers[0]["X-data-parallel-rank"] == "0"
        assert bootstrap.queries == 1
    finally:
        await bootstrap.stop()
        if prefill.runner is not None:
            await prefill.runner.cleanup()


@pytest.mark.parametrize("fault", [f for f in BootstrapFault if f is not BootstrapFault.NONE])
async def test_every_broken_query_is_a_retryable_bad_bootstrap(
    upstream: Upstream, fault: BootstrapFault
) -> None:
    bootstrap = BootstrapServer("127.0.0.1", 0, fault)
    await bootstrap.start()
    if bootstrap.port is None:  # down: a port nothing listens on
        bootstrap.requested_port = _closed_port()
    else:
        bootstrap.register_self("eng-p", "127.0.0.1", 1)
    try:
        call = _call(bootstrap.port or bootstrap.requested_port, 1)
        with pytest.raises(UpstreamError) as caught:
            await get_connector("mooncake", "vLLM", call.annotations).start(call, upstream)
        assert caught.value.reason == "bad_bootstrap" and caught.value.retryable
        assert caught.value.pod == call.prefill and caught.value.phase == "prefill"
    finally:
        await bootstrap.stop()


async def test_a_404_from_the_bootstrap_port_is_retryable_too(upstream: Upstream) -> None:
    """Something else on that port: the pod's fault, not the client's (no 4xx passthrough)."""
    runner, port = await serve(web.Application())
    try:
        call = _call(port, 1)
        with pytest.raises(UpstreamError) as caught:
            await get_connector("mooncake", "vLLM", call.annotations).start(call, upstream)
        assert caught.value.reason == "bad_bootstrap" and caught.value.retryable
        assert caught.value.status == 404
    finally:
        await runner.cleanup()


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
