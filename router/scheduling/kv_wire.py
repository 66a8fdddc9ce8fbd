"""Decoding vLLM's KV event batches (the wire format is described in `kv_events`).

Two decoders, one result. The fast one decodes a batch straight into typed structs at C
speed (`msgspec` with the array layout of vLLM's tagged `KVCacheEvent` structs: field
order, optional trailing fields, extra trailing fields ignored, token ids checked to be
unsigned 32-bit): that is what every vLLM before vllm#42892 and the simulator send. Any
batch it does not accept, and only those, goes to the generic decoder, which walks plain
msgpack values: map-encoded events (newer vLLM), bytes block hashes mixed with ints, event
kinds it does not know (skipped), and malformed fields (a bad `token_ids` or `lora_name` is
dropped, a bad `medium` or `block_hashes` rejects the batch). Both return the same
`Stored` / `Removed` / `Cleared` values, so `apply_events` and the index never see which
one ran. Measured on batches of 60-block prefills (GPU store, store write, eviction): the
fast path decodes 1.4-2x faster.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Final

import msgspec

from router.scheduling.precise_index import PrecisePrefixIndex

_HASH_MASK: Final = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Stored:
    """A decoded `BlockStored` (group 0). `token_ids` None: the event carried none usable;
    `extra_keys` None: absent (vLLM before vllm#33304), else one entry per block."""

    block_hashes: tuple[int, ...]
    medium: str | None
    parent_block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    block_size: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: tuple[int, ...]
    medium: str | None


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


KVEvent = Stored | Removed | Cleared


class DecodeError(ValueError):
    """A payload that is not a vLLM KVEventBatch."""


# -- vLLM's array layout: the fast path's structs, and the generic path's field positions --

_TokenId = Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)]


class _WireEvent(msgspec.Struct, array_like=True, tag=True, gc=False):
    """`[tag, fields...]`; fields after the ones below (newer vLLM's) are ignored."""


