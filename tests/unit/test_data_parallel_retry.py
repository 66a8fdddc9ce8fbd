"""A data-parallel pod whose API server cannot be reached is avoided for all its ranks.

Two aggregated pods of two ranks each; pod a's server refuses connections. Pod b's ranks
carry a request in flight each, so the first pick is a rank of pod a, which fails to
connect; the retry must then go to pod b, not to pod a's other rank (behind the same dead
server, and the least loaded target left). And each such failure counts against both of
pod a's ranks, so the pod is ejected whole after the threshold's failures, not one rank
after that many and the other after as many more.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from kv_connectors.base import UpstreamError
from router.app import PDGateApp
from router.request import CHAT_PATH
from router.resources import parse_object
from router.state import AppState, RouterConfig
from tests.unit.test_fuzz import StubResponse, StubUpstream, call

MODEL = "m-dp"
API = "networking.serving.volcano.sh/v1alpha1"


def _objects() -> list[dict[str, Any]]:
    pods = [
        {"apiVersion": "v1", "kind": "Pod",
         "metadata": {"name": name, "namespace": "default", "labels": {"app": "dp"}},
         "status": {"phase": "Running", "podIP": ip,
                    "conditions": [{"type": "Ready", "status": "True"}]}}
        for name, ip in (("a", "10.0.0.1"), ("b", "10.0.0.2"))
    ]
    return [
        {"apiVersion": API, "kind": "ModelRoute",
         "metadata": {"name": "dp", "namespace": "default"},
         "spec": {"modelName": MODEL,
                  "rules": [{"name": "r", "targetModels": [{"modelServerName": "dp"}]}]}},
        {"apiVersion": API, "kind": "ModelServer",
         "metadata": {"name": "dp", "namespace": "default",
                      "annotations": {"pdgate.io/data-parallel-size": "2"}},
         "spec": {"inferenceEngine": "vLLM", "workloadPort": {"port": 8000},
                  "workloadSelector": {"matchLabels": {"app": "dp"}},
                  "trafficPolicy": {"retry": {"attempts": 3, "retryInterval": "1ms"}}}},
        *pods,
    ]  # fmt: skip


class DeadPodA(StubUpstream):
    def __init__(self) -> None:
        self.tried: list[str] = []

    async def open(self, pod: Any, path: str, body: bytes, headers: Any, deadline: float,
                   phase: str) -> StubResponse:
        self.tried.append(pod.key)
        if pod.ip == "10.0.0.1":
            raise UpstreamError("connect", "Could not reach the engine.", retryable=True,
                                pod=pod, phase=phase)
        return await super().open(pod, path, body, headers, deadline, phase)


def _state() -> tuple[AppState, DeadPodA]:
    state = AppState(RouterConfig())
    for raw in _objects():
        state.view.apply(parse_object(raw))
    upstream = DeadPodA()
    state.proxy.upstream = upstream  # type: ignore[assignment]
    targets = state.view.snapshot.endpoints()
    for key in ("default/b/dp0", "default/b/dp1"):
        state.inflight.acquire(targets[key])
    return state, upstream


async def _serve(state: AppState) -> int:
    body = orjson.dumps({"model": MODEL, "max_tokens": 2,
                         "messages": [{"role": "user", "content": "hello"}]})
    status, _ = await asyncio.wait_for(call(PDGateApp(state), "POST", CHAT_PATH, [
        (b"content-type", b"application/json")], body), 5)
    return status


def test_a_retry_leaves_every_rank_behind_an_unreachable_server() -> None:
    state, upstream = _state()
    assert asyncio.run(_serve(state)) == 200
    tried = upstream.tried
    assert len(tried) == 2 and tried[0].startswith("default/a/"), tried
    assert tried[1].startswith("default/b/"), tried


def test_an_unreachable_data_parallel_pod_is_ejected_whole() -> None:
    state, upstream = _state()
    threshold = state.config.resilience.consecutive_failures
    dead = {"default/a/dp0", "default/a/dp1"}

    async def serve_until_ejected() -> list[int]:
        statuses = []
        for _ in range(2 * threshold):
            statuses.append(await _serve(state))
            if dead <= state.proxy.outliers.ejected:
                break
        statuses.append(await _serve(state))  # after the ejection: straight to pod b
        return statuses

    statuses = asyncio.run(serve_until_ejected())
    assert statuses == [200] * (threshold + 1), statuses
    assert state.proxy.outliers.ejected == dead
    tried_a = [key for key in upstream.tried if key.startswith("default/a/")]
    assert len(tried_a) == threshold, upstream.tried
    assert upstream.tried[-1].startswith("default/b/"), upstream.tried
