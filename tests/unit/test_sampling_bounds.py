"""Sampling fields outside what engines accept are refused with a 400 naming the field."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from router.errors import APIError
from router.request import CHAT_PATH, COMPLETIONS_PATH, parse_request
from router.sampling_bounds import MAX_BEST_OF, MAX_LOGPROBS, MAX_N


def chat(**fields: Any) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                         **fields})


def completion(**fields: Any) -> bytes:
    return orjson.dumps({"model": "m", "prompt": "hi", **fields})


REFUSED: list[tuple[str, dict[str, Any], str]] = [
    (CHAT_PATH, {"n": 1000}, "n"),
    (CHAT_PATH, {"n": -1}, "n"),
    (CHAT_PATH, {"n": 0}, "n"),
    (CHAT_PATH, {"n": 2.5}, "n"),
    (CHAT_PATH, {"n": True}, "n"),
    (CHAT_PATH, {"n": "3"}, "n"),
    (COMPLETIONS_PATH, {"best_of": 1000}, "best_of"),
    (COMPLETIONS_PATH, {"best_of": 2, "n": 3}, "best_of"),
    (CHAT_PATH, {"logprobs": True, "top_logprobs": 100000}, "top_logprobs"),
    (CHAT_PATH, {"top_logprobs": -1}, "top_logprobs"),
    (CHAT_PATH, {"logprobs": 5}, "logprobs"),
    (COMPLETIONS_PATH, {"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    (COMPLETIONS_PATH, {"logprobs": -1}, "logprobs"),
    (COMPLETIONS_PATH, {"prompt_logprobs": 1000}, "prompt_logprobs"),
    (CHAT_PATH, {"temperature": -0.5}, "temperature"),
    (CHAT_PATH, {"temperature": "hot"}, "temperature"),
    (CHAT_PATH, {"top_p": 0}, "top_p"),
    (CHAT_PATH, {"top_p": 1.5}, "top_p"),
    (CHAT_PATH, {"min_p": 2}, "min_p"),
    (CHAT_PATH, {"top_k": -2}, "top_k"),
    (CHAT_PATH, {"presence_penalty": 3}, "presence_penalty"),
    (CHAT_PATH, {"frequency_penalty": -2.5}, "frequency_penalty"),
    (CHAT_PATH, {"seed": 2**63}, "seed"),
    (CHAT_PATH, {"min_tokens": -1}, "min_tokens"),
]


@pytest.mark.parametrize(("path", "fields", "param"), REFUSED,
                         ids=[f"{p[4:]}:{f}" for p, f, _ in REFUSED])
def test_out_of_bounds_is_a_400_naming_the_field(
    path: str, fields: dict[str, Any], param: str
) -> None:
    raw = chat(**fields) if path == CHAT_PATH else completion(**fields)
    with pytest.raises(APIError) as info:
        parse_request(path, raw)
    error = info.value
    assert error.status == 400 and error.param == param
    assert error.payload()["error"]["type"] == "invalid_request_error"
    assert f"`{param}`" in error.message


ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    (CHAT_PATH, {"n": MAX_N, "temperature": 0, "top_p": 1, "seed": -1}),
    (CHAT_PATH, {"seed": 2**63 - 1}),  # int64's ends: a float would hold the first as 2**63
    (CHAT_PATH, {"seed": -(2**63)}),
    (CHAT_PATH, {"logprobs": True, "top_logprobs": MAX_LOGPROBS, "top_k": -1, "min_p": 0}),
    (CHAT_PATH, {"n": None, "temperature": None, "logprobs": None, "top_k": 0}),
    (CHAT_PATH, {"temperature": 3.5, "presence_penalty": -2, "frequency_penalty": 2}),
    (COMPLETIONS_PATH, {"best_of": MAX_BEST_OF, "n": 4, "logprobs": 0, "min_tokens": 0}),
    (COMPLETIONS_PATH, {"best_of": 1, "logprobs": MAX_LOGPROBS, "prompt_logprobs": 0}),
    (COMPLETIONS_PATH, {"repetition_penalty": 1.1, "stop": ["x"], "unknown_field": 10**9}),
]


@pytest.mark.parametrize(("path", "fields"), ACCEPTED, ids=[str(f) for _, f in ACCEPTED])
def test_values_engines_accept_pass_unchanged(path: str, fields: dict[str, Any]) -> None:
    raw = chat(**fields) if path == CHAT_PATH else completion(**fields)
    parsed = parse_request(path, raw)
    assert parsed.body == orjson.loads(raw)


def test_the_error_names_each_bound_as_written() -> None:
    """Integer bounds are exact in the message (2**63 - 1, not its float 2**63), and a
    float bound keeps its decimals."""
    with pytest.raises(APIError) as info:
        parse_request(CHAT_PATH, chat(seed=2**63))
    assert info.value.message == (
        "`seed` must be an integer between -9223372036854775808 and 9223372036854775807.")
    with pytest.raises(APIError) as info:
        parse_request(CHAT_PATH, chat(top_p=1.5))
    assert info.value.message == "`top_p` must be a number greater than 0 and at most 1."
    with pytest.raises(APIError) as info:
        parse_request(CHAT_PATH, chat(presence_penalty=2.5))
    assert info.value.message == "`presence_penalty` must be a number between -2 and 2."
