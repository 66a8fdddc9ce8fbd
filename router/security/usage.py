"""Reading an answer's real token usage, for charging output tokens after the response.

Non-streaming answers carry `usage` in their JSON. For streams the router asks the engine
for `stream_options.include_usage`, and `StreamUsage` watches the SSE events going by: it
records the usage chunk (the one with `"choices":[]` and a `usage` object) and drops it when
the client did not ask for it. It only holds back an incomplete trailing event, so chunks
are not delayed, and it parses only events that mention usage. An incomplete event past
`MAX_HELD_EVENT_BYTES` is passed on as it is rather than held: an engine that never ends
its event cannot make the router buffer (and copy) without bound, and a usage chunk is
small.
"""

from __future__ import annotations

from typing import Any

import orjson

#: An incomplete SSE event held back at most (vLLM's largest events carry a prompt's token
#: ids or logprobs: hundreds of kilobytes); past it the bytes go on as they are.
MAX_HELD_EVENT_BYTES = 4 * 1024 * 1024
_EVENT_END = b"\n\n"
_USAGE = b'"usage"'
_DATA = b"data: "


def completion_tokens(payload: Any) -> int | None:
    """`usage.completion_tokens` of a parsed answer or chunk, if it is a count."""
    if not isinstance(payload, dict):
        return None
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        return None
    tokens = usage.get("completion_tokens", usage.get("output_tokens"))  # output: Responses
    if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0:
        return tokens
    return None


def body_completion_tokens(raw: bytes) -> int | None:
    """`usage.completion_tokens` of a non-streaming JSON answer."""
    try:
        return completion_tokens(orjson.loads(raw))
    except orjson.JSONDecodeError:
        return None


class StreamUsage:
    """Watches one SSE stream (see the module docstring)."""

    __slots__ = ("_tail", "events", "hide", "tokens")

    def __init__(self, hide: bool) -> None:
        self.hide = hide
        self.tokens: int | None = None  # completion tokens from the usage chunk
        self.events = 0  # data events seen: a fallback count when no usage chunk came
        self._tail = b""

    @property
    def pending(self) -> bool:
        """Whether part of an event is held back (`feed` passes on whole events only)."""
        return bool(self._tail)

    @property
    def charged(self) -> int:
        """What to charge: the engine's count, else one token per data event."""
        return self.tokens if self.tokens is not None else max(0, self.events - 1)

    def feed(self, chunk: bytes) -> bytes:
        """The bytes of `chunk` to pass on to the client."""
        if not self._tail and chunk.endswith(_EVENT_END):
            complete = chunk  # whole events, nothing held: the common chunk, no copy
        else:
            data = self._tail + chunk if self._tail else chunk
            end = data.rfind(_EVENT_END)
            if end < 0:
                if len(data) > MAX_HELD_EVENT_BYTES:  # not a usage chunk: pass it on
                    self._tail = b""
                    self.events += data.count(_DATA)
                    return data
                self._tail = data
                return b""
            end += len(_EVENT_END)
            self._tail = data[end:]
            complete = data[:end]
        self.events += complete.count(_DATA)
        if _USAGE not in complete:
            return complete
        kept = []
        for event in complete.split(_EVENT_END)[:-1]:
            if _USAGE in event and event.startswith(_DATA) and self._usage_event(event):
                continue
            kept.append(event + _EVENT_END)
        return b"".join(kept)

    def _usage_event(self, event: bytes) -> bool:
        """Record a usage chunk's count; True when the event should be hidden."""
        try:
            payload = orjson.loads(event[len(_DATA):])
        except orjson.JSONDecodeError:
            return False
        tokens = completion_tokens(payload)
        if tokens is None:
            return False
        self.tokens = tokens
        return self.hide and isinstance(payload, dict) and payload.get("choices") == []

    def finish(self) -> bytes:
        """Whatever trailing bytes are left when the stream ends."""
        tail, self._tail = self._tail, b""
        return tail
