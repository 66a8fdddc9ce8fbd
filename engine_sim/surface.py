"""vLLM's endpoints beyond chat and completions, simulated: embeddings, the Responses API,
rerank and score, with vLLM's request fields and response shapes.

Pooling answers are deterministic functions of the token ids (`embed`): the same text
always gets the same vector, different texts almost surely different ones, so a test can
check that an answer came through intact. `/v1/responses` runs through the engine like a
chat request (its `input`/`instructions` become messages, `max_output_tokens` the
`max_tokens`), answered as a Responses API object or its streaming events.
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
import time
from collections.abc import Sequence
from typing import Any, Final

import orjson

from engine_sim.protocol import RequestError

#: Length of a simulated embedding when the request gives no `dimensions`.
EMBEDDING_DIM: Final = 32
MAX_EMBEDDING_DIM: Final = 4096


def embed(token_ids: Sequence[int], dim: int = EMBEDDING_DIM) -> list[float]:
    """A unit vector derived from the token ids (a hash per position, summed, normalised)."""
    vector = [0.0] * dim
    for token in token_ids:
        digest = hashlib.blake2b(token.to_bytes(8, "little"), digest_size=32).digest()
        for i in range(dim):
            vector[i] += digest[i % 32] / 255.0 - 0.5 + (i % 7) * 1e-3
    norm = math.sqrt(sum(v * v for v in vector)) or 1.0
    return [v / norm for v in vector]


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


def embedding_dim(body: dict[str, Any]) -> int:
    dim = body.get("dimensions")
    if dim is None:
        return EMBEDDING_DIM
    if type(dim) is not int or not 1 <= dim <= MAX_EMBEDDING_DIM:
        raise RequestError(f"'dimensions' must be between 1 and {MAX_EMBEDDING_DIM}",
                           param="dimensions")
    return dim


def encoding_format(body: dict[str, Any]) -> str:
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise RequestError("'encoding_format' must be 'float' or 'base64'",
                           param="encoding_format")
    return str(fmt)


def embedding_response(request_id: str, model: str, vectors: list[list[float]],
                       fmt: str, prompt_tokens: int) -> dict[str, Any]:
    """vLLM's `EmbeddingResponse`."""
    return {
        "id": f"embd-{request_id}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [{"index": i, "object": "embedding", "embedding": encode_vector(v, fmt)}
                 for i, v in enumerate(vectors)],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                  "completion_tokens": 0, "prompt_tokens_details": None},
    }


def similarity(a: list[float], b: list[float]) -> float:
    """Cosine similarity of two unit vectors mapped to 0..1."""
    return (sum(x * y for x, y in zip(a, b, strict=True)) + 1.0) / 2.0


def rerank_response(request_id: str, model: str, scores: list[float], documents: list[str],
                    top_n: int, total_tokens: int) -> dict[str, Any]:
    """vLLM's `RerankResponse`: results by relevance, best first, `top_n` of them (0: all)."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if top_n > 0:
        order = order[:top_n]
    return {
        "id": f"rerank-{request_id}",
        "model": model,
        "usage": {"total_tokens": total_tokens},
        "results": [{"index": i, "document": {"text": documents[i], "multi_modal": None},
                     "relevance_score": scores[i]} for i in order],
    }


def score_pairs(text_1: Any, text_2: Any) -> list[tuple[str, str]]:
    """vLLM's pairing: 1 x 1, 1 x N, or N x N (equal lengths)."""
    first = [text_1] if isinstance(text_1, str) else text_1
    second = [text_2] if isinstance(text_2, str) else text_2
    for name, value in (("text_1", first), ("text_2", second)):
        if not isinstance(value, list) or not value or not all(
                isinstance(t, str) for t in value):
            raise RequestError(f"'{name}' must be a string or a non-empty list of strings",
                               param=name)
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise RequestError("text_1 and text_2 lists must have the same length")
    return list(zip(first, second, strict=True))


def score_response(request_id: str, model: str, scores: list[float],
                   prompt_tokens: int) -> dict[str, Any]:
    """vLLM's `ScoreResponse`."""
    return {
        "id": f"score-{request_id}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                  "completion_tokens": 0, "prompt_tokens_details": None},
    }


# -- the Responses API ------------------------------------------------------------------------


def responses_chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """A chat body for the engine from a `ResponsesRequest` (input, instructions, limits)."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    value = body.get("input")
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list) and value:
        for index, item in enumerate(value):
            if not isinstance(item, dict) or not isinstance(item.get("role"), str):
                raise RequestError(f"input[{index}] must be a message with a role",
                                   param="input")
            messages.append({"role": item["role"], "content": _input_text(item.get("content"))})
    else:
        raise RequestError("'input' must be a string or a non-empty list", param="input")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    return chat


def _input_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content
                       if isinstance(part, dict) and isinstance(part.get("text"), str))
    raise RequestError("an input message's content must be a string or a list of parts",
                       param="input")


class ResponseWriter:
    """One Responses API answer: the object, or its stream of named SSE events."""

    def __init__(self, request_id: str, model: str, body: dict[str, Any],
                 prompt_tokens: int) -> None:
        self.id = f"resp_{request_id}"
        self.item_id = f"msg_{request_id}"
        self.model = model
        self.body = body
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.sequence = 0

    def response(self, text: str | None, output_tokens: int = 0) -> dict[str, Any]:
        """The `Response` object; `text` None: still in progress (no output yet)."""
        body = self.body
        done = text is not None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": "completed" if done else "in_progress",
            "output": [self._item(text or "", "completed")] if done else [],
            "usage": {
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + output_tokens,
            } if done else None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature", 1.0),
            "top_p": body.get("top_p", 1.0),
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "incomplete_details": None,
            "error": None,
            "metadata": body.get("metadata"),
            "previous_response_id": None,
            "reasoning": None,
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "background": False,
            "service_tier": "auto",
            "user": None,
        }

    def _item(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {"type": "message", "id": self.item_id, "role": "assistant", "status": status,
                "content": content if status == "completed" else []}

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def start(self) -> bytes:
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return b"".join((
            self.event("response.created", response=self.response(None)),
            self.event("response.in_progress", response=self.response(None)),
            self.event("response.output_item.added", output_index=0,
                       item=self._item("", "in_progress")),
            self.event("response.content_part.added", **where,
                       part={"type": "output_text", "text": "", "annotations": []}),
        ))

    def delta(self, piece: str) -> bytes:
        return self.event("response.output_text.delta", item_id=self.item_id, output_index=0,
                          content_index=0, delta=piece, logprobs=[])

    def end(self, text: str, output_tokens: int) -> bytes:
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return b"".join((
            self.event("response.output_text.done", **where, text=text, logprobs=[]),
            self.event("response.content_part.done", **where,
                       part={"type": "output_text", "text": text, "annotations": []}),
            self.event("response.output_item.done", output_index=0,
                       item=self._item(text, "completed")),
            self.event("response.completed", response=self.response(text, output_tokens)),
        ))
