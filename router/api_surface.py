"""The OpenAI/vLLM endpoints beyond chat and completions: what each body must hold.

Embeddings, the Responses API, tokenize/detokenize and vLLM's rerank/score routes are
routed by `model` like chat, but they do not run the PD flow (see `router.request`'s
endpoint table). The router checks only what it needs to route and what would make the
engine fail opaquely (types of the main fields); engines validate the rest and their 4xx
answers reach the client unchanged. Each validator has a JSON schema beside it, so the
OpenAPI document describes exactly what is accepted.

Field names follow vLLM's protocol classes: `EmbeddingCompletionRequest` /
`EmbeddingChatRequest`, `ResponsesRequest`, `TokenizeCompletionRequest` /
`TokenizeChatRequest`, `DetokenizeRequest`, `RerankRequest` (`query`, `documents`,
`top_n`) and `ScoreRequest` (`text_1`, `text_2`).
"""

from __future__ import annotations

from typing import Any, Final

from router.errors import bad_request
from router.token_ids import MAX_TOKEN_ID, are_token_ids

#: Most items in a batch input (embeddings inputs, rerank documents, score texts).
MAX_BATCH_ITEMS: Final = 2048
MAX_OUTPUT_TOKENS: Final = 1_000_000

_TOKEN_ID: dict[str, Any] = {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}
_TEXTS: dict[str, Any] = {"type": "array", "minItems": 1, "maxItems": MAX_BATCH_ITEMS,
                          "items": {"type": "string"}}
_MESSAGES: dict[str, Any] = {
    "type": "array", "minItems": 1, "maxItems": MAX_BATCH_ITEMS,
    "items": {"type": "object", "required": ["role"], "properties": {
        "role": {"type": "string", "enum": ["system", "user", "assistant"]},
        "content": {"type": "string"},
    }},
}


def _is_token_ids(value: object) -> bool:
    return (isinstance(value, list) and bool(value) and len(value) <= MAX_BATCH_ITEMS * 64
            and are_token_ids(value))


def _is_texts(value: object) -> bool:
    return (isinstance(value, list) and bool(value) and len(value) <= MAX_BATCH_ITEMS
            and all(isinstance(t, str) for t in value))


