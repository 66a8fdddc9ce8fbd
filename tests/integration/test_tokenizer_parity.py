"""Router tokens == engine tokens: the router's `ModelTokenizer` (loaded from a ModelServer's
annotations, as `pdgate serve` does) against a running simulator's vLLM `/tokenize`, with
the real DeepSeek tokenizer on both sides."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from router.tokenization import ModelTokenizer, TokenizerRegistry
from router.view import ServerPods, Snapshot
from tests.sim_tokens import sim_server

if TYPE_CHECKING:
    from conftest import SimPod

pytestmark = pytest.mark.integration

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
]  # fmt: skip
MULTI_TURN = [
    {"role": "system", "content": "You are a terse assistant. Answer in one line."},
    {"role": "system", "content": "Never use emoji."},
    {"role": "user", "content": "What's the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 18}"},
    {"role": "assistant", "content": "18 °C in Paris."},
    {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"},
                                 {"type": "text", "text": "Also: 東京?"}]},
]  # fmt: skip


@pytest.fixture(scope="module")
def pod(sim_pod_session: Callable[..., SimPod]) -> SimPod:
    return sim_pod_session("both", fast=True)


@pytest.fixture(scope="module")
def router_tokenizer() -> ModelTokenizer:
    """Loaded the way the router loads it: from the ModelServer's annotations."""
    server = sim_server()
    registry = TokenizerRegistry()
    registry.on_snapshot(Snapshot(servers={server.meta.key: ServerPods(server)}))
    tokenizer = registry.get(server)
    assert tokenizer is not None, registry.error(server)
    return tokenizer


async def tokenize(pod: SimPod, body: dict[str, Any], path: str = "/tokenize") -> Any:
    async with (
        aiohttp.ClientSession() as session,
        session.post(pod.base_url + path, json=body) as response,
    ):
        assert response.status == 200, await response.text()
        return await response.json()


def long_prompt(tokens: int) -> str:
    rng = random.Random(8)
    words = ("cache", "prefix", "router", "décode", "引擎", "token", "42", "KV", "block,")
    return " ".join(rng.choice(words) for _ in range(tokens))


CHATS: dict[str, dict[str, Any]] = {
    "multi-turn-system-tools-parts": {"messages": MULTI_TURN, "tools": TOOLS},
    "no-generation-prompt": {"messages": MULTI_TURN[:6], "add_generation_prompt": False},
    "continue-final-message": {
        "messages": [*MULTI_TURN[:3], {"role": "assistant", "content": "It is "}],
        "add_generation_prompt": False, "continue_final_message": True,
    },
    "add-special-tokens": {"messages": MULTI_TURN[2:3], "add_special_tokens": True},
    "long-8k": {"messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": long_prompt(8000)}]},
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CHATS))
async def test_chat_tokens_equal_the_engines(
    name: str, pod: SimPod, router_tokenizer: ModelTokenizer
) -> None:
    body = CHATS[name]
    engine = await tokenize(pod, {"model": pod.model, **body, "return_token_strs": True})
    mine = list(router_tokenizer.chat_ids(body))
    assert engine["tokens"] == mine
    assert engine["count"] == len(mine) and engine["max_model_len"] > 0
    assert engine["token_strs"] == router_tokenizer.token_strs(mine)
    if name == "long-8k":
        assert len(mine) > 8000


async def test_completion_tokens_equal_the_engines(
    pod: SimPod, router_tokenizer: ModelTokenizer
) -> None:
    text = "Once upon a time, in 東京, " + long_prompt(300)
    engine = await tokenize(pod, {"prompt": text})
    assert engine["tokens"] == list(router_tokenizer.completion_ids(text)[0])
    assert engine["token_strs"] is None
    no_special = await tokenize(pod, {"prompt": text, "add_special_tokens": False})
    assert no_special["tokens"] == list(router_tokenizer.completion_ids(text, False)[0])
    # Token-id prompts pass through; the engine's usage counts the same tokens.
    ids = engine["tokens"]
    assert router_tokenizer.completion_ids(ids) == [tuple(ids)]
    async with aiohttp.ClientSession() as session:
        for prompt in (text, ids):
            async with session.post(pod.base_url + "/v1/completions", json={
                "model": pod.model, "prompt": prompt, "max_tokens": 2,
            }) as response:  # fmt: skip
                answer = await response.json()
            assert answer["usage"]["prompt_tokens"] == len(ids)
    # A batch: one token list per prompt.
    assert router_tokenizer.completion_ids([text, ids]) == [tuple(ids), tuple(ids)]


async def test_render_and_detokenize_use_the_real_tokens(
    pod: SimPod, router_tokenizer: ModelTokenizer
) -> None:
    body = {"model": pod.model, "messages": MULTI_TURN, "tools": TOOLS}
    async with aiohttp.ClientSession() as session:
        async with session.post(pod.base_url + "/v1/chat/completions/render", json=body) as r:
            rendered = await r.json()
    ids = list(router_tokenizer.chat_ids(body))
    assert rendered["token_ids"] == ids
    text = (await tokenize(pod, {"tokens": ids}, "/detokenize"))["prompt"]
    assert text == router_tokenizer.render_chat(MULTI_TURN, tools=TOOLS)


async def test_bad_tokenize_requests_get_vllm_errors(pod: SimPod) -> None:
    async with aiohttp.ClientSession() as session:
        for body, status in (
            ({"messages": MULTI_TURN, "add_generation_prompt": True,
              "continue_final_message": True}, 400),
            ({"prompt": "x", "model": "other"}, 404),
            ({"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://x/1.png"}}]}]}, 400),
            ({"prompt": [1, 2]}, 400),
        ):  # fmt: skip
            async with session.post(pod.base_url + "/tokenize", json=body) as response:
                answer = await response.json()
                assert response.status == status, answer
                assert answer["error"]["code"] == status
