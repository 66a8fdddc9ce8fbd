"""Incremental Server-Sent Events parsing for OpenAI streams, and what one chunk carries.

`SSEParser.feed` takes bytes exactly as they come off the socket (an event may be split
across reads, or one read may hold many events) and returns the complete `data:` payloads.
`classify` tells whether a payload is content (the moment TTFT and ITL are measured at),
the `[DONE]` sentinel, an in-stream error, or something else (role-only first chunk,
usage chunk, keep-alive).
"""

from __future__ import annotations

import enum
from typing import Any, Final

import orjson

DONE: Final = b"[DONE]"
_MAX_BUFFER_BYTES: Final = 16 * 1024 * 1024


class SSEError(Exception):
    """The stream is not well-formed SSE (or an event outgrew the buffer bound)."""


class ChunkKind(enum.Enum):
    CONTENT = "content"  # carries generated text (or reasoning text)
    DONE = "done"  # the `[DONE]` sentinel
    ERROR = "error"  # `data: {"error": ...}` mid-stream
    OTHER = "other"  # role-only delta, usage-only chunk, empty delta


class SSEParser:
    """Splits a byte stream into SSE events and returns each event's joined `data` field."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[bytes]:
        """Add bytes; return the data payloads of every event completed by them."""
        buffer = self._buffer + data if self._buffer else data
        held = b""
        if b"\r" in buffer:
            if buffer.endswith(b"\r"):  # its "\n" may come in the next read
                buffer, held = buffer[:-1], b"\r"
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        payloads: list[bytes] = []
        start = 0
        while True:
            end = buffer.find(b"\n\n", start)
            if end < 0:
                break
            payload = _event_data(buffer[start:end])
            if payload is not None:
                payloads.append(payload)
            start = end + 2
        self._buffer = buffer[start:] + held
        if len(self._buffer) > _MAX_BUFFER_BYTES:
            raise SSEError("an SSE event exceeds the buffer bound")
        return payloads

    def close(self) -> list[bytes]:
        """End of stream: a final event without its blank line still counts."""
        rest, self._buffer = self._buffer.replace(b"\r", b"\n"), b""
        if not rest.strip():
            return []
        payload = _event_data(rest.rstrip(b"\n"))
        return [] if payload is None else [payload]


def _event_data(event: bytes) -> bytes | None:
    """The event's data lines joined by newlines, or None for a comment/data-less event."""
    lines: list[bytes] = []
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            value = line[5:]
            lines.append(value[1:] if value.startswith(b" ") else value)
    if not lines:
        return None
    return lines[0] if len(lines) == 1 else b"\n".join(lines)


def classify(payload: bytes) -> tuple[ChunkKind, Any]:
    """What one data payload is; the second item is the parsed object (or None)."""
    if payload.strip() == DONE:
        return ChunkKind.DONE, None
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise SSEError(f"a data payload is not JSON: {exc.msg}") from None
    if not isinstance(obj, dict):
        return ChunkKind.OTHER, obj
    if obj.get("error") is not None or obj.get("object") == "error":
        return ChunkKind.ERROR, obj
    choices = obj.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict) and _has_text(choice):
                return ChunkKind.CONTENT, obj
    return ChunkKind.OTHER, obj


def _has_text(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        for key in ("content", "reasoning_content", "reasoning"):
            if delta.get(key):
                return True
        return False
    text = choice.get("text")  # /v1/completions
    return isinstance(text, str) and text != ""
