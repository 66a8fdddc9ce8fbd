"""Choosing the pods that serve a request.

The proxy asks a `Scheduler` for a `Pick`: a prefill/decode pair inside one PD group,
or a single pod for an aggregated server. `avoid` holds the keys of pods that already
failed this request, so a retry lands elsewhere when it can.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from router.scheduling.pick import Pick
from router.view import ServerPods

if TYPE_CHECKING:
    from router.scheduling.block_hash import LeadingBlocks

__all__ = ["Pick", "PreparingScheduler", "ScheduleRequest", "Scheduler"]


@dataclass(slots=True)
class ScheduleRequest:
    """What a scheduler may look at: the parsed body and the request's headers.

    `tokens`: the prompt's token ids when already computed off the event loop
    (`prepare`); None lets the scheduler tokenize when it needs to. `leading`: instead of
    them, the prompt's leading block keys in one key space (its `ident`) when `prepare`
    hashed only as far as any pod's match can reach. `flow`: the endpoint's
    (`router.request.Flow`): `pd` picks a pair on a PD server; `generate` and `single`
    pick one pod (a PD server's decode pod), `single` by load alone.
    """

    model: str
    path: str
    body: dict[str, Any]
    headers: Mapping[str, str]
    tokens: Sequence[int] | None = None
    flow: str = "pd"
    leading: tuple[int, LeadingBlocks] | None = None
    #: The pods another router process (the sync's leader) chose for this new prompt's
    #: request (`prepare`); `pick` keeps to them while they are candidates.
    placed: tuple[str, ...] | None = None
    #: The router process this pick is for when the sync's leader places another
    #: process's new prompt (None: this process's own request). Such a pick is recorded in
    #: this process's index like any, and its prefill queued as the asker's part of the
    #: pod's backlog until the asker reports it, but it is neither shared over the sync
    #: nor counted in the decision metrics: the asker records and counts its own pick (had
    #: the leader's record reached it first, its pick would take the new prompt for
    #: cached, and a sum over processes would count the request twice).
    asker: str | None = None
    #: The LoRA adapter the request names (`RouteDecision.lora_name`): part of every
    #: block's key in the engine's prefix cache, so of the precise index's keys too.
    lora_name: str | None = None

    @property
    def counted(self) -> bool:
        """This process's own request: its pick is shared and counted here."""
        return self.asker is None


class Scheduler(Protocol):
    def pick(
        self, server: ServerPods, request: ScheduleRequest, avoid: frozenset[str]
    ) -> Pick | None:
        """Return the pods to use, or None when no ready pod (or pair) exists."""


class PreparingScheduler(Scheduler, Protocol):
    """A scheduler with async work to do before `pick` (tokenizing a big prompt)."""

    async def prepare(self, server: ServerPods, request: ScheduleRequest) -> None:
        """Fill what `pick` will need (e.g. `request.tokens`); never raises on bad input."""
