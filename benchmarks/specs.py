"""What the load generator sends and what it records for each request.

A workload is a sequence of sessions; a session is an ordered list of requests (one for
most workloads, one per round for `multi-round`). The next request of a session is sent
only when the previous one has finished, so a chat's history grows as a user's would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request, body serialised once up front (the client should cost little CPU)."""

    session: int
    turn: int
    body: bytes
    stream: bool = True
    path: str = CHAT_PATH
    tag: str = ""
    headers: tuple[tuple[str, str], ...] = ()  # extra request headers, e.g. x-session-id


Session = Sequence[RequestSpec]


@dataclass(slots=True)
class RequestResult:
    """Client-side measurements of one request. Times are seconds; `start` is run-relative.

    `ttft` is the time to the first chunk that carries generated text (None when not
    streaming or when no content came); `itl` the gaps between consecutive content chunks.
    """

    session: int
    turn: int
    start: float
    e2e: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    chunks: int = 0
    status: int = 0
    error: str | None = None
    prefill_pod: str | None = None
    decode_pod: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> RequestResult:
        """What `to_json` wrote."""
        return cls(
            session=raw["session"], turn=raw["turn"], start=raw["start"], e2e=raw["e2e"],
            ttft=raw["ttft"], itl=list(raw["itl"]), chunks=raw["chunks"], status=raw["status"],
            error=raw["error"], prefill_pod=raw["prefill_pod"], decode_pod=raw["decode_pod"],
            prompt_tokens=raw["prompt_tokens"], completion_tokens=raw["completion_tokens"],
        )  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {
            "session": self.session,
            "turn": self.turn,
            "start": round(self.start, 6),
            "e2e": round(self.e2e, 6),
            "ttft": None if self.ttft is None else round(self.ttft, 6),
            "itl": [round(gap, 6) for gap in self.itl],
            "chunks": self.chunks,
            "status": self.status,
            "error": self.error,
            "prefill_pod": self.prefill_pod,
            "decode_pod": self.decode_pod,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }
