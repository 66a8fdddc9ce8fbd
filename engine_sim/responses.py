"""Response bodies and SSE chunks in the shapes vLLM's OpenAI server sends."""

from __future__ import annotations

from typing import Any, Final

import orjson

from engine_sim.protocol import ParsedRequest

DONE: Final = b"data: [DONE]\n\n"
FINISH_REASON: Final = "length"  # output length is always max_tokens


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def error_body(
    message: str, status: int, err_type: str = "BadRequestError", param: str | None = None
) -> dict[str, Any]:
    """Current vLLM's nested error object (`code` is the HTTP status)."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


def chat_completion(
    response_id: str,
    created: int,
    model: str,
    text: str,
    usage_body: dict[str, Any],
    kv_transfer_params: dict[str, Any] | None,
    role: str = "assistant",
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": role,
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [],
                    "reasoning_content": None,
                },
                "logprobs": None,
                "finish_reason": FINISH_REASON,
                "stop_reason": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage_body,
        "prompt_logprobs": None,
        "kv_transfer_params": kv_transfer_params,
    }


def text_completion(
    response_id: str,
    created: int,
    model: str,
    text: str,
    usage_body: dict[str, Any],
    kv_transfer_params: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": FINISH_REASON,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage_body,
        "kv_transfer_params": kv_transfer_params,
    }


def answer_text(request: ParsedRequest, pieces: list[str]) -> str:
    """A non-streaming answer's text: with `echo`, the echoed text first (alone for a
    completion's `max_tokens: 0`), as vLLM's serving code builds it."""
    echo = request.echo_text or ""
    return echo if request.echo_only else echo + "".join(pieces)


def stream_pieces(request: ParsedRequest, pieces: list[str]) -> list[str]:
    """A stream's content pieces, one a chunk: a completion's `echo` rides on the first
    (which carries the prompt alone for `max_tokens: 0`); a chat's echo has a chunk of its
    own after the role chunk (`ChunkWriter.start`)."""
    echo = request.echo_text
    if echo is None or request.endpoint == "chat":
        return pieces
    if request.echo_only:
        return [echo]
    return [echo + pieces[0], *pieces[1:]]


class ChunkWriter:
    """Builds one stream's SSE chunks: a role chunk first (chat), one chunk per token, the
    finish reason on the last token, an optional usage chunk, then `[DONE]`."""

    def __init__(self, request: ParsedRequest, response_id: str, created: int) -> None:
        self._chat = request.endpoint == "chat"
        self._head = {
            "id": response_id,
            "object": "chat.completion.chunk" if self._chat else "text_completion",
            "created": created,
            "model": request.model,
        }
        # Every chunk shares this head: serialize it once, then splice each choice in.
        self._prefix = b"data: " + orjson.dumps(self._head)[:-1] + b',"choices":['
        self._include_usage = request.include_usage
        self._prompt_tokens = len(request.token_ids)
        self._chat_echo = request.echo_text if self._chat else None
        self._role = request.role

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        return self._prefix + orjson.dumps(choice) + b"]}\n\n"

    def start(self) -> bytes:
        """The role chunk (chat only), then the echoed last message's (chat with `echo`)."""
        if not self._chat:
            return b""
        head = self._chunk(
            {
                "index": 0,
                "delta": {"role": self._role, "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        )
        if not self._chat_echo:
            return head
        echo = {"index": 0, "delta": {"content": self._chat_echo}, "logprobs": None,
                "finish_reason": None}
        return head + self._chunk(echo)

    def token(self, piece: str, last: bool) -> bytes:
        finish = FINISH_REASON if last else None
        if self._chat:
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {"content": piece},
                "logprobs": None,
                "finish_reason": finish,
            }
        else:
            choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish}
        if last:
            choice["stop_reason"] = None
        return self._chunk(choice)

    def end(self, completion_tokens: int) -> bytes:
        """The usage chunk (when asked for) and `[DONE]`."""
        if not self._include_usage:
            return DONE
        body: dict[str, Any] = {
            **self._head,
            "choices": [],
            "usage": usage(self._prompt_tokens, completion_tokens),
        }
        return sse(body) + DONE
