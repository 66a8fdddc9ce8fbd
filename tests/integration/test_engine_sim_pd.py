"""Prefill and decode pods moving KV through a real Mooncake master and store."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import openai
import pytest

from engine_sim.block_hash import hash_prompt_blocks
from engine_sim.generation import expected_text
from engine_sim.kv_blocks import store_key
from engine_sim.kv_params import STORE_KEYS_FIELD
from tests.sim_tokens import chat_ids, prompt_ids

if TYPE_CHECKING:
    from conftest import SimPod

pytestmark = pytest.mark.integration

NULL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@pytest.fixture(scope="module")
def pods(sim_pod_session: Callable[..., SimPod]) -> tuple[SimPod, SimPod]:
    return sim_pod_session("prefill", fast=True), sim_pod_session("decode", fast=True)


def messages() -> list[Any]:
    text = f"Request {uuid.uuid4()}: where is the capital of China, and what is its history?"
    return [{"role": "user", "content": text}]


async def post(
    pod: SimPod, path: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(pod.base_url + path, json=body, headers=headers) as response,
    ):
        return response.status, await response.json(content_type=None)


async def stats(pod: SimPod) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(pod.base_url + "/sim/stats") as r:
        result: dict[str, Any] = await r.json()
        return result


async def prefill_chat(prefill: SimPod, msgs: list[dict[str, Any]]) -> dict[str, Any]:
    body = {
        "model": prefill.model, "messages": msgs, "stream": False, "max_tokens": 1,
        "min_tokens": 1, "kv_transfer_params": NULL_PARAMS,
    }  # fmt: skip
    status, answer = await post(prefill, "/v1/chat/completions", body, {"X-Request-Id": "pd-1"})
    assert status == 200, answer
    params: dict[str, Any] = answer["kv_transfer_params"]
    return params


async def test_decode_uses_prefill_kv_from_the_store(pods: tuple[SimPod, SimPod]) -> None:
    prefill, decode = pods
    msgs = messages()
    prompt = chat_ids(msgs)
    hashes = hash_prompt_blocks(prompt)
    assert len(hashes) >= 2
    before = await stats(prefill)
    params = await prefill_chat(prefill, msgs)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == prefill.engine_id
    # vLLM's NIXL side channel (VLLM_NIXL_SIDE_CHANNEL_HOST / _PORT unset), not HTTP's.
    assert params["remote_host"] == "localhost" and params["remote_port"] == 5600
    assert params["remote_request_id"].startswith("chatcmpl-pd-1-")
    assert params["remote_num_tokens"] == len(prompt) and params["tp_size"] == 1
    assert len(params["remote_block_ids"]) == len(hashes)
    assert params[STORE_KEYS_FIELD] == [store_key(prefill.model, h) for h in hashes]
    after = await stats(prefill)
    assert after["kv_blocks_written"] - before["kv_blocks_written"] == len(hashes)

    client = openai.AsyncOpenAI(base_url=decode.base_url + "/v1", api_key="x", max_retries=0)
    completion = await client.chat.completions.create(
        model=decode.model, messages=msgs, max_tokens=12, extra_body={"kv_transfer_params": params}
    )
    from_store = expected_text(prompt, 12, kv_from_store=True, model=decode.model)
    assert completion.choices[0].message.content == from_store
    assert from_store != expected_text(prompt, 12, kv_from_store=False, model=decode.model)
    record = (await stats(decode))["recent"][-1]
    assert record["kind"] == "decode" and record["kv_from_store"] is True
    assert record["blocks"] == len(hashes)

    # The same prompt again: prefill finds every block already in the store.
    await prefill_chat(prefill, msgs)
    again = await stats(prefill)
    assert again["kv_blocks_write_skipped"] - after["kv_blocks_write_skipped"] == len(hashes)
    assert again["kv_blocks_written"] == after["kv_blocks_written"]


async def test_streaming_completion_decode_and_short_prompt(pods: tuple[SimPod, SimPod]) -> None:
    prefill, decode = pods
    client = openai.AsyncOpenAI(base_url=decode.base_url + "/v1", api_key="x", max_retries=0)
    for prompt in (f"{uuid.uuid4()} " * 8, "tiny prompt"):
        status, answer = await post(
            prefill,
            "/v1/completions",
            {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": NULL_PARAMS},
        )
        assert status == 200
        params = answer["kv_transfer_params"]
        assert len(params["remote_block_ids"]) == len(prompt_ids(prompt)) // 16
        stream = await client.completions.create(
            model=decode.model, prompt=prompt, max_tokens=6, stream=True,
            extra_body={"kv_transfer_params": params},
        )  # fmt: skip
        text = "".join([chunk.choices[0].text async for chunk in stream])
        assert text == expected_text(
            prompt_ids(prompt), 6, kv_from_store=True, model=decode.model
        )


async def test_incomplete_params_prefill_locally(pods: tuple[SimPod, SimPod]) -> None:
    _, decode = pods
    msgs = messages()
    params = {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "eng-prefill",
        "remote_block_ids": None, "remote_host": "127.0.0.1", "remote_port": 7777,
    }  # fmt: skip
    status, answer = await post(
        decode,
        "/v1/chat/completions",
        {"messages": msgs, "max_tokens": 4, "kv_transfer_params": params},
    )
    assert status == 200
    expected = expected_text(chat_ids(msgs), 4, kv_from_store=False, model=decode.model)
    assert answer["choices"][0]["message"]["content"] == expected
    record = (await stats(decode))["recent"][-1]
    assert record["kind"] == "decode" and record["kv_from_store"] is False


async def test_bogus_or_missing_kv_fails_clearly(pods: tuple[SimPod, SimPod]) -> None:
    prefill, decode = pods
    msgs = messages()
    params = await prefill_chat(prefill, msgs)
    body = {"messages": msgs, "max_tokens": 4}
    bogus = {**params, STORE_KEYS_FIELD: ["engine_sim/kv/v1/nope/0000000000000000"]}
    status, answer = await post(
        decode, "/v1/chat/completions", {**body, "kv_transfer_params": bogus}
    )
    assert status == 500
    assert answer["error"]["code"] == 500 and answer["error"]["type"] == "InternalServerError"
    assert "not block 0 of this prompt" in answer["error"]["message"]

    # Keys that belong to this prompt but were never written (no prefill ran for it).
    other = messages()
    keys = [store_key(decode.model, h) for h in hash_prompt_blocks(chat_ids(other))]
    missing = {**params, STORE_KEYS_FIELD: keys}
    status, answer = await post(
        decode,
        "/v1/chat/completions",
        {"messages": other, "max_tokens": 4, "kv_transfer_params": missing},
    )
    assert status == 503 and "is not in the store" in answer["error"]["message"]
    assert (await stats(decode))["recent"][-1]["error"] == "missing"
    # The pod's log says why, as an engine logs a failed KV load (a 5xx the router retried
    # is otherwise visible nowhere but in its counters).
    assert "KV transfer failed (missing)" in decode.log_tail()
    assert "KV transfer failed (wrong_prompt)" in decode.log_tail()


def test_store_backed_pod_stops_cleanly(sim_pod: Callable[..., SimPod]) -> None:
    pod = sim_pod("decode", fast=True)
    assert pod.stop() == 0  # SIGTERM: the store is closed and the process exits 0
