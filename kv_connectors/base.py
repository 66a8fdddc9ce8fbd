"""The one small interface every KV connector implements.

A connector knows how one KV transfer protocol ties a prefill request to a decode
request. The router picks the pod pair and streams decode's answer; the connector
only decides what prefill is sent, when, and what decode receives in return.

Two shapes exist (see each module's docstring for the exchange, field by field):

- sequential handle (http, nixl, vllm-ascend mooncake): prefill runs to completion
  first, and its response carries the handle that decode needs;
- concurrent rendezvous (sglang, upstream vLLM mooncake): the router makes up one id,
  sends both requests at once, and prefill runs beside decode.

`start()` returns a `Handoff`: the decode body and, in the concurrent shape, the
still-running prefill task, which the router must watch and cancel with decode.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol


class PodAddress(Protocol):
    """Where an engine listens. The router's `Endpoint` satisfies this."""

    @property
    def ip(self) -> str: ...

    @property
    def port(self) -> int: ...

    @property
    def base_url(self) -> str: ...

    @property
    def dp_rank(self) -> int | None:
        """The engine's data-parallel rank, on a pod that runs several (else None)."""
        ...

    @property
    def rank_pin(self) -> str | None:
        """The `X-data-parallel-rank` that pins a request to this target's engine: its
        index among its API server's engines, when that server runs several (else None)."""
        ...

    @property
    def local_index(self) -> int | None:
        """Its index among the data-parallel ranks its pod runs (None without data
        parallelism): an external rank's API and bootstrap servers sit at the pod's
        ports + this index."""
        ...


class UpstreamError(Exception):
    """An engine call failed. `retryable` tells the router whether a new pair may help.

    `reason` is a short, stable label used in metrics (`connect`, `timeout`, `status_5xx`,
    `status_4xx`, `bad_response`, `missing_kv_params`, ...). `message` is safe to show a
    client: it never contains an internal address or an upstream body.
    """

    def __init__(
        self,
        reason: str,
        message: str,
        *,
        retryable: bool,
        status: int | None = None,
        pod: PodAddress | None = None,
        phase: str = "prefill",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retryable = retryable
        self.status = status
        self.pod = pod
        self.phase = phase
        self.param = param  # the field a refusing engine named, passed on to the client


class PrefillClient(Protocol):
    """What a connector may call: one JSON request to one pod, answered as a dict.

    Raises `UpstreamError` on connect errors, timeouts, non-2xx answers and bodies
    that are not a JSON object. `deadline` is an absolute `loop.time()`.
    """

    async def post_json(
        self,
        pod: PodAddress,
        path: str,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        deadline: float,
    ) -> dict[str, Any]: ...

    async def get_json(
        self, url: str, headers: Mapping[str, str], deadline: float
    ) -> Any: ...


@dataclass(slots=True)
class PDCall:
    """One client request about to be served by a prefill/decode pair."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    request_id: str
    prefill: PodAddress
    decode: PodAddress
    deadline: float
    annotations: Mapping[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class Handoff:
    """What decode is sent, and the prefill still running beside it (concurrent shape)."""

    decode_body: dict[str, Any]
    prefill_task: asyncio.Task[Any] | None = None


class KVConnector(ABC):
    """Ties prefill to decode for one KV transfer protocol. Stateless and shared."""

    name: ClassVar[str]

    @abstractmethod
    async def start(self, call: PDCall, client: PrefillClient) -> Handoff:
        """Run (or launch) prefill and return what decode must be sent."""
