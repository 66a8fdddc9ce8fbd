"""What the prefix cache reports when blocks enter or leave it.

These mirror vLLM's KV events (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) so that a
publisher can later put them on ZMQ unchanged in meaning; the cache only calls a sink.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive blocks of one prompt became cached; `parent_block_hash` precedes the first.

    `first_block` is the index of the first of them in the prompt, `cache_salt` the
    prompt's salt and `lora_name` its adapter: together they give each block's extra keys
    (vLLM salts block 0 only, and names the adapter on every block; `lora_id` is the
    adapter's number, vLLM's deprecated field beside the name).
    """

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    first_block: int = 0
    cache_salt: str | None = None
    lora_name: str | None = None
    lora_id: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks were evicted from the cache."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole cache was reset."""


CacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
CacheEventSink = Callable[[CacheEvent], None]
