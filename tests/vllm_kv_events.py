"""vLLM's KV event structs, restated from `vllm/distributed/kv_events.py` for the tests.

Decoding the simulator's payloads with these, and encoding the router's test input with
them, checks both sides against vLLM's contract rather than against each other. Two
layouts: `Map*` is vLLM's since vllm#42892 (maps, each event tagged under "type", fields
at their default left out); `Array*` the releases before (`array_like=True`: positional
arrays, every field written). Block hashes are ints, or bytes with
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`.
"""

from __future__ import annotations

from typing import Any

import msgspec

# -- vLLM since vllm#42892 ------------------------------------------------------------------


class MapBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapBlockStored(MapEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class MapBlockRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class MapAllBlocksCleared(MapEvent, tag="AllBlocksCleared"):
    pass


class MapKVEventBatch(MapBatch):
    events: list[MapBlockStored | MapBlockRemoved | MapAllBlocksCleared]


# -- vLLM before vllm#42892 -----------------------------------------------------------------


class ArrayBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class ArrayBlockStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class ArrayBlockRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class ArrayAllBlocksCleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


class ArrayKVEventBatch(ArrayBatch):
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]


map_decoder = msgspec.msgpack.Decoder(type=MapKVEventBatch)
array_decoder = msgspec.msgpack.Decoder(type=ArrayKVEventBatch)
