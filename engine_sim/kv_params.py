"""The `kv_transfer_params` wire shape of the sequential-handle PD protocol (vLLM NixlConnector).

A request to prefill carries `{"do_remote_decode": true, ...nulls}`. Prefill answers with
the handle below; the router forwards it unchanged to decode, which reads the KV it names:

    do_remote_prefill  true              do_remote_decode  false
    remote_engine_id   prefill's id      remote_request_id prefill's internal request id
    remote_host        prefill's NIXL side-channel host (VLLM_NIXL_SIDE_CHANNEL_HOST,
                       default "localhost")
    remote_port        its side-channel port (VLLM_NIXL_SIDE_CHANNEL_PORT, default 5600)
                       + the engine's data-parallel rank, as vLLM's NixlConnector
    remote_block_ids   prefill's block ids of the transferred blocks (ints; nested one
                       list per KV group with --block-ids-per-group, as newer vLLM does)
    remote_num_tokens  prompt tokens prefill computed
    tp_size            1
    mooncake_store_keys  (ours) Mooncake Store keys of the transferred blocks, in order

Only full blocks are transferred; decode recomputes the partial tail. Only a non-streaming
prefill response carries the handle. As in vLLM, decode
treats a handle missing any of engine id, host, port or block ids as "no transfer" and
prefills locally; here the store keys are required too.

Upstream vLLM's MooncakeConnector carries no handle: prefill gets `transfer_id` beside
`do_remote_decode`, and decode gets `transfer_id`, `remote_bootstrap_addr` and
`remote_engine_id` (`RendezvousParams`; the exchange is in `engine_sim.bootstrap`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final

STORE_KEYS_FIELD: Final = "mooncake_store_keys"
TRANSFER_ID_FIELD: Final = "transfer_id"
BOOTSTRAP_ADDR_FIELD: Final = "remote_bootstrap_addr"


class TransferMode(Enum):
    """What a request's `kv_transfer_params` asks of this pod."""

    NONE = "none"  # no PD: compute and decode here
    EXPORT = "export"  # prefill leg: compute the prompt and publish its KV
    IMPORT = "import"  # decode leg with a usable handle: read the KV
    INCOMPLETE = "incomplete"  # decode leg whose handle is unusable: prefill locally


@dataclass(frozen=True, slots=True)
class PrefillHandle:
    """A usable decode-side handle."""

    engine_id: str
    request_id: str | None
    host: str
    port: int
    block_ids: tuple[int, ...]
    num_tokens: int | None
    store_keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RendezvousParams:
    """Decode-side fields of upstream vLLM's MooncakeConnector: whom to pull from, by id."""

    transfer_id: str
    bootstrap_addr: str
    engine_id: str


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """`handle` (NIXL-shaped) or `rendezvous` on IMPORT; `transfer_id` on an upstream EXPORT."""

    mode: TransferMode
    handle: PrefillHandle | None = None
    rendezvous: RendezvousParams | None = None
    transfer_id: str | None = None


def _flat_block_ids(raw: Any) -> tuple[int, ...] | None:
    if not isinstance(raw, list):
        return None
    if raw and all(isinstance(group, list) for group in raw):
        raw = raw[0]  # one list per KV group: the simulator has one group
    if not all(isinstance(item, int) and not isinstance(item, bool) for item in raw):
        return None
    return tuple(raw)


def parse_kv_transfer_params(raw: Any) -> TransferPlan:
    """Classify a request's `kv_transfer_params` (None when absent). Raises ValueError if not
    an object."""
    if raw is None:
        return TransferPlan(TransferMode.NONE)
    if not isinstance(raw, Mapping):
        raise ValueError("'kv_transfer_params' must be an object")
    if raw.get("do_remote_decode") is True:
        transfer_id = raw.get(TRANSFER_ID_FIELD)
        if isinstance(transfer_id, str) and transfer_id:
            return TransferPlan(TransferMode.EXPORT, transfer_id=transfer_id)
        return TransferPlan(TransferMode.EXPORT)
    if raw.get("do_remote_prefill") is not True:
        return TransferPlan(TransferMode.NONE)
    if TRANSFER_ID_FIELD in raw or BOOTSTRAP_ADDR_FIELD in raw:
        return _rendezvous_plan(raw)
    engine_id, host, port = (
        raw.get("remote_engine_id"),
        raw.get("remote_host"),
        raw.get("remote_port"),
    )
    block_ids = _flat_block_ids(raw.get("remote_block_ids"))
    keys = raw.get(STORE_KEYS_FIELD)
    if (
        not isinstance(engine_id, str)
        or not isinstance(host, str)
        or not isinstance(port, int)
        or block_ids is None
        or not isinstance(keys, list)
        or not all(isinstance(key, str) for key in keys)
    ):
        return TransferPlan(TransferMode.INCOMPLETE)
    request_id = raw.get("remote_request_id")
    num_tokens = raw.get("remote_num_tokens")
    return TransferPlan(
        TransferMode.IMPORT,
        PrefillHandle(
            engine_id=engine_id,
            request_id=request_id if isinstance(request_id, str) else None,
            host=host,
            port=port,
            block_ids=block_ids,
            num_tokens=num_tokens if isinstance(num_tokens, int) else None,
            store_keys=tuple(keys),
        ),
    )


def _rendezvous_plan(raw: Mapping[str, Any]) -> TransferPlan:
    """Upstream vLLM decode params: all three fields or, as in vLLM, no transfer at all."""
    values = [raw.get(name) for name in (TRANSFER_ID_FIELD, BOOTSTRAP_ADDR_FIELD)]
    values.append(raw.get("remote_engine_id"))
    if not all(isinstance(value, str) and value for value in values):
        return TransferPlan(TransferMode.INCOMPLETE)
    transfer_id, bootstrap_addr, engine_id = values
    return TransferPlan(
        TransferMode.IMPORT,
        rendezvous=RendezvousParams(str(transfer_id), str(bootstrap_addr), str(engine_id)),
    )


def build_prefill_handle(
    *,
    engine_id: str,
    request_id: str,
    host: str,
    port: int,
    block_ids: Sequence[int],
    num_tokens: int,
    store_keys: Sequence[str],
    per_group: bool = False,
) -> dict[str, Any]:
    """The handle prefill returns in its response's `kv_transfer_params`."""
    ids = list(block_ids)
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [ids] if per_group else ids,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "remote_num_tokens": num_tokens,
        "tp_size": 1,
        STORE_KEYS_FIELD: list(store_keys),
    }
