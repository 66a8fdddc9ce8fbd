"""Request parsing, render bodies and CLI flags."""

from __future__ import annotations

from typing import Any

import pytest

from engine_sim.cli import parse_config
from engine_sim.protocol import Limits, RequestError, parse_request
from engine_sim.render import generate_request
from tests.sim_tokens import chat_ids, prompt_ids, sim_tokenizer

LIMITS = Limits(model="m", max_model_len=64, default_max_tokens=16)
TOKENIZER = sim_tokenizer()
MESSAGES = [{"role": "user", "content": "Where is the capital of China?"}]


def test_chat_request_defaults_and_precedence() -> None:
    parsed = parse_request({"messages": MESSAGES}, "chat", TOKENIZER, LIMITS)
    assert parsed.model == "m" and parsed.max_tokens == 16 and not parsed.stream
    assert list(parsed.token_ids) == chat_ids(MESSAGES)
    parsed = parse_request(
        {"messages": MESSAGES, "max_tokens": 5, "max_completion_tokens": 3, "stream": True,
         "stream_options": {"include_usage": True}},
        "chat", TOKENIZER, LIMITS,
    )  # fmt: skip
    assert parsed.max_tokens == 3 and parsed.include_usage


@pytest.mark.parametrize(
    "prompt", ["hi there", ["hi there"], prompt_ids("hi there"), [prompt_ids("hi there")]]
)
def test_completion_prompt_shapes(prompt: Any) -> None:
    parsed = parse_request({"prompt": prompt, "max_tokens": 2}, "completion", TOKENIZER, LIMITS)
    assert list(parsed.token_ids) == prompt_ids("hi there")


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": "x", "model": "nope"}, 404, "model"),
        ({"prompt": ["a", "b"]}, 400, "prompt"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
        ({"prompt": "x", "max_tokens": 64}, 400, "max_tokens"),
        ({"prompt": [5, TOKENIZER.max_token_id + 1]}, 400, "prompt"),  # vLLM: out of vocabulary
        ({"prompt": [1099511627776]}, 400, "prompt"),
    ],
)
def test_completion_errors(body: dict[str, Any], status: int, param: str) -> None:
    with pytest.raises(RequestError) as err:
        parse_request(body, "completion", TOKENIZER, LIMITS)
    assert err.value.status == status and err.value.param == param


def test_echo_is_read_as_vllm_serves_it() -> None:
    """A completion echoes its prompt (its token ids decoded when it is ids), and with
    `max_tokens: 0` only that (the engine still generates one token, vLLM's
    `echo_without_generation`); a chat echoes its last message only when that message has
    the answer's role; no echo without `echo: true`."""
    parsed = parse_request({"prompt": "hi there", "echo": True, "max_tokens": 0},
                           "completion", TOKENIZER, LIMITS)
    assert (parsed.echo_text, parsed.echo_only, parsed.max_tokens) == ("hi there", True, 1)
    parsed = parse_request({"prompt": prompt_ids("hi there"), "echo": True, "max_tokens": 2},
                           "completion", TOKENIZER, LIMITS)
    assert parsed.echo_text == TOKENIZER.decode(prompt_ids("hi there"))
    assert (parsed.echo_only, parsed.max_tokens) == (False, 2)
    assert parse_request({"prompt": "hi", "max_tokens": 2}, "completion", TOKENIZER,
                         LIMITS).echo_text is None

    prefix = [*MESSAGES, {"role": "assistant", "content": "It is"}]
    parsed = parse_request({"messages": prefix, "echo": True}, "chat", TOKENIZER, LIMITS)
    assert parsed.echo_text == "It is" and not parsed.echo_only
    assert parse_request({"messages": MESSAGES, "echo": True}, "chat", TOKENIZER,
                         LIMITS).echo_text is None  # the last message is the user's
    with pytest.raises(RequestError) as err:  # a chat generates at least one token
        parse_request({"messages": prefix, "echo": True, "max_tokens": 0}, "chat",
                      TOKENIZER, LIMITS)
    assert err.value.param == "max_tokens"


def test_a_chat_echo_reads_content_parts_and_the_answer_role_as_vllm() -> None:
    """Content parts are read as vLLM parses them (text-like part types, bare strings,
    null texts skipped, joined by newlines); with `add_generation_prompt: false` the
    answer's role is the last message's, so a user message is echoed under role user."""
    parts = [{"type": "input_text", "text": "A"}, "B", {"type": "refusal", "refusal": "C"},
             {"type": "text", "text": None}]
    body = {"messages": [*MESSAGES, {"role": "assistant", "content": parts}], "echo": True}
    parsed = parse_request(body, "chat", TOKENIZER, LIMITS)
    assert (parsed.echo_text, parsed.role) == ("A\nB\nC", "assistant")
    open_turn = {"messages": MESSAGES, "echo": True, "add_generation_prompt": False}
    parsed = parse_request(open_turn, "chat", TOKENIZER, LIMITS)
    assert (parsed.echo_text, parsed.role) == (MESSAGES[0]["content"], "user")


def test_render_generate_request_shape() -> None:
    parsed = parse_request(
        {"model": "m", "messages": MESSAGES, "max_tokens": 20, "stop": "x"}, "chat", TOKENIZER,
        LIMITS,
    )  # fmt: skip
    body = generate_request(parsed)
    assert body["request_id"].startswith("chatcmpl-")
    assert body["token_ids"] == list(parsed.token_ids)
    assert body["sampling_params"]["max_tokens"] == 20
    assert body["sampling_params"]["stop"] == ["x"]
    assert body["features"] is None and body["kv_transfer_params"] is None


def test_cli_flags() -> None:
    config = parse_config(
        ["--role", "decode", "--port", "0", "--model", "m", "--mooncake-master", "h:1",
         "--metadata-server", "http://h:2/metadata", "--fast", "--max-num-seqs", "3"]
    )  # fmt: skip
    assert config.role == "decode" and config.max_num_seqs == 3
    assert config.latency.inter_token_seconds(10) == 0
    with pytest.raises(SystemExit):
        parse_config(["--role", "prefill", "--port", "0", "--model", "m"])