def _check_messages(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or len(messages) > MAX_BATCH_ITEMS:
        raise bad_request(f"`messages` must be an array of 1 to {MAX_BATCH_ITEMS} messages.",
                          param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"`messages[{index}]` must be an object with a string `role`.",
                              param=f"messages[{index}]")


def _check_int(body: dict[str, Any], name: str, lowest: int, highest: int) -> None:
    value = body.get(name)
    if value is None:
        return
    if type(value) is not int or not lowest <= value <= highest:
        raise bad_request(f"`{name}` must be an integer between {lowest} and {highest}.",
                          param=name)


def check_embeddings(body: dict[str, Any]) -> None:
    """`input` (text, texts, token ids or batches of token ids) or chat `messages`."""
    if "messages" in body and "input" not in body:
        _check_messages(body)
    else:
        value = body.get("input")
        if not (
            isinstance(value, str)
            or _is_texts(value)
            or _is_token_ids(value)
            or (isinstance(value, list) and value and len(value) <= MAX_BATCH_ITEMS
                and all(_is_token_ids(v) for v in value))
        ):
            raise bad_request("`input` must be a string, an array of strings, an array of "
                              "token ids or an array of token-id arrays.", param="input")
    fmt = body.get("encoding_format")
    if fmt is not None and fmt not in ("float", "base64"):
        raise bad_request("`encoding_format` must be `float` or `base64`.",
                          param="encoding_format")
    _check_int(body, "dimensions", 1, 1 << 20)


def check_responses(body: dict[str, Any]) -> None:
    """`input`: a string or a non-empty array of input items; `instructions`: a string."""
    value = body.get("input")
    if not (isinstance(value, str) or (isinstance(value, list) and value
                                       and all(isinstance(v, dict | str) for v in value))):
        raise bad_request("`input` must be a string or a non-empty array of input items.",
                          param="input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("`instructions` must be a string.", param="instructions")
    _check_int(body, "max_output_tokens", 1, MAX_OUTPUT_TOKENS)


def check_tokenize(body: dict[str, Any]) -> None:
    """vLLM's two shapes: `prompt` (a string) or chat `messages`."""
    if "messages" in body:
        _check_messages(body)
    elif not isinstance(body.get("prompt"), str):
        raise bad_request("`prompt` must be a string (or send `messages`).", param="prompt")


def check_detokenize(body: dict[str, Any]) -> None:
    tokens = body.get("tokens")
    if not (isinstance(tokens, list) and are_token_ids(tokens)):
        raise bad_request("`tokens` must be an array of token ids.", param="tokens")


def check_rerank(body: dict[str, Any]) -> None:
    if not isinstance(body.get("query"), str | dict):
        raise bad_request("`query` must be a string.", param="query")
    documents = body.get("documents")
    if not (_is_texts(documents) or isinstance(documents, dict)):
        raise bad_request(f"`documents` must be an array of 1 to {MAX_BATCH_ITEMS} strings.",
                          param="documents")
    _check_int(body, "top_n", 0, MAX_BATCH_ITEMS)


def check_score(body: dict[str, Any]) -> None:
    for name in ("text_1", "text_2"):
        value = body.get(name)
        if not (isinstance(value, str | dict) or _is_texts(value)):
            raise bad_request(f"`{name}` must be a string or an array of 1 to "
                              f"{MAX_BATCH_ITEMS} strings.", param=name)


def schemas(model: dict[str, Any], sampling: dict[str, Any]) -> dict[str, Any]:
    """Component schemas of these endpoints' request bodies (`model` as the data path
    defines it; `sampling` the bounded sampling fields)."""
    text_or_texts = {"anyOf": [{"type": "string"}, _TEXTS]}
    return {
        "EmbeddingRequest": {
            "type": "object", "required": ["model", "input"],
            "properties": {
                "model": model,
                "input": {"anyOf": [
                    {"type": "string"}, _TEXTS,
                    {"type": "array", "minItems": 1, "items": _TOKEN_ID},
                    {"type": "array", "minItems": 1, "maxItems": 16, "items": {
                        "type": "array", "minItems": 1, "items": _TOKEN_ID}},
                ]},
                "encoding_format": {"type": "string", "enum": ["float", "base64"]},
                "dimensions": {"type": "integer", "minimum": 1, "maximum": 1 << 20},
            },
        },
        "ResponseRequest": {
            "type": "object", "required": ["model", "input"],
            "properties": {
                "model": model,
                "input": {"anyOf": [{"type": "string"}, _MESSAGES]},
                "instructions": {"type": "string"},
                "stream": {"type": "boolean"},
                "max_output_tokens": {"type": "integer", "minimum": 1,
                                      "maximum": MAX_OUTPUT_TOKENS},
                **{k: v for k, v in sampling.items() if k in ("temperature", "top_p")},
            },
        },
        "TokenizeRequest": {
            "type": "object", "required": ["model", "prompt"],
            "properties": {"model": model, "prompt": {"type": "string"},
                           "add_special_tokens": {"type": "boolean"},
                           "return_token_strs": {"type": "boolean"}},
        },
        "DetokenizeRequest": {
            "type": "object", "required": ["model", "tokens"],
            "properties": {"model": model,
                           "tokens": {"type": "array", "maxItems": 4096, "items": _TOKEN_ID}},
        },
        "RerankRequest": {
            "type": "object", "required": ["model", "query", "documents"],
            "properties": {"model": model, "query": {"type": "string"}, "documents": _TEXTS,
                           "top_n": {"type": "integer", "minimum": 0,
                                     "maximum": MAX_BATCH_ITEMS}},
        },
        "ScoreRequest": {
            "type": "object", "required": ["model", "text_1", "text_2"],
            "properties": {"model": model, "text_1": text_or_texts, "text_2": text_or_texts},
        },
    }
