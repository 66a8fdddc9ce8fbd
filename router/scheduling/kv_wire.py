"""Decoding vLLM's KV event batches (the wire format is described in `kv_events`).

Two encodings, one result. vLLM before vllm#42892 (and the simulator by default) writes a
batch and its events as arrays (`array_like` structs: field order, trailing fields
optional); newer vLLM writes maps, each event tagged under `"type"`. The first byte of a
batch says which: each has a typed decoder at C speed (`msgspec` structs of the fields
pdgate reads; fields it does not know are ignored, token ids are checked to be unsigned
32-bit). A batch neither typed decoder accepts goes to the generic decoder, which walks
plain msgpack values: bytes block hashes mixed with ints, event kinds it does not know
(skipped), malformed fields (a bad `token_ids` or `lora_name` is dropped, a bad `medium` or
`block_hashes` rejects the batch). All return the same `Stored` / `Removed` / `Cleared`
values, so `apply_events` and the index never see which one ran.

Runs. vLLM's `MooncakeStoreConnector` publishes every block it writes to the store as an
event of its own, its parent the block before it. Consecutive one-block `BlockStored`s
that chain (each one's parent the last block of the run so far) and agree on medium,
block size, LoRA name and whether they carry token ids and extra keys are merged into one
`Stored`: the index applies a run as it would the blocks one by one, at one call.

KV cache groups. A hybrid model (sliding-window or Mamba layers beside full attention)
has a group per kind of layer, numbered in layer order, and a block is cached per group.
A prompt's prefix hit is bounded by the full-attention group (the others keep a window or
a state), so that is the group indexed: each stream's `GroupChoice` learns the groups'
kinds from their `BlockStored`s (`kv_cache_spec_kind`, vllm#40984; a whole batch is read
for kinds before any of its events is kept) and keeps the lowest group of a
full-attention kind; a `BlockRemoved` names only its group. Until a full-attention group
is known (older vLLM without kinds, one group, or one vLLM calls "unknown"), group 0
(`group_idx` absent, None or 0) is indexed; should the choice move off a group already
indexed, `switched` tells the stream to clear the pod's entries first.

Measured on batches of 60-block prefills (GPU store, store write, eviction): the typed
path decodes 1.4-2x faster than the generic one.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Final

import msgspec

from router.scheduling.precise_index import PrecisePrefixIndex

_HASH_MASK: Final = (1 << 64) - 1
#: `kv_cache_spec_kind`s whose blocks cover a prompt from its start (vLLM's
#: `KVCacheSpecKind`): the group indexed is the lowest of these kinds.
FULL_PREFIX_KINDS: Final = frozenset({"full_attention", "mla_attention", "sink_full_attention"})


@dataclass(frozen=True, slots=True)
class Stored:
    """A decoded `BlockStored` (or a run of them). `token_ids` None: the event carried none
    usable; `extra_keys` None: absent (vLLM before vllm#33304), else one entry per block."""

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


class GroupChoice:
    """Which KV cache group of one engine's stream is indexed (module docstring).

    `group`: the chosen group, None until a `BlockStored` of a full-attention kind is
    seen (until then group 0 is kept). `switched`: the choice moved off a group whose
    events were kept (the stream clears the pod's entries and resets it)."""

    __slots__ = ("group", "kept", "kinds", "switched")

    def __init__(self) -> None:
        self.group: int | None = None
        self.kinds: dict[int, str] = {}
        self.kept = False  # some event was kept under the current choice
        self.switched = False

    def learn(self, group: int | None, kind: str | None) -> None:
        """A `BlockStored`'s group and kind (read for a whole batch before its events)."""
        index = group or 0
        if kind is None or index in self.kinds or len(self.kinds) >= 64:
            return
        self.kinds[index] = kind
        if kind in FULL_PREFIX_KINDS and (self.group is None or index < self.group):
            if self.kept and index != (self.group or 0):
                self.switched = True
            self.group = index

    def keep(self, group: int | None) -> bool:
        """Whether an event of `group` is indexed."""
        kept = (group or 0) == (self.group or 0)
        self.kept = self.kept or kept
        return kept


# -- the typed decoders: vLLM's array layout, and its map layout -----------------------------

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
    kv_cache_spec_kind: str | None = None


class _WireRemoved(_WireEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


class _WireCleared(_WireEvent, tag="AllBlocksCleared"):
    pass


class _WireBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_WireStored | _WireRemoved | _WireCleared]
    data_parallel_rank: int | None = None


class _MapEvent(msgspec.Struct, tag=True, gc=False):
    """`{"type": tag, field: value...}`; fields not below are ignored."""


class _MapStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: list[_TokenId] | None = None
    block_size: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _MapRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


class _MapCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


class _MapBatch(msgspec.Struct, gc=False):
    ts: float
    events: list[_MapStored | _MapRemoved | _MapCleared]
    data_parallel_rank: int | None = None


class _MixedBatch(msgspec.Struct, array_like=True, gc=False):
    """A positional batch of map events (seen between the two layouts)."""

    ts: float
    events: list[_MapStored | _MapRemoved | _MapCleared]
    data_parallel_rank: int | None = None


_array_decoder = msgspec.msgpack.Decoder(_WireBatch)
_map_decoder = msgspec.msgpack.Decoder(_MapBatch)
_mixed_decoder = msgspec.msgpack.Decoder(_MixedBatch)
_STORED_TYPES: Final = (_WireStored, _MapStored)
_REMOVED_TYPES: Final = (_WireRemoved, _MapRemoved)


_decoder = msgspec.msgpack.Decoder()

# Positions of fields in array-encoded events (index 0 is the tag): the structs' order.
_STORED_FIELDS: Final = {name: i for i, name in enumerate(_WireStored.__struct_fields__, 1)}
_REMOVED_FIELDS: Final = {name: i for i, name in enumerate(_WireRemoved.__struct_fields__, 1)}


def _is_map(payload: bytes) -> bool:
    """Whether a msgpack value starts as a map (fixmap, map 16, map 32)."""
    first = payload[0] if payload else 0
    return 0x80 <= first <= 0x8F or first in (0xDE, 0xDF)


class _Runs:
    """The decoded events of one batch, consecutive one-block stores merged (docstring)."""

    __slots__ = ("out", "run")

    def __init__(self) -> None:
        self.out: list[KVEvent] = []
        #: The open run: [hashes, medium, parent, tokens or None, size, lora, extras or None]
        self.run: list[Any] | None = None

    def stored(
        self, hashes: list[int], medium: str | None, parent: int | None,
        tokens: list[int] | None, size: int | None, lora: str | None, extra: list[Any] | None,
    ) -> None:
        run = self.run
        if (
            run is not None
            and len(hashes) == 1
            and parent == run[0][-1]
            and medium == run[1]
            and size == run[4]
            and lora == run[5]
            and (tokens is None) == (run[3] is None)
            and (extra is None) == (run[6] is None)
            and (tokens is None or (size is not None and len(tokens) == size))
            and (extra is None or len(extra) == 1)
        ):
            run[0].append(hashes[0])
            if tokens is not None:
                run[3].extend(tokens)
            if extra is not None:
                run[6].extend(extra)
            return
        self.close()
        if (
            len(hashes) == 1
            and (tokens is None or (size is not None and len(tokens) == size))
            and (extra is None or len(extra) == 1)
        ):
            self.run = [
                list(hashes), medium, parent, None if tokens is None else list(tokens), size,
                lora, None if extra is None else list(extra),
            ]
        else:
            self.out.append(_stored_of(hashes, medium, parent, tokens, size, lora, extra))

    def other(self, event: KVEvent) -> None:
        self.close()
        self.out.append(event)

    def close(self) -> None:
        run = self.run
        if run is not None:
            self.run = None
            self.out.append(_stored_of(*run))

    def events(self) -> list[KVEvent]:
        self.close()
        return self.out


def _stored_of(
    hashes: list[int], medium: str | None, parent: int | None, tokens: list[int] | None,
    size: int | None, lora: str | None, extra: list[Any] | None,
) -> Stored:
    return Stored(
        tuple(hashes), medium, parent_block_hash=parent,
        token_ids=None if tokens is None else tuple(tokens), block_size=size,
        lora_name=lora, extra_keys=None if extra is None else tuple(extra),
    )


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


def _decode_event(raw: Any, groups: GroupChoice, runs: _Runs) -> None:
    if isinstance(raw, list | tuple) and raw:
        tag = raw[0]
    elif isinstance(raw, dict):
        tag = raw.get("type")
    else:
        raise DecodeError("event is neither an array nor a map")
    if tag == "AllBlocksCleared":
        runs.other(Cleared())
        return
    if tag == "BlockStored":
        positions = _STORED_FIELDS
    elif tag == "BlockRemoved":
        positions = _REMOVED_FIELDS
    else:
        return  # a newer event kind: not ours to interpret
    group = _field(raw, "group_idx", positions)
    if not isinstance(group, int | None) or not groups.keep(group):
        return
    hashes = _field(raw, "block_hashes", positions)
    if not isinstance(hashes, list):
        raise DecodeError(f"{tag}.block_hashes is not a list")
    medium = _field(raw, "medium", positions)
    if medium is not None and not isinstance(medium, str):
        raise DecodeError(f"{tag}.medium is not a string")
    block_hashes = [_hash(h) for h in hashes]
    if tag == "BlockRemoved":
        runs.other(Removed(tuple(block_hashes), medium))
        return
    fields = _STORED_FIELDS
    parent = _field(raw, "parent_block_hash", fields)
    tokens = _field(raw, "token_ids", fields)
    size = _field(raw, "block_size", fields)
    lora = _field(raw, "lora_name", fields)
    extra = _field(raw, "extra_keys", fields)
    token_ids: list[int] | None = None
    if isinstance(tokens, list):
        try:
            array("I", tokens)  # unsigned 32-bit ints, checked at C speed
            token_ids = tokens
        except (TypeError, OverflowError):
            token_ids = None
    runs.stored(
        block_hashes, medium, None if parent is None else _hash(parent), token_ids,
        size if type(size) is int else None, lora if isinstance(lora, str) else None,
        extra if isinstance(extra, list) else None,
    )


def _int_hashes(values: list[int]) -> list[int]:
    """Block hashes as unsigned 64-bit ints (msgpack ints are below 2**64 already)."""
    if values and min(values) < 0:
        return [v & _HASH_MASK for v in values]
    return values


def _decode_typed(
    payload: bytes, groups: GroupChoice | None = None, rank: int | None = None
) -> list[KVEvent] | None:
    """The batch's events, or None when neither typed layout accepts the batch."""
    batch: _WireBatch | _MapBatch | _MixedBatch
    try:
        if _is_map(payload):
            batch = _map_decoder.decode(payload)
        else:
            try:
                batch = _array_decoder.decode(payload)
            except msgspec.ValidationError:
                batch = _mixed_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    _check_rank(batch.data_parallel_rank, rank)
    groups = groups or GroupChoice()
    for raw in batch.events:  # the batch's kinds first: its events are kept by all of them
        if isinstance(raw, _STORED_TYPES) and raw.kv_cache_spec_kind is not None:
            groups.learn(raw.group_idx, raw.kv_cache_spec_kind)
    runs = _Runs()
    for raw in batch.events:
        if isinstance(raw, _STORED_TYPES):
            if not groups.keep(raw.group_idx):
                continue
            parent = raw.parent_block_hash
            runs.stored(
                _int_hashes(raw.block_hashes), raw.medium,
                None if parent is None else parent & _HASH_MASK, raw.token_ids,
                raw.block_size, raw.lora_name, raw.extra_keys,
            )  # fmt: skip
        elif isinstance(raw, _REMOVED_TYPES):
            if groups.keep(raw.group_idx):
                runs.other(Removed(tuple(_int_hashes(raw.block_hashes)), raw.medium))
        else:
            runs.other(Cleared())
    return runs.events()


def decode_batch(
    payload: bytes, groups: GroupChoice | None = None, rank: int | None = None
) -> list[KVEvent]:
    """The events of one msgpack KVEventBatch (array or map encoded; see the docstring).
    `groups`: the stream's group choice, which this batch's events may teach (None: a
    fresh one, as for a stream's first batch). `rank`: the data-parallel rank the stream
    belongs to; a batch naming another (`data_parallel_rank`: the events port reaches
    another engine, e.g. a misdeclared events port) is refused with `RankMismatch`, so its
    blocks are never credited to the wrong target. A batch naming none is taken. (A
    misdeclared first rank shows in the engine metrics instead: vLLM offsets a rank's
    ports by the rank it labels its batches with.)"""
    groups = groups or GroupChoice()
    fast = _decode_typed(payload, groups, rank)
    return fast if fast is not None else _decode_generic(payload, groups, rank)


class RankMismatch(DecodeError):
    """A batch of another data-parallel rank than the stream's."""


def _check_rank(found: Any, expected: int | None) -> None:
    if expected is not None and found is not None and found != expected:
        raise RankMismatch(f"a batch of data-parallel rank {found!r} on the stream of "
                           f"rank {expected}")


def _decode_generic(
    payload: bytes, groups: GroupChoice | None = None, rank: int | None = None
) -> list[KVEvent]:
    try:
        batch = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise DecodeError(str(exc)) from None
    if isinstance(batch, list) and len(batch) >= 2:
        events = batch[1]
        _check_rank(batch[2] if len(batch) > 2 else None, rank)
    elif isinstance(batch, dict):
        events = batch.get("events")
        _check_rank(batch.get("data_parallel_rank"), rank)
    else:
        raise DecodeError("batch is neither [ts, events, dp_rank] nor a map")
    if not isinstance(events, list):
        raise DecodeError("batch events is not a list")
    groups = groups or GroupChoice()
    for raw in events:  # the batch's kinds first, as the typed path reads them
        _learn_kind(raw, groups)
    runs = _Runs()
    for raw in events:
        _decode_event(raw, groups, runs)
    return runs.events()


def _learn_kind(raw: Any, groups: GroupChoice) -> None:
    stored = (isinstance(raw, dict) and raw.get("type") == "BlockStored") or (
        isinstance(raw, list | tuple) and bool(raw) and raw[0] == "BlockStored"
    )
    if stored:
        group = _field(raw, "group_idx", _STORED_FIELDS)
        kind = _field(raw, "kv_cache_spec_kind", _STORED_FIELDS)
        if isinstance(group, int | None) and isinstance(kind, str):
            groups.learn(group, kind)


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
    "FULL_PREFIX_KINDS",
    "Cleared",
    "DecodeError",
    "GroupChoice",
    "KVEvent",
    "RankMismatch",
    "Removed",
    "Stored",
    "apply_events",
    "decode_batch",
]
