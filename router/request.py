"""Parsing and validating an OpenAI request body before any pod is chosen.

Everything a client can get wrong is refused here with a 400 that names the field, so
the data path only ever sees a JSON object with a string `model` and the fields its
endpoint needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from router.errors import APIError, bad_request

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_MESSAGES = 2048
MAX_TOKENS_LIMIT = 1_000_000

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


@dataclass(slots=True)
class ParsedRequest:
    """A validated request: the body as a dict plus the fields routing reads."""

    path: str
    body: dict[str, Any]
    model: str
    stream: bool
    include_usage: bool


def body_too_large() -> APIError:
    return APIError(
        413,
        f"Request body exceeds {MAX_BODY_BYTES} bytes.",
        code="request_too_large",
    )


def parse_request(path: str, raw: bytes) -> ParsedRequest:
    """Validate `raw` for the endpoint at `path`; raise `APIError` (400/413) if bad."""
    if len(raw) > MAX_BODY_BYTES:
        raise body_too_large()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The body is not valid JSON: {exc.msg}.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The body must be a JSON object.", code="invalid_json")

    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("`model` is required and must be a non-empty string.", param="model")

    if path == CHAT_PATH:
        _check_messages(body.get("messages"))
    else:
        _check_prompt(body.get("prompt"))

    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("`stream` must be a boolean.", param="stream")
    for name in ("max_tokens", "max_completion_tokens"):
        _check_token_count(body, name)

    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("`stream_options` must be an object.", param="stream_options")
        include_usage = options.get("include_usage") is True
    return ParsedRequest(path, body, model, stream, include_usage)


def _check_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` must be a non-empty array.", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise bad_request(f"`messages` may hold at most {MAX_MESSAGES} items.", param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(
                f"`messages[{index}]` must be an object with a string `role`.",
                param=f"messages[{index}]",
            )


def _check_prompt(prompt: object) -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        return
    raise bad_request("`prompt` must be a string or a non-empty array.", param="prompt")


def _check_token_count(body: dict[str, Any], name: str) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"`{name}` must be an integer.", param=name)
    if not 1 <= value <= MAX_TOKENS_LIMIT:
        raise bad_request(f"`{name}` must be between 1 and {MAX_TOKENS_LIMIT}.", param=name)
