"""The request body as the router checks it before any pod is chosen: the shapes of a
completion's `prompt`, and the fields a client may not set."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from router.errors import APIError
from router.request import CHAT_PATH, COMPLETIONS_PATH, parse_request


@pytest.mark.parametrize("prompt", [[2**40], [-1], [True], [1, "a"], ["a", 1], [[1], 2],
                                    [[1, 2**31]], [1.0], [None]])
def test_a_prompt_of_token_ids_out_of_range_or_mixed_is_a_400(prompt: list[Any]) -> None:
    raw = orjson.dumps({"model": "m", "prompt": prompt})
    with pytest.raises(APIError) as caught:
        parse_request(COMPLETIONS_PATH, raw)
    assert caught.value.status == 400 and caught.value.param == "prompt"


@pytest.mark.parametrize("prompt", ["a", ["a", ""], [0, 2**31 - 1], [[1, 2], [3]], [[]]])
def test_every_prompt_shape_engines_take_passes(prompt: Any) -> None:
    assert parse_request(COMPLETIONS_PATH, orjson.dumps({"model": "m", "prompt": prompt}))


@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETIONS_PATH])
def test_a_clients_kv_transfer_params_never_reach_an_engine(path: str) -> None:
    fields = ({"messages": [{"role": "user", "content": "hi"}]} if path == CHAT_PATH
              else {"prompt": "hi"})
    handle = {"do_remote_prefill": True, "remote_host": "10.0.0.1", "remote_block_ids": [7]}
    parsed = parse_request(path, orjson.dumps({"model": "m", **fields,
                                               "kv_transfer_params": handle}))
    assert "kv_transfer_params" not in parsed.body  # every path forwards this body


def test_a_body_that_is_not_utf8_is_called_so() -> None:
    with pytest.raises(APIError) as caught:
        parse_request(CHAT_PATH, b'{"model": "m", "messages": "\xff"}')
    assert caught.value.status == 400 and "not UTF-8 text" in caught.value.message


@pytest.mark.parametrize(("path", "field"), [("/v1/embeddings", "input"),
                                             ("/detokenize", "tokens")])
@pytest.mark.parametrize("ids", [[2**31], [-1], [True], [1.0]])
def test_token_ids_elsewhere_are_held_to_the_same_range(
    path: str, field: str, ids: list[Any]
) -> None:
    with pytest.raises(APIError) as caught:
        parse_request(path, orjson.dumps({"model": "m", field: ids}))
    assert caught.value.status == 400 and caught.value.param == field
    assert parse_request(path, orjson.dumps({"model": "m", field: [0, 2**31 - 1]}))


def test_max_tokens_0_is_a_completion_that_only_echoes_the_prompt() -> None:
    """OpenAI's API and vLLM (`echo_without_generation`) take `max_tokens: 0` with `echo`
    on a completion; without `echo`, or on a chat, a request must generate a token."""
    echo = {"model": "m", "prompt": "hi", "max_tokens": 0, "echo": True}
    assert parse_request(COMPLETIONS_PATH, orjson.dumps(echo))
    for path, body in ((COMPLETIONS_PATH, {**echo, "echo": False}),
                       (CHAT_PATH, {"model": "m", "max_tokens": 0, "echo": True,
                                    "messages": [{"role": "user", "content": "hi"}]})):
        with pytest.raises(APIError) as caught:
            parse_request(path, orjson.dumps(body))
        assert caught.value.status == 400 and caught.value.param == "max_tokens"
