"""The run-time tokenizer parity check and the precise scorer's fallback, on real processes.

One router (`python -m router serve`, file source) in front of simulated pods (the real
DeepSeek tokenizer), one aggregated ModelServer each, every profile scoring with
`precise-prefix-cache`:

- `good`: the router's tokenizer and template are the engine's: parity 1, precise index;
- `skewed`: the router is given a chat template the test writes, one word off the
  engine's: parity 0, a warning naming the server and the first differing position, the
  approximate index instead (`pdgate_precise_fallback{reason="parity-mismatch"}`);
- `bare`: no tokenizer at all, `broken`: a tokenizer directory that does not exist: an
  error in the router log, the fallback metric, requests still answered;
- `plain`: an engine without `/tokenize` (a small aiohttp server): parity -1, logged once.

And input-token rate limits charge the server's own token count when it has a tokenizer,
characters / 4 when it has none.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import openai
import pytest
from aiohttp import web

from engine_sim.prompts import DEFAULT_CHAT_TEMPLATE, DEFAULT_TOKENIZER
from tests.integration.harness import (
    SimCluster,
    SimPodSpec,
    free_port,
    metric_values,
    pd_server_manifests,
    pod_manifest,
    precise_scheduler,
    write_yaml,
)
from tests.polling import eventually as _eventually
from tests.sim_tokens import chat_ids

if TYPE_CHECKING:
    from conftest import SimPod

pytestmark = pytest.mark.integration
#: The parity check probes on its own interval: wait up to 30 s, looking every 0.1 s.
eventually = functools.partial(_eventually, within=30.0, interval=0.1)

SERVERS = ("good", "skewed", "bare", "broken", "plain")
SCHEDULER = precise_scheduler(load_weight=1.0)
SYSTEM = "You answer questions about caches. " * 40  # ~280 tokens: several blocks
INPUT_LIMIT = 100
#: 120 CJK characters: 30 "tokens" at 4 characters a token, well over 100 real tokens.
CJK_PROMPT = "東京大阪名古屋札幌福岡" * 12


@dataclass
class Parity:
    cluster: SimCluster
    workdir: Path

    def metrics(self) -> str:
        return self.cluster.router_metrics()

    def value(self, name: str, **labels: str) -> float | None:
        want = [f'{k}="{v}"' for k, v in labels.items()]
        for head, value in metric_values(self.metrics(), name):
            if all(w in head for w in want):
                return value
        return None

    def log(self) -> str:
        assert self.cluster.router is not None
        return self.cluster.router.log()

    def client(self) -> openai.AsyncOpenAI:
        return self.cluster.client()


class NoTokenizeEngine:
    """An engine that answers chat but has no `/tokenize` (404), like a non-vLLM one."""

    def __init__(self) -> None:
        self.port = free_port()
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({
            "id": "chatcmpl-plain", "object": "chat.completion", "created": int(time.time()),
            "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "plain"}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        })  # fmt: skip


def skewed_template(workdir: Path) -> Path:
    """The engine's template with one word more after the BOS: tokens differ at 1."""
    text = DEFAULT_CHAT_TEMPLATE.read_text(encoding="utf-8")
    marker = "{{- bos_token -}}"
    assert marker in text
    path = workdir / "skewed.jinja"
    path.write_text(text.replace(marker, marker + "{{- 'Note: ' -}}", 1), encoding="utf-8")
    return path


def route_with_limit(name: str, model: str) -> dict[str, Any]:
    return {
        "apiVersion": "networking.serving.volcano.sh/v1alpha1", "kind": "ModelRoute",
        "metadata": {"name": f"{name}-limited", "namespace": "default"},
        "spec": {
            "modelName": f"{model}-limited",
            "rules": [{"name": "default", "targetModels": [{"modelServerName": name}]}],
            "rateLimit": {"inputTokensPerUnit": INPUT_LIMIT, "unit": "hour"},
        },
    }  # fmt: skip


@pytest.fixture(scope="module")
async def plain_engine() -> AsyncIterator[NoTokenizeEngine]:
    engine = NoTokenizeEngine()
    await engine.start()
    yield engine
    await engine.stop()


