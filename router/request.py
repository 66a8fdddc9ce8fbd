"""Parsing and validating an OpenAI request body before any pod is chosen.

Everything a client can get wrong is refused here with a 400 that names the field, so
the data path only ever sees a JSON object with a string `model` and the fields its
endpoint needs, with sampling fields inside the bounds of `sampling_bounds`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import orjson

from router import api_surface
from router.errors import APIError, bad_request
from router.sampling_bounds import BOUNDS, COMPLETION_LOGPROBS, check_sampling
from router.token_ids import MAX_TOKEN_ID, are_token_ids

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_MESSAGES = 2048
MAX_TOKENS_LIMIT = 1_000_000
#: Deepest JSON nesting accepted (the body object is depth 1). orjson parses up to 1024
#: levels but writes only 254, so a deeper body would fail when forwarded.
MAX_NESTING_DEPTH = 32
MAX_MODEL_CHARS = 256
#: A body field the router drops from every client request (see `parse_request`).
CLIENT_FORBIDDEN_FIELD: Final = "kv_transfer_params"

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
RESPONSES_PATH = "/v1/responses"

#: How an endpoint is served. `pd`: the PD flow on a PD server (prefill, KV hand-off,
#: decode), one pod on an aggregated one. `generate`: generates, but no KV connector
#: supports its body, so one pod: aggregated, or a PD server's decode pod computing the
#: prompt itself. `single`: no generation (pooling, tokenizer): one pod, aggregated or
#: decode, chosen by load, and no prefix-cache bookkeeping (it leaves no KV behind).
Flow = Literal["pd", "generate", "single"]
#: How a stream proves it ended: `done` (`data: [DONE]`, chat and completions) or
#: `responses` (a `response.completed`/`.incomplete`/`.failed` event; vLLM sends no DONE).
StreamEnd = Literal["done", "responses"]


@dataclass(frozen=True, slots=True)
class ApiEndpoint:
    """One data-path endpoint: how it is served and what its body must hold."""

    path: str
    flow: Flow
    schema: str  # the OpenAPI component of its body
    summary: str
    check: Callable[[dict[str, Any]], None]
    streams: bool = False  # honours `stream: true`
    stream_end: StreamEnd = "done"


class ParsedRequest:
    """A validated request: the body as a dict plus the fields routing reads.

    `tokens` / `prompt_tokens`: the first prompt's token ids and the token count of every
    prompt, by the chosen ModelServer's tokenizer, once someone computed them (the rate
    limiter or the scheduler, whichever needs them first); never computed twice.

    A plain class, not a dataclass: one is made per request, and this module is compiled
    (router/build.py), which compiles a written `__init__` but not a dataclass's.
    """

    __slots__ = ("body", "endpoint", "include_usage", "model", "path", "prompt_tokens",
                 "stream", "tokens")

    def __init__(self, path: str, body: dict[str, Any], model: str, stream: bool,
                 include_usage: bool, endpoint: ApiEndpoint | None = None) -> None:
        self.path = path
        self.body = body
        self.model = model
        self.stream = stream
        self.include_usage = include_usage
        self.endpoint = endpoint  # None: chat/completions built by hand (tests)
        self.tokens: Sequence[int] | None = None  # the prompt's token ids, once computed
        self.prompt_tokens: int | None = None  # by the server's tokenizer (rate limits)

    @property
    def flow(self) -> Flow:
        return "pd" if self.endpoint is None else self.endpoint.flow


def body_too_large(limit: int = MAX_BODY_BYTES) -> APIError:
    return APIError(
        413,
        f"Request body exceeds {limit} bytes.",
        code="request_too_large",
    )


def parse_request(path: str, raw: bytes, max_body_bytes: int = MAX_BODY_BYTES) -> ParsedRequest:
    """Validate `raw` for the endpoint at `path`; raise `APIError` (400/413) if bad.

    orjson refuses bytes that are not UTF-8 and lone surrogate escapes, so every string
    in a parsed body can be written out again.
    """
    if len(raw) > max_body_bytes:
        raise body_too_large(max_body_bytes)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        # orjson words bytes that are not UTF-8 as "str is not valid UTF-8: surrogates not
        # allowed", which reads like a complaint about an escape in the text.
        why = "it is not UTF-8 text" if exc.msg.startswith("str is not valid UTF-8") else exc.msg
        raise bad_request(f"The body is not valid JSON: {why}.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The body must be a JSON object.", code="invalid_json")
    _check_depth(body)
    # The KV hand-off between pods is the router's to set (its connectors write it):
    # from a client it could point an engine's KV transfer at any host, or at another
    # request's blocks.
    body.pop(CLIENT_FORBIDDEN_FIELD, None)

    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("`model` is required and must be a non-empty string.", param="model")
    if len(model) > MAX_MODEL_CHARS:
        raise bad_request(f"`model` may be at most {MAX_MODEL_CHARS} characters.",
                          param="model")

    endpoint = ENDPOINTS.get(path, ENDPOINTS[COMPLETIONS_PATH])
    endpoint.check(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("`stream` must be a boolean.", param="stream")
    if endpoint.flow != "pd":
        check_sampling(body, chat=True)
        return ParsedRequest(path, body, model, stream and endpoint.streams, False, endpoint)
    # `max_tokens: 0` with `echo` is a completion that only echoes the prompt (OpenAI's API,
    # vLLM's `echo_without_generation`); anywhere else a request generates at least one.
    echo_only = path == COMPLETIONS_PATH and body.get("echo") is True
    _check_token_count(body, "max_tokens", lowest=0 if echo_only else 1)
    _check_token_count(body, "max_completion_tokens")
    _check_token_count(body, "min_tokens", lowest=0)
    check_sampling(body, chat=path == CHAT_PATH)

    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("`stream_options` must be an object.", param="stream_options")
        include_usage = options.get("include_usage") is True
    return ParsedRequest(path, body, model, stream, include_usage, endpoint)


def _check_depth(body: dict[str, Any]) -> None:
    if not _nests_within(body, 1):
        raise bad_request(
            f"The body nests deeper than {MAX_NESTING_DEPTH} levels.", code="invalid_json"
        )


def _nests_within(value: dict[str, Any] | list[Any], depth: int) -> bool:
    """Whether `value` (at `depth`) nests no deeper than MAX_NESTING_DEPTH.

    A walk over containers only: about 1 µs for a typical chat body, whatever its text size
    (counting brackets in the raw bytes costs several times that).
    """
    if depth > MAX_NESTING_DEPTH:
        return False
    for child in value.values() if type(value) is dict else value:
        if isinstance(child, dict | list) and not _nests_within(child, depth + 1):
            return False
    return True


def _check_chat(body: dict[str, Any]) -> None:
    _check_messages(body.get("messages"))


def _check_completion(body: dict[str, Any]) -> None:
    _check_prompt(body.get("prompt"))


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
    """A string, strings, token ids or arrays of token ids (vLLM's `prompt` union), each
    id in 0..`MAX_TOKEN_ID`: an id past any vocabulary is the client's error, answered
    here, not a prefill failure to retry on every pod (which engines may not survive)."""
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, list) or not prompt:
        raise bad_request("`prompt` must be a string or a non-empty array.", param="prompt")
    first = prompt[0]
    if isinstance(first, str):
        ok = all(isinstance(item, str) for item in prompt)
    elif isinstance(first, list):
        ok = all(isinstance(item, list) and are_token_ids(item) for item in prompt)
    else:
        ok = are_token_ids(prompt)
    if not ok:
        raise bad_request(
            "`prompt` must be a string, an array of strings, an array of token ids "
            f"(integers from 0 to {MAX_TOKEN_ID}) or an array of such arrays.", param="prompt"
        )


def _check_token_count(body: dict[str, Any], name: str, lowest: int = 1) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"`{name}` must be an integer.", param=name)
    if not lowest <= value <= MAX_TOKENS_LIMIT:
        raise bad_request(f"`{name}` must be between {lowest} and {MAX_TOKENS_LIMIT}.",
                          param=name)


def _endpoints(*items: ApiEndpoint) -> dict[str, ApiEndpoint]:
    return {item.path: item for item in items}


_RERANK = ("RerankRequest", "Rerank documents against a query (vLLM)",
           api_surface.check_rerank)
_SCORE = ("ScoreRequest", "Score text pairs (vLLM)", api_surface.check_score)
#: Every POST endpoint of the raw-ASGI data path, by path (the app routes these).
ENDPOINTS: Final[dict[str, ApiEndpoint]] = _endpoints(
    ApiEndpoint(CHAT_PATH, "pd", "ChatCompletionRequest", "Create a chat completion",
                _check_chat, streams=True),
    ApiEndpoint(COMPLETIONS_PATH, "pd", "CompletionRequest", "Create a completion",
                _check_completion, streams=True),
    ApiEndpoint(RESPONSES_PATH, "generate", "ResponseRequest", "Create a model response",
                api_surface.check_responses, streams=True, stream_end="responses"),
    ApiEndpoint("/v1/embeddings", "single", "EmbeddingRequest", "Create embeddings",
                api_surface.check_embeddings),
    ApiEndpoint("/tokenize", "single", "TokenizeRequest", "Tokenize a prompt (vLLM)",
                api_surface.check_tokenize),
    ApiEndpoint("/detokenize", "single", "DetokenizeRequest", "Detokenize token ids (vLLM)",
                api_surface.check_detokenize),
    *(ApiEndpoint(path, "single", *_RERANK) for path in ("/rerank", "/v1/rerank",
                                                          "/v2/rerank")),
    *(ApiEndpoint(path, "single", *_SCORE) for path in ("/score", "/v1/score")),
)


def openapi_paths() -> tuple[dict[str, Any], dict[str, Any]]:
    """OpenAPI path items and component schemas of the data-path endpoints.

    They describe what `parse_request` accepts (the bounds above), so a schema-driven
    fuzzer exercises the raw-ASGI endpoints FastAPI never sees.
    """
    ref = "#/components/schemas/"
    token_count = {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS_LIMIT}
    common: dict[str, Any] = {
        "model": {"type": "string", "minLength": 1, "maxLength": MAX_MODEL_CHARS},
        "stream": {"type": "boolean"},
        "stream_options": {
            "type": "object", "properties": {"include_usage": {"type": "boolean"}},
        },
        "max_tokens": token_count,
        "max_completion_tokens": token_count,
        "min_tokens": {**token_count, "minimum": 0},
        **{name: bound.schema() for name, bound in BOUNDS.items()},
    }
    message = {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]},
            "content": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        },
    }
    components: dict[str, Any] = {
        "ChatCompletionRequest": {
            "type": "object",
            "required": ["model", "messages"],
            "properties": {
                **common,
                "messages": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES,
                             "items": message},
                "logprobs": {"type": "boolean"},
            },
        },
        "CompletionRequest": {
            "type": "object",
            "required": ["model", "prompt"],
            "properties": {
                **common,
                "logprobs": COMPLETION_LOGPROBS.schema(),
                "prompt": {"anyOf": [
                    {"type": "string"},
                    {"type": "array", "minItems": 1, "items": {"type": "string"}},
                    {"type": "array", "minItems": 1,
                     "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}},
                ]},
            },
        },
        **api_surface.schemas(common["model"], common),
        "Error": {
            "type": "object",
            "required": ["error"],
            "properties": {"error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }},
        },
    }
    error = {"content": {"application/json": {"schema": {"$ref": ref + "Error"}}}}
    answers: dict[str, Any] = {
        "200": {
            "description": "The engine's answer (JSON, or server-sent events when streaming)",
            "content": {"application/json": {"schema": {"type": "object"}},
                        "text/event-stream": {"schema": {"type": "string"}}},
        },
        **{
            str(status): {"description": text, **error}
            for status, text in (
                (400, "Invalid request"), (401, "Missing or wrong API key"),
                (404, "Unknown model"), (413, "Body too large"),
                (429, "Token rate limit exceeded"), (431, "Headers too large"),
                (502, "The engine failed"), (503, "No capacity or shutting down"),
                (504, "The engine did not answer in time"),
            )
        },
    }

    def operation(summary: str, schema: str) -> dict[str, Any]:
        return {"post": {
            "summary": summary,
            "operationId": schema[0].lower() + schema[1:].removesuffix("Request"),
            "requestBody": {"required": True, "content": {
                "application/json": {"schema": {"$ref": ref + schema}}
            }},
            "responses": answers,
        }}

    paths: dict[str, Any] = {}
    for path, endpoint in ENDPOINTS.items():
        item = operation(endpoint.summary, endpoint.schema)
        # Several paths share a body (vLLM's rerank/score aliases): ids must be unique.
        if path in ("/v1/rerank", "/v2/rerank", "/v1/score"):
            item["post"]["operationId"] += "_" + path.strip("/").replace("/", "_")
        paths[path] = item
    return paths, components
