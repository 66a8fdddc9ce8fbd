"""engine_sim as an OpenAI-compatible server (no KV store): the openai SDK against a real pod."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import openai
import pytest

from engine_sim.generation import expected_text
from tests.sim_tokens import chat_ids, prompt_ids

if TYPE_CHECKING:
    from conftest import SimPod

pytestmark = pytest.mark.integration

MESSAGES: list[Any] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Where is the capital of China?"},
]


@pytest.fixture(scope="module")
def pod(sim_pod_session: Callable[..., SimPod]) -> SimPod:
    return sim_pod_session("both", fast=True)


def client_for(pod: SimPod) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=pod.base_url + "/v1", api_key="x", max_retries=0)


async def post(pod: SimPod, path: str, body: Any, raw: bytes | None = None) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(pod.base_url + path, json=None if raw else body, data=raw) as response,
    ):
        return response.status, await response.json(content_type=None)


async def get_text(pod: SimPod, path: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(pod.base_url + path) as response:
        return response.status, await response.text()


async def test_chat_non_streaming(pod: SimPod) -> None:
    client = client_for(pod)
    raw = await client.chat.completions.with_raw_response.create(
        model=pod.model, messages=MESSAGES, max_tokens=7, extra_headers={"X-Request-Id": "rid-1"}
    )
    assert raw.headers["x-request-id"] == "rid-1"
    completion = raw.parse()
    prompt = chat_ids(MESSAGES)
    assert completion.id == "chatcmpl-rid-1"
    assert completion.choices[0].message.content == expected_text(
        prompt, 7, kv_from_store=False, model=pod.model
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(prompt)
    assert completion.usage.completion_tokens == 7
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 7


async def test_chat_streaming_with_usage(pod: SimPod) -> None:
    client = client_for(pod)
    stream = await client.chat.completions.create(
        model=pod.model,
        messages=MESSAGES,
        max_completion_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == expected_text(chat_ids(MESSAGES), 5, kv_from_store=False, model=pod.model)
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5


async def test_completions_prompt_shapes_and_default_length(pod: SimPod) -> None:
    client = client_for(pod)
    text = "Once upon a time"
    by_text = await client.completions.create(model=pod.model, prompt=text)
    by_ids = await client.completions.create(model=pod.model, prompt=prompt_ids(text))
    expected = expected_text(prompt_ids(text), 16, kv_from_store=False, model=pod.model)
    assert by_text.object == "text_completion"
    assert by_text.choices[0].text == by_ids.choices[0].text == expected
    assert by_text.usage is not None and by_text.usage.completion_tokens == 16


async def test_completions_streaming(pod: SimPod) -> None:
    client = client_for(pod)
    stream = await client.completions.create(
        model=pod.model, prompt=["one two three"], max_tokens=4, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert len(chunks) == 4 and chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks) == expected_text(
        prompt_ids("one two three"), 4, kv_from_store=False, model=pod.model
    )


async def test_errors_use_vllm_nested_shape(pod: SimPod) -> None:
    client = client_for(pod)
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model=pod.model, prompt="x", max_tokens=0)
    status, body = await post(pod, "/v1/chat/completions", None, raw=b"{not json")
    assert status == 400
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == 400 and body["error"]["type"] == "BadRequestError"
    status, body = await post(pod, "/v1/completions", {"prompt": ["a", "b"]})
    assert status == 400 and body["error"]["param"] == "prompt"


async def test_pd_request_without_store_is_refused(pod: SimPod) -> None:
    status, body = await post(
        pod,
        "/v1/completions",
        {"prompt": "x", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert status == 503 and "no KV store" in body["error"]["message"]


async def test_models_health_render_tokenize(pod: SimPod) -> None:
    models = await client_for(pod).models.list()
    assert [m.id for m in models.data] == [pod.model]
    assert (await get_text(pod, "/health")) == (200, "")
    body = {"model": pod.model, "messages": MESSAGES, "max_tokens": 20, "stream": False}
    status, rendered = await post(pod, "/v1/chat/completions/render", body)
    assert status == 200
    assert rendered["token_ids"] == (chat_ids(MESSAGES))
    assert rendered["sampling_params"]["max_tokens"] == 20
    status, rendered_list = await post(
        pod, "/v1/completions/render", {"model": pod.model, "prompt": "hi there"}
    )
    assert status == 200 and rendered_list[0]["token_ids"] == prompt_ids("hi there")
    status, tokens = await post(pod, "/tokenize", {"prompt": "hi there"})
    assert tokens["tokens"] == prompt_ids("hi there") and tokens["count"] == len(tokens["tokens"])


async def test_metrics_prefix_cache_and_stats(pod: SimPod) -> None:
    client = client_for(pod)
    prompt = f"{uuid.uuid4()} " + "shared context words " * 20
    for _ in range(2):
        await client.completions.create(model=pod.model, prompt=prompt, max_tokens=2)
    status, text = await get_text(pod, "/metrics")
    assert status == 200
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_success_total",
    ):
        assert f'{name}{{engine="0"' in text, name
    assert f'model_name="{pod.model}"' in text
    hits = [line for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total")]
    assert float(hits[0].rsplit(" ", 1)[1]) > 0
    async with aiohttp.ClientSession() as session:
        async with session.get(pod.base_url + "/sim/stats") as response:
            stats = await response.json()
    assert stats["role"] == "both" and stats["engine_id"] == pod.engine_id
    assert stats["requests"]["both"] >= 2 and stats["prefix_cache"]["hits"] > 0
    last = stats["recent"][-1]
    assert last["kind"] == "both" and last["kv_from_store"] is False and last["cached_tokens"] > 0


async def test_waiting_queue_and_latency(sim_pod: Callable[..., SimPod]) -> None:
    pod = sim_pod(
        "both", max_num_seqs=1, itl_ms=25, itl_per_running_ms=0, prefill_overhead_ms=0,
        prefill_per_token_ms=0,
    )  # fmt: skip
    client = client_for(pod)
    seen_waiting = 0.0

    async def watch() -> None:
        nonlocal seen_waiting
        while True:
            _, text = await get_text(pod, "/metrics")
            for line in text.splitlines():
                if line.startswith("vllm:num_requests_waiting{"):
                    seen_waiting = max(seen_waiting, float(line.rsplit(" ", 1)[1]))
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch())
    started = time.perf_counter()
    await asyncio.gather(
        *(client.completions.create(model=pod.model, prompt="x", max_tokens=5) for _ in range(3))
    )
    elapsed = time.perf_counter() - started
    watcher.cancel()
    assert seen_waiting >= 1
    assert elapsed >= 3 * 4 * 0.025  # one at a time, 4 gaps of 25 ms each
    assert pod.stop() == 0  # SIGTERM: clean exit