@pytest.fixture(scope="module")
def parity(
    sim_pod_session: Callable[..., SimPod],
    plain_engine: NoTokenizeEngine,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Parity]:
    workdir = tmp_path_factory.mktemp("parity")
    cluster = SimCluster(None, workdir)
    template = str(DEFAULT_CHAT_TEMPLATE)
    notes: dict[str, dict[str, str]] = {
        "good": {"pdgate.io/tokenizer": DEFAULT_TOKENIZER, "pdgate.io/chat-template": template},
        "skewed": {"pdgate.io/tokenizer": DEFAULT_TOKENIZER,
                   "pdgate.io/chat-template": str(skewed_template(workdir))},
        "bare": {},
        "broken": {"pdgate.io/tokenizer": str(workdir / "no-such-tokenizer")},
        "plain": {"pdgate.io/tokenizer": DEFAULT_TOKENIZER, "pdgate.io/chat-template": template},
    }  # fmt: skip
    docs: list[dict[str, object]] = []
    for name in SERVERS:
        model = f"m-{name}"
        if name == "plain":
            port = plain_engine.port
            events = "0"
        else:
            events_port = free_port()
            pod = sim_pod_session("both", model, fast=True, kv_events_port=events_port,
                                  kv_events_replay_port=0)
            port, events = pod.port, str(events_port)
        annotations = {**notes[name], "pdgate.io/kv-events-port": events,
                       "pdgate.io/kv-events-replay-port": "0"}
        made = pd_server_manifests(name, model, pd=False, port=port, connector="http",
                                   annotations=annotations)
        made[1]["spec"]["model"] = model  # type: ignore[index]  # limited routes send it
        docs += made
        docs.append(pod_manifest(SimPodSpec(f"{name}-0", "127.0.0.1", "both",
                                            labels={"app": name})))
    docs.append(route_with_limit("good", "m-good"))
    docs.append(route_with_limit("bare", "m-bare"))
    write_yaml(cluster.config_dir / "objects.yaml", docs)
    scheduler = workdir / "scheduler.yaml"
    scheduler.write_text(SCHEDULER)
    cluster.start_router(["--scheduler-config", str(scheduler)])
    try:
        yield Parity(cluster, workdir)
    finally:
        cluster.stop()


def messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


async def test_same_tokenizer_parity_1_and_precise_scoring(parity: Parity) -> None:
    await eventually(lambda: parity.value("pdgate_tokenizer_parity", server="good") == 1.0)
    for reason in ("no-tokenizer", "tokenizer-error", "tokenizer-loading", "parity-mismatch"):
        assert parity.value("pdgate_precise_fallback", server="good", reason=reason) == 0.0
    assert parity.value("pdgate_tokenizer_parity_mismatches_total", server="good") is None
    before = parity.value("pdgate_prefix_cache_queries_total", index="precise") or 0.0
    client = parity.client()
    for i in range(3):
        answer = await client.chat.completions.create(
            model="m-good", messages=messages(f"question {i}"), max_tokens=2)  # type: ignore[arg-type]
        assert answer.choices[0].message.content
        await asyncio.sleep(0.3)  # the engine's KV events reach the index
    after = parity.value("pdgate_prefix_cache_queries_total", index="precise") or 0.0
    blocks = len(chat_ids(messages("question 0"))) // 16
    assert after - before >= 3 * blocks
    # The engine's own KV events: the shared system prompt hit for the later requests.
    assert (parity.value("pdgate_prefix_cache_hits_total", index="precise") or 0.0) > 0


