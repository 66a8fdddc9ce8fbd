"""Where one streamed request's time to first token goes, phase by phase.

TTFT runs from the request's arrival (the ASGI call, before the body is read) to the
first SSE chunk carrying generated content sent to the client. It is defined for
streams only: a non-streaming answer has no first token the client can see. The phases
are laps of one clock, so they add up to the TTFT exactly:

- `admission`: reading and checking the body, and the admission queue's wait;
- `schedule`: routing, the rate limit, tokenizing for the scheduler, picking the pods;
- `retry`: failed attempts and the pause before each retry (only when one happened);
- sequential connectors (http, nixl, vllm-ascend mooncake): `prefill` is the prefill
  call until its KV handle is back; `kv_handoff` runs from there until decode's response
  headers arrive (decode's request built, sent and accepted); `first_token` is the rest,
  decode reading the KV and producing its first token (the transfer itself happens in
  decode, so it is in `first_token`: the router cannot see it apart);
- concurrent connectors (sglang, upstream vLLM mooncake): `kv_handoff` is the rendezvous
  set-up (the bootstrap `/query`, the transfer id); `prefill` runs from launching both
  requests to decode's first content byte (prefill, the KV push and decode's first token
  overlap there);
- aggregated pods (no prefill pod): `first_token` runs from the pick to the first content.

Laps are buffered and observed only once the first content byte went out; a failed
attempt's laps are folded into one `retry` lap. One monotonic clock read per event.
"""

from __future__ import annotations

import re
import time

#: A chunk that carries generated content: text, reasoning, or a tool call. Empty
#: strings (the role chunk's `"content":""`) do not count. (The reference definition;
#: `carries_content` answers the same question several times faster, once per chunk.)
CONTENT = re.compile(
    rb'"(?:content|text|reasoning_content|reasoning)":\s*"[^"]|"tool_calls":\s*\[\s*\{'
)
#: The compact forms engines write (no blank after the colon), found with `bytes.find`.
_COMPACT = (b'"content":"', b'"text":"')


def carries_content(chunk: bytes) -> bool:
    """Whether `chunk` matches `CONTENT`, with a `bytes.find` fast path for the common
    content chunk (the regex tries its alternation at every quote of the chunk)."""
    for key in _COMPACT:
        at = chunk.find(key) + len(key)
        if at >= len(key) and at < len(chunk) and chunk[at] != 0x22:  # not `""`
            return True
    return CONTENT.search(chunk) is not None


def content_events(chunk: bytes) -> int:
    """How many SSE events of `chunk` carry content: one write may relay several (the
    events of one socket read leave together)."""
    if chunk.count(b"data:") < 2:
        return 1 if carries_content(chunk) else 0
    return sum(1 for event in chunk.split(b"\n\n") if event and carries_content(event))


class Timeline:
    """One request's TTFT clock (see the module docstring)."""

    __slots__ = ("_attempt_at", "_attempt_mark", "arrived", "laps", "mark")

    def __init__(self, arrived: float | None = None) -> None:
        self.arrived = time.perf_counter() if arrived is None else arrived
        self.mark = self.arrived
        self.laps: list[tuple[str, float]] = []
        self._attempt_at = 0  # laps of the current attempt start here
        self._attempt_mark = self.arrived

    def lap(self, phase: str) -> float:
        """Close `phase` now; returns the clock reading."""
        now = time.perf_counter()
        self.laps.append((phase, now - self.mark))
        self.mark = now
        return now

    def attempt(self) -> None:
        """An attempt begins: its laps are the ones a retry would fold."""
        self._attempt_at = len(self.laps)
        self._attempt_mark = self.mark

    def retry(self) -> None:
        """A retry begins: the failed attempt (and the pause since) becomes one lap."""
        now = time.perf_counter()
        del self.laps[self._attempt_at:]
        self.laps.append(("retry", now - self._attempt_mark))
        self.mark = now
