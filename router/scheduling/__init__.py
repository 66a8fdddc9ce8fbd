"""Choosing the pods that serve a request.

The proxy asks a `Scheduler` for a `Pick`: a prefill/decode pair inside one PD group,
or a single pod for an aggregated server. `avoid` holds the keys of pods that already
failed this request, so a retry lands elsewhere when it can.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from router.view import Endpoint, ServerPods


@dataclass(slots=True)
class ScheduleRequest:
    """What a scheduler may look at: the parsed body and the request's headers."""

    model: str
    path: str
    body: dict[str, Any]
    headers: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class Pick:
    """The pods chosen. `prefill` is None for an aggregated server."""

    decode: Endpoint
    prefill: Endpoint | None = None

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        return (self.decode,) if self.prefill is None else (self.prefill, self.decode)


class Scheduler(Protocol):
    def pick(
        self, server: ServerPods, request: ScheduleRequest, avoid: frozenset[str]
    ) -> Pick | None:
        """Return the pods to use, or None when no ready pod (or pair) exists."""