async def test_different_chat_template_mismatch_warns_and_falls_back(parity: Parity) -> None:
    await eventually(lambda: parity.value("pdgate_tokenizer_parity", server="skewed") == 0.0)
    assert (parity.value("pdgate_tokenizer_parity_mismatches_total", server="skewed") or 0) >= 1
    assert parity.value("pdgate_precise_fallback", server="skewed",
                        reason="parity-mismatch") == 1.0
    log = parity.log()
    warnings = [line for line in log.splitlines()
                if "default/skewed" in line and "disagrees with the engine" in line]
    assert len(warnings) == 1, log  # one per transition
    assert "chat probe: first difference at token position 1 " in warnings[0]
    approx_before = parity.value("pdgate_prefix_cache_queries_total", index="approximate") or 0
    precise_before = parity.value("pdgate_prefix_cache_queries_total", index="precise") or 0
    client = parity.client()
    for i in range(2):
        answer = await client.chat.completions.create(
            model="m-skewed", messages=messages(f"skewed {i}"), max_tokens=2)  # type: ignore[arg-type]
        assert answer.choices[0].message.content
    assert (parity.value("pdgate_prefix_cache_queries_total", index="approximate") or 0) > (
        approx_before)
    assert parity.value("pdgate_prefix_cache_queries_total", index="precise") == precise_before
    # The shared system prompt hits in the approximate index on the second request.
    assert (parity.value("pdgate_prefix_cache_hits_total", index="approximate") or 0) > 0


@pytest.mark.parametrize(("server", "reason", "logged"), [
    ("bare", "no-tokenizer", "names no tokenizer (annotation pdgate.io/tokenizer)"),
    ("broken", "tokenizer-error", "no-such-tokenizer' unavailable"),
])  # fmt: skip
async def test_missing_tokenizer_logs_an_error_and_falls_back(
    parity: Parity, server: str, reason: str, logged: str
) -> None:
    await eventually(
        lambda: parity.value("pdgate_precise_fallback", server=server, reason=reason) == 1.0)
    lines = [line for line in parity.log().splitlines()
             if f"default/{server}" in line and logged in line]
    assert len(lines) == 1 and "ERROR" in lines[0], parity.log()
    client = parity.client()
    answer = await client.chat.completions.create(
        model=f"m-{server}", messages=messages("still served?"), max_tokens=2)  # type: ignore[arg-type]
    assert answer.choices[0].message.content
    assert parity.cluster.router is not None and parity.cluster.router.alive()


async def test_engine_without_tokenize_is_unknown_not_a_mismatch(parity: Parity) -> None:
    await eventually(lambda: "does not serve /tokenize (404)" in parity.log())
    assert parity.value("pdgate_tokenizer_parity", server="plain") == -1.0
    assert parity.value("pdgate_precise_fallback", server="plain",
                        reason="parity-mismatch") == 0.0
    assert parity.value("pdgate_tokenizer_parity_mismatches_total", server="plain") is None
    assert parity.log().count("does not serve /tokenize (404)") == 1
    answer = await parity.client().chat.completions.create(
        model="m-plain", messages=messages("hi"), max_tokens=2)  # type: ignore[arg-type]
    assert answer.choices[0].message.content == "plain"


async def test_input_rate_limit_counts_the_servers_own_tokens(parity: Parity) -> None:
    """120 CJK characters: 30 tokens at 4 characters a token, more than 100 for real."""
    await eventually(lambda: parity.value("pdgate_tokenizer_parity", server="good") == 1.0)
    body = [{"role": "user", "content": CJK_PROMPT}]
    real = len(chat_ids(body))
    assert real > INPUT_LIMIT >= len(CJK_PROMPT) // 4
    client = parity.client()
    with pytest.raises(openai.RateLimitError) as refused:
        await client.chat.completions.create(
            model="m-good-limited", messages=body, max_tokens=2)  # type: ignore[arg-type]
    assert f"the prompt's ~{real} tokens exceed the limit of {INPUT_LIMIT}" in str(
        refused.value)
    # Without a tokenizer the estimate stays characters / 4: the same prompt fits.
    answer = await client.chat.completions.create(
        model="m-bare-limited", messages=body, max_tokens=2)  # type: ignore[arg-type]
    assert answer.choices[0].message.content
    # A prompt within the limit by the real count is admitted and answered.
    small = [{"role": "user", "content": "東京"}]
    assert len(chat_ids(small)) < INPUT_LIMIT
    answer = await client.chat.completions.create(
        model="m-good-limited", messages=small, max_tokens=2)  # type: ignore[arg-type]
    assert answer.choices[0].message.content
