"""The load generator against an in-process server: TTFT at the first content chunk, ITL,
errors by kind, and the count/time bounds of both loops."""

from __future__ import annotations

import asyncio
import gc
import itertools
from collections.abc import AsyncIterator

import orjson
import pytest
from aiohttp import web

from benchmarks.loadgen import LoadLimits, frozen_heap, run_closed, run_open
from benchmarks.specs import RequestResult, RequestSpec
from benchmarks.targets import DirectPDTarget, HTTPTarget
from tests.local_http import serve

ROLE_DELAY = 0.02  # the role-only chunk comes early ...
CONTENT_DELAY = 0.15  # ... the first content much later: TTFT must be the latter
GAP = 0.03


def _sse(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _delta(content: str | None, role: bool = False) -> bytes:
    delta: dict[str, object] = {"role": "assistant", "content": ""} if role else {}
    if content is not None:
        delta["content"] = content
    return _sse({"choices": [{"index": 0, "delta": delta}]})


async def _chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    mode = body.get("mode", "ok")
    if mode == "status":
        return web.json_response({"error": {"message": "nope", "code": 503}}, status=503)
    if body.get("stream") is False:
        return web.json_response(
            {"choices": [{"index": 0, "message": {"content": "x"}}],
             "usage": {"prompt_tokens": 5, "completion_tokens": 1},
             "kv_transfer_params": body.get("kv_transfer_params")}
        )  # fmt: skip
    response = web.StreamResponse(
        headers={"content-type": "text/event-stream", "x-pdgate-decode-pod": "d0"}
    )
    await response.prepare(request)
    await asyncio.sleep(ROLE_DELAY)
    await response.write(_delta(None, role=True))
    await asyncio.sleep(CONTENT_DELAY - ROLE_DELAY)
    await response.write(_delta(" a"))
    if mode == "error":
        await response.write(_sse({"error": {"message": "mid-stream", "code": 500}}))
        await response.write(b"data: [DONE]\n\n")
        return response
    for piece in (" b", " c"):
        await asyncio.sleep(GAP)
        await response.write(_delta(piece))
    await response.write(_sse({"choices": [], "usage": {"prompt_tokens": 5,
                                                         "completion_tokens": 3}}))
    if mode != "no_done":
        await response.write(b"data: [DONE]\n\n")
    return response


async def _slow(request: web.Request) -> web.Response:
    await asyncio.sleep(1.0)
    return web.json_response({})


@pytest.fixture
async def server() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/slow/v1/chat/completions", _slow)
    runner, port = await serve(app)
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


def _spec(session: int = 0, mode: str = "ok", stream: bool = True) -> RequestSpec:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream,
            "max_tokens": 3, "mode": mode}
    return RequestSpec(session, 0, orjson.dumps(body), stream)


async def _one(base: str, spec: RequestSpec) -> RequestResult:
    load = await run_closed(HTTPTarget("t", base), [(spec,)], 1, LoadLimits(10.0, 5.0))
    assert len(load.results) == 1
    return load.results[0]


async def test_ttft_is_at_the_first_content_chunk_not_the_role_chunk(server: str) -> None:
    result = await _one(server, _spec())
    assert result.ok, result.error
    assert result.ttft is not None
    assert CONTENT_DELAY - 0.01 <= result.ttft < CONTENT_DELAY + 0.1
    assert result.chunks == 3
    assert len(result.itl) == 2 and all(GAP - 0.01 <= gap < GAP + 0.1 for gap in result.itl)
    assert result.e2e >= result.ttft + 2 * GAP - 0.01
    assert (result.prompt_tokens, result.completion_tokens) == (5, 3)
    assert result.decode_pod == "d0"


async def test_non_streaming_has_no_ttft(server: str) -> None:
    result = await _one(server, _spec(stream=False))
    assert result.ok and result.ttft is None and result.e2e > 0
    assert result.completion_tokens == 1


@pytest.mark.parametrize(
    ("mode", "kind"),
    [("status", "http_503"), ("error", "stream_error"), ("no_done", "no_done")],
)
async def test_errors_by_kind(server: str, mode: str, kind: str) -> None:
    result = await _one(server, _spec(mode=mode))
    assert result.error == kind


async def test_connection_refused_is_an_error_not_an_exception() -> None:
    result = await _one("http://127.0.0.1:9", _spec())
    assert result.error == "connect"


async def test_request_timeout_bounds_each_request(server: str) -> None:
    load = await run_closed(
        HTTPTarget("t", server + "/slow"), [(_spec(),)], 1, LoadLimits(5.0, 0.2)
    )
    assert [r.error for r in load.results] == ["timeout"]
    assert load.wall < 1.0


async def test_closed_loop_is_bounded_by_count(server: str) -> None:
    sessions = [(_spec(i),) for i in range(6)]
    load = await run_closed(HTTPTarget("t", server), sessions, 3, LoadLimits(30.0, 5.0))
    assert sorted(r.session for r in load.results) == list(range(6))
    assert all(r.ok for r in load.results)


async def test_closed_loop_is_bounded_by_time(server: str) -> None:
    sessions = [(_spec(i),) for i in range(1000)]
    load = await run_closed(HTTPTarget("t", server), sessions, 2, LoadLimits(0.5, 5.0))
    assert 0 < len(load.results) < 20
    assert load.wall < 1.5


async def test_sessions_run_their_turns_in_order(server: str) -> None:
    body = _spec().body
    session = tuple(RequestSpec(0, turn, body) for turn in range(3))
    load = await run_closed(HTTPTarget("t", server), [session], 4, LoadLimits(30.0, 5.0))
    results = load.results
    assert [r.turn for r in results] == [0, 1, 2]
    for earlier, later in itertools.pairwise(results):
        assert later.start >= earlier.start + earlier.e2e - 1e-3


async def test_open_loop_sends_at_the_rate_and_stops_at_the_time_limit(server: str) -> None:
    sessions = [(_spec(i, stream=False),) for i in range(500)]
    load = await run_open(HTTPTarget("t", server), sessions, 40.0, 1, LoadLimits(1.0, 5.0))
    assert 15 <= len(load.results) <= 70
    assert all(r.start < 1.0 for r in load.results)


async def test_direct_pd_target_forwards_the_prefill_handle(server: str) -> None:
    load = await run_closed(DirectPDTarget("d", server, server), [(_spec(),)], 1,
                            LoadLimits(10.0, 5.0))
    (result,) = load.results
    assert result.ok, result.error
    assert result.ttft is not None and result.ttft >= CONTENT_DELAY - 0.01


def test_the_heap_is_frozen_during_a_run_and_thawed_after() -> None:
    held = [[i] for i in range(1000)]  # objects alive before the run
    before = gc.get_freeze_count()
    with frozen_heap():
        assert gc.get_freeze_count() >= before + len(held)
    assert gc.get_freeze_count() == before