class _WireStored(_WireEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: list[_TokenId] | None = None
    block_size: int | None = None
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class _WireRemoved(_WireEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


class _WireCleared(_WireEvent, tag="AllBlocksCleared"):
    pass


class _WireBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_WireStored | _WireRemoved | _WireCleared]


_typed_decoder = msgspec.msgpack.Decoder(_WireBatch)


_decoder = msgspec.msgpack.Decoder()

# Positions of fields in array-encoded events (index 0 is the tag): the structs' order.
_STORED_FIELDS: Final = {name: i for i, name in enumerate(_WireStored.__struct_fields__, 1)}
_REMOVED_FIELDS: Final = {name: i for i, name in enumerate(_WireRemoved.__struct_fields__, 1)}


def _hash(value: Any) -> int:
    if isinstance(value, int):
        return value & _HASH_MASK
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(value, "big") & _HASH_MASK
    raise DecodeError(f"block hash of type {type(value).__name__}")


def _field(event: Any, name: str, positions: Mapping[str, int]) -> Any:
    if isinstance(event, dict):
        return event.get(name)
    index = positions[name]
    return event[index] if index < len(event) else None


def _decode_event(raw: Any) -> KVEvent | None:
    if isinstance(raw, list | tuple) and raw:
        tag = raw[0]
    elif isinstance(raw, dict):
        tag = raw.get("type")
    else:
        raise DecodeError("event is neither an array nor a map")
    if tag == "AllBlocksCleared":
        return Cleared()
    if tag == "BlockStored":
        positions = _STORED_FIELDS
    elif tag == "BlockRemoved":
        positions = _REMOVED_FIELDS
    else:
        return None  # a newer event kind: not ours to interpret
    group = _field(raw, "group_idx", positions)
    if group not in (None, 0):
        return None
    hashes = _field(raw, "block_hashes", positions)
    if not isinstance(hashes, list):
        raise DecodeError(f"{tag}.block_hashes is not a list")
    medium = _field(raw, "medium", positions)
    if medium is not None and not isinstance(medium, str):
        raise DecodeError(f"{tag}.medium is not a string")
    block_hashes = tuple(_hash(h) for h in hashes)
    if tag == "BlockStored":
        return _stored(raw, block_hashes, medium)
    return Removed(block_hashes, medium)


def _stored(raw: Any, block_hashes: tuple[int, ...], medium: str | None) -> Stored:
    fields = _STORED_FIELDS
    parent = _field(raw, "parent_block_hash", fields)
    tokens = _field(raw, "token_ids", fields)
    size = _field(raw, "block_size", fields)
    lora = _field(raw, "lora_name", fields)
    extra = _field(raw, "extra_keys", fields)
    token_ids: tuple[int, ...] | None = None
    if isinstance(tokens, list):
        try:
            array("I", tokens)  # unsigned 32-bit ints, checked at C speed
            token_ids = tuple(tokens)
        except (TypeError, OverflowError):
            token_ids = None
    return Stored(
        block_hashes,
        medium,
        parent_block_hash=None if parent is None else _hash(parent),
        token_ids=token_ids,
        block_size=size if type(size) is int else None,
        lora_name=lora if isinstance(lora, str) else None,
        extra_keys=tuple(extra) if isinstance(extra, list) else None,
    )


def _int_hashes(values: list[int]) -> tuple[int, ...]:
    """Block hashes as unsigned 64-bit ints (msgpack ints are below 2**64 already)."""
    if values and min(values) < 0:
        return tuple(v & _HASH_MASK for v in values)
    return tuple(values)


def _decode_typed(payload: bytes) -> list[KVEvent] | None:
    """The batch's events, or None when the batch is not the array-encoded layout."""
    try:
        batch = _typed_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    out: list[KVEvent] = []
    for raw in batch.events:
        if type(raw) is _WireStored:
            if raw.group_idx:
                continue
            parent = raw.parent_block_hash
            tokens = raw.token_ids
            extra = raw.extra_keys
            out.append(Stored(
                _int_hashes(raw.block_hashes),
                raw.medium,
                parent_block_hash=None if parent is None else parent & _HASH_MASK,
                token_ids=None if tokens is None else tuple(tokens),
                block_size=raw.block_size,
                lora_name=raw.lora_name,
                extra_keys=None if extra is None else tuple(extra),
            ))  # fmt: skip
        elif type(raw) is _WireRemoved:
            if not raw.group_idx:
                out.append(Removed(_int_hashes(raw.block_hashes), raw.medium))
        else:
            out.append(Cleared())
    return out


def decode_batch(payload: bytes) -> list[KVEvent]:
    """The events of one msgpack KVEventBatch (array or map encoded; see the docstring)."""
    fast = _decode_typed(payload)
    return fast if fast is not None else _decode_generic(payload)


def _decode_generic(payload: bytes) -> list[KVEvent]:
    try:
        batch = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise DecodeError(str(exc)) from None
    if isinstance(batch, list) and len(batch) >= 2:
        events = batch[1]
    elif isinstance(batch, dict):
        events = batch.get("events")
    else:
        raise DecodeError("batch is neither [ts, events, dp_rank] nor a map")
    if not isinstance(events, list):
        raise DecodeError("batch events is not a list")
    out: list[KVEvent] = []
    for raw in events:
        event = _decode_event(raw)
        if event is not None:
            out.append(event)
    return out


def apply_events(
    index: PrecisePrefixIndex, key: str, scope: str, events: Sequence[KVEvent]
) -> None:
    for event in events:
        if isinstance(event, Stored):
            index.stored(
                key, scope, event.block_hashes, event.medium,
                parent=event.parent_block_hash, token_ids=event.token_ids,
                block_size=event.block_size, extra_keys=event.extra_keys,
                lora_name=event.lora_name,
            )
        elif isinstance(event, Removed):
            index.removed(key, scope, event.block_hashes, event.medium)
        else:
            index.cleared(key)


__all__ = [
    "Cleared",
    "DecodeError",
    "KVEvent",
    "Removed",
    "Stored",
    "apply_events",
    "decode_batch",
]
