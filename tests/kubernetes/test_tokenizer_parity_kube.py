"""With the Kubernetes source, a tokenizer mismatch is a Warning Event on the ModelServer.

Fake API server, real client, the router's state running in this event loop, one simulated
pod (real DeepSeek tokenizer). The ModelServer's `pdgate.io/chat-template` names a template
the test writes, one word off the engine's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fake_apiserver import FakeApiServer
from kube_objects import model_route, model_server, pod
from kube_testkit import FAST_EVENTS, FAST_TIMING, wait_until
from prometheus_client import CollectorRegistry

from engine_sim.prompts import DEFAULT_CHAT_TEMPLATE, DEFAULT_TOKENIZER
from router.sources.kubernetes import KubernetesSource
from router.state import AppState, RouterConfig

if TYPE_CHECKING:
    from conftest import SimPod

SERVER = "skewed-tokens"
MODEL = "deepseek_v4"


def mismatch_events(api: FakeApiServer) -> list[dict[str, Any]]:
    return [e for e in api.events if e.get("reason") == "TokenizerMismatch"]


async def test_mismatch_posts_a_warning_event_on_the_model_server(
    sim_pod: Callable[..., SimPod], tmp_path: Path
) -> None:
    engine = sim_pod("both", MODEL, fast=True, kv_events_port=0, kv_events_replay_port=0)
    template = tmp_path / "skewed.jinja"
    marker = "{{- bos_token -}}"
    template.write_text(
        DEFAULT_CHAT_TEMPLATE.read_text(encoding="utf-8").replace(
            marker, marker + "{{- 'Note: ' -}}", 1),
        encoding="utf-8",
    )
    api = FakeApiServer(bookmark_interval=0.5)
    await api.start()
    server = model_server(SERVER, pd=False, port=engine.port)
    server["metadata"]["annotations"] = {
        "pdgate.io/tokenizer": DEFAULT_TOKENIZER,
        "pdgate.io/chat-template": str(template),
    }
    api.create(model_route("route", MODEL, [SERVER]))
    created = api.create(server)
    api.create(pod("engine-0", SERVER, role=None, ip="127.0.0.1"))
    source = KubernetesSource(
        "default", str(api.write_kubeconfig(tmp_path / "kubeconfig")), CollectorRegistry(),
        timing=FAST_TIMING, event_limits=FAST_EVENTS,
    )
    state = AppState(RouterConfig(extra_sources=[source]))
    await state.start()
    try:
        await wait_until(lambda: bool(mismatch_events(api)), within_s=30)
        [event] = mismatch_events(api)
        involved = event["involvedObject"]
        assert involved["kind"] == "ModelServer" and involved["name"] == SERVER
        assert involved["namespace"] == "default"
        assert involved["uid"] == created["metadata"]["uid"]
        assert event["type"] == "Warning"
        assert "first difference at token position 1 " in event["message"]
        assert f"default/{SERVER}" in event["message"]
        key = ("default", SERVER)
        assert state.scheduler_runtime.parity.status(key) == "mismatch"
        assert state.scheduler_runtime.fallback.reason(
            state.view.snapshot.servers[key].server) == "parity-mismatch"
        assert engine.process.poll() is None
    finally:
        await state.stop()
        await api.stop()
