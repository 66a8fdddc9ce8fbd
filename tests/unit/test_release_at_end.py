"""A request stops counting on its pods as its answer ends, not when the engine's
connection reaches EOF after it.

The client that has read `[DONE]` may ask again at once; the pick of that request (or the
sync leader's placement of another router's) must see the pods as they are. An engine
can close its stream some time after `[DONE]` (the relay reads on to EOF), and on a busy
machine that gap once made two peered routers' leader place both prompts of a pair on one
pod (`tests/integration/test_scale_out.py::test_two_replicas_place_new_prompts_as_one_process`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from router.app import PDGateApp
from router.request import CHAT_PATH
from router.resources import parse_object
from router.state import AppState, RouterConfig
from tests.unit.test_fuzz import MODEL, StubUpstream, call, cluster_objects

CHUNKS = [b'data: {"choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n',
          b'data: {"choices":[],"usage":{"completion_tokens":1}}\n\n', b"data: [DONE]\n\n"]


class HeldResponse:
    """A stream whose engine keeps the connection open after `[DONE]` until `eof` is set."""

    def __init__(self, stream: bool, eof: asyncio.Event) -> None:
        self.status = 200
        self.stream = stream
        self.headers = {"content-type": "text/event-stream" if stream else "application/json"}
        self._chunks = list(CHUNKS)
        self._eof = eof

    async def readany(self) -> bytes:
        if self._chunks:
            return self._chunks.pop(0)
        await self._eof.wait()
        return b""

    async def read(self, limit: int) -> bytes:
        await asyncio.sleep(0)
        return orjson.dumps({"choices": [{"index": 0, "message": {"content": "ok"}}],
                             "usage": {"completion_tokens": 1}})

    def close(self) -> None:
        pass

    def release(self) -> None:
        pass


class HeldUpstream(StubUpstream):
    def __init__(self) -> None:
        self.eof = asyncio.Event()

    async def open(self, pod: Any, path: str, body: bytes, headers: Any, deadline: float,
                   phase: str) -> HeldResponse:  # type: ignore[override]
        return HeldResponse(bool(orjson.loads(body).get("stream")), self.eof)


async def _in_flight_as_the_end_is_sent(stream: bool) -> tuple[int, int]:
    """(requests in flight when the client is sent the answer's last bytes, after)."""
    state = AppState(RouterConfig())
    for raw in cluster_objects():
        state.view.apply(parse_object(raw))
    upstream = HeldUpstream()
    state.proxy.upstream = upstream  # type: ignore[assignment]
    seen: list[int] = []
    body = orjson.dumps({"model": MODEL, "stream": stream, "max_tokens": 2,
                         "messages": [{"role": "user", "content": "hello"}]})

    def on_send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body"):
            seen.append(state.inflight.total())  # the client can read the end from here on
            asyncio.get_running_loop().call_later(0.05, upstream.eof.set)

    await asyncio.wait_for(call(PDGateApp(state), "POST", CHAT_PATH,
                                [(b"content-type", b"application/json")], body, on_send), 5)
    assert len(seen) == 1, seen
    return seen[0], state.inflight.total()


def test_a_stream_counts_on_its_pods_no_more_once_its_end_goes_out() -> None:
    assert asyncio.run(_in_flight_as_the_end_is_sent(stream=True)) == (0, 0)


def test_a_whole_answer_counts_on_its_pods_no_more_once_it_goes_out() -> None:
    assert asyncio.run(_in_flight_as_the_end_is_sent(stream=False)) == (0, 0)
