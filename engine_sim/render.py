"""The `/v1/*/render` answers: vLLM's `GenerateRequest`, tokens rendered by our tokenizer.

vLLM Router calls these before PD requests; vLLM renders the chat template, tokenizes, and
returns the request it would run (`request_id`, `token_ids`, `sampling_params`, ...). Chat
render returns one object, completion render a list of one.
"""

from __future__ import annotations

import uuid
from typing import Any

from engine_sim.protocol import ParsedRequest

# vLLM's RequestOutputKind values.
_OUTPUT_KIND_DELTA = 1
_OUTPUT_KIND_FINAL_ONLY = 2


def _stop_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value) if isinstance(value, list) else []


def sampling_params(request: ParsedRequest) -> dict[str, Any]:
    """vLLM's sampling parameters for this request, defaults filled in."""
    body = request.body

    def pick(name: str, default: Any) -> Any:
        value = body.get(name)
        return default if value is None else value

    return {
        "n": pick("n", 1),
        "presence_penalty": pick("presence_penalty", 0.0),
        "frequency_penalty": pick("frequency_penalty", 0.0),
        "repetition_penalty": pick("repetition_penalty", 1.0),
        "temperature": pick("temperature", 1.0),
        "top_p": pick("top_p", 1.0),
        "top_k": pick("top_k", 0),
        "min_p": pick("min_p", 0.0),
        "seed": body.get("seed"),
        "stop": _stop_list(body.get("stop")),
        "stop_token_ids": pick("stop_token_ids", []),
        "bad_words": pick("bad_words", []),
        "include_stop_str_in_output": pick("include_stop_str_in_output", False),
        "ignore_eos": pick("ignore_eos", False),
        "max_tokens": request.max_tokens,
        "min_tokens": request.min_tokens,
        "logprobs": body.get("top_logprobs") if body.get("logprobs") is True else None,
        "prompt_logprobs": body.get("prompt_logprobs"),
        "skip_special_tokens": pick("skip_special_tokens", True),
        "spaces_between_special_tokens": pick("spaces_between_special_tokens", True),
        "output_kind": _OUTPUT_KIND_DELTA if request.stream else _OUTPUT_KIND_FINAL_ONLY,
        "skip_reading_prefix_cache": False,
    }


def generate_request(request: ParsedRequest) -> dict[str, Any]:
    """One `GenerateRequest` as vLLM's render endpoints dump it."""
    prefix = "chatcmpl" if request.endpoint == "chat" else "cmpl"
    options = request.body.get("stream_options")
    return {
        "request_id": f"{prefix}-{uuid.uuid4().hex}",
        "token_ids": list(request.token_ids),
        "features": None,
        "sampling_params": sampling_params(request),
        "model": request.body.get("model"),
        "stream": request.stream,
        "stream_options": options if request.stream and isinstance(options, dict) else None,
        "cache_salt": request.cache_salt,
        "priority": request.priority,
        "kv_transfer_params": None,
    }
