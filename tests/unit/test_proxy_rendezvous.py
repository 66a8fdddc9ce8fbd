"""The concurrent PD rendezvous (`router.proxy._beside_prefill`): decode's response is
opened while its prefill runs; whichever way the wait ends, a decode response that came
in is either returned or closed, never dropped with its upstream connection held."""

from __future__ import annotations

import asyncio

import pytest

from kv_connectors.base import UpstreamError
from router.proxy import _beside_prefill, _finish_prefill


class _Response:
    """Stands for `router.http_client.Response`: only whether it was given back matters."""

    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


async def _open(head_in: asyncio.Event, response: _Response) -> _Response:
    await head_in.wait()
    return response


async def test_decode_answers_first_and_is_returned() -> None:
    response, head_in = _Response(), asyncio.Event()
    prefill = asyncio.get_running_loop().create_future()
    head_in.set()
    got = await _beside_prefill(_open(head_in, response), prefill)  # type: ignore[arg-type]
    assert got is response and response.closed == 0
    prefill.cancel()


async def test_prefill_failing_as_decode_answers_closes_decode() -> None:
    """Prefill fails in the loop turn decode's head comes in: the prefill's error is
    raised and decode's response is closed (it was left open, its connection busy)."""
    response, head_in = _Response(), asyncio.Event()

    async def prefill() -> None:
        await head_in.wait()
        raise UpstreamError("status_5xx", "prefill failed", retryable=True, phase="prefill")

    prefill_task = asyncio.ensure_future(prefill())
    asyncio.get_running_loop().call_soon(head_in.set)
    with pytest.raises(UpstreamError, match="prefill failed"):
        await _beside_prefill(_open(head_in, response), prefill_task)  # type: ignore[arg-type]
    assert response.closed == 1


async def test_request_ending_as_decode_answers_closes_decode() -> None:
    """The request is cancelled (client gone, deadline) in the loop turn decode's head
    comes in: decode's response is closed, not dropped."""
    response, head_in = _Response(), asyncio.Event()
    prefill = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(
        _beside_prefill(_open(head_in, response), prefill)  # type: ignore[arg-type]
    )
    await asyncio.sleep(0)  # waiting on both
    head_in.set()  # decode's head is in next turn ...
    waiting.cancel()  # ... the same turn the cancellation reaches the wait
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert response.closed == 1
    prefill.cancel()


async def test_request_ending_before_decode_answers_cancels_it() -> None:
    response, head_in = _Response(), asyncio.Event()
    prefill = asyncio.get_running_loop().create_future()
    opening = asyncio.ensure_future(_open(head_in, response))
    waiting = asyncio.ensure_future(_beside_prefill(opening, prefill))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert opening.cancelled() and response.closed == 0
    prefill.cancel()


async def test_finishing_a_prefill_keeps_the_requests_own_cancellation() -> None:
    """The request is cancelled while its cancelled prefill is still ending: the request's
    cancellation goes on up (it was swallowed, and the request went on as if not gone)."""
    ending = asyncio.Event()

    async def prefill() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await ending.wait()  # an engine call's clean-up takes a moment
            raise

    prefill_task = asyncio.ensure_future(prefill())
    await asyncio.sleep(0)
    went_on: list[str] = []

    async def request() -> None:
        await _finish_prefill(prefill_task)
        went_on.append("after the prefill")

    outer = asyncio.ensure_future(request())
    await asyncio.sleep(0)
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert went_on == []
    ending.set()
    with pytest.raises(asyncio.CancelledError):
        await prefill_task


async def test_finishing_a_failed_prefill_is_quiet() -> None:
    async def prefill() -> None:
        raise UpstreamError("status_5xx", "prefill failed", retryable=True, phase="prefill")

    prefill_task = asyncio.ensure_future(prefill())
    await asyncio.sleep(0)
    await _finish_prefill(prefill_task)  # handled elsewhere: nothing raised here
