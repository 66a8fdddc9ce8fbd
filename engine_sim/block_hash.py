"""vLLM's chained block hashes: the ids the prefix cache, the KV store and KV events share.

The algorithm is vLLM's own, imported from the router's model of it (`router.kvhash.vllm`;
the simulator may import the router's model of vLLM, never the other way round): each full
block of `block_size` tokens is hashed with `--prefix-caching-hash-algo` over (parent
digest, token ids, extra keys), the first block's parent being the root `NONE_HASH`, and
a block is known by the int vLLM publishes in KV events (the digest's last 8 bytes).

The root follows vLLM's PYTHONHASHSEED semantics: with a seed (`--python-hash-seed`,
default the PYTHONHASHSEED environment variable) it is `hash_fn(seed)`, the same in every
process; without one it is random per process, so two simulated pods then name the same
prefix differently, exactly as two vLLM pods do. pdgate's launchers (tests, `make demo`,
benchmarks) give their pods `DEFAULT_HASH_SEED`, as a real deployment sharing a Mooncake
Store must give its engines one PYTHONHASHSEED.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

from router.kvhash.vllm import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_HASH_ALGO,
    EVENT_HASH_MASK,
    HashAlgo,
    VllmBlockHasher,
    VllmHashConfig,
)

HASH_MASK_64: Final = EVENT_HASH_MASK
#: The PYTHONHASHSEED pdgate's launchers give simulated pods (see the module docstring).
DEFAULT_HASH_SEED: Final = "0"
#: Default bound of a `BlockHashMemo` (prompts).
BLOCK_HASH_MEMO_SIZE: Final = 256

__all__ = [
    "BLOCK_HASH_MEMO_SIZE",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_HASH_ALGO",
    "DEFAULT_HASH_SEED",
    "HASH_MASK_64",
    "BlockHashMemo",
    "hash_prompt_blocks",
    "pack_tokens",
]


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as 4-byte unsigned big-endian integers (for the simulator's own digests)."""
    packed = array("I", token_ids)
    if packed.itemsize != 4:
        return struct.pack(f">{len(token_ids)}I", *token_ids)
    if sys.byteorder == "little":
        packed.byteswap()
    return packed.tobytes()


def hash_prompt_blocks(
    token_ids: Sequence[int],
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    cache_salt: str | None = None,
    seed: str = DEFAULT_HASH_SEED,
    algo: HashAlgo = DEFAULT_HASH_ALGO,
) -> list[int]:
    """The event ints of every full block of a prompt, for an engine with this seed/algo."""
    hasher = VllmBlockHasher(VllmHashConfig(algo, seed, block_size))
    return hasher.event_hashes(token_ids, cache_salt=cache_salt)


class BlockHashMemo:
    """One engine's block hashes (its root drawn once), remembering recent prompts (LRU).

    Hashing costs about 1.7 us per block with sha256; benchmarks repeat prompts.
    """

    def __init__(
        self,
        block_size: int = DEFAULT_BLOCK_SIZE,
        seed: str | None = DEFAULT_HASH_SEED,
        algo: HashAlgo = DEFAULT_HASH_ALGO,
        max_entries: int = BLOCK_HASH_MEMO_SIZE,
    ) -> None:
        self.hasher = VllmBlockHasher(VllmHashConfig(algo, seed, block_size))
        self.block_size = block_size
        self.max_entries = max_entries
        self._memo: OrderedDict[
            tuple[tuple[int, ...], str | None, str | None], tuple[int, ...]
        ] = OrderedDict()

    def hashes(
        self, token_ids: tuple[int, ...], cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> tuple[int, ...]:
        """The prompt's block hashes; an adapter's name is in every block's (vLLM's
        `_gen_lora_extra_hash_keys`), so adapters never share cached blocks."""
        key = (token_ids, cache_salt, lora_name)
        found = self._memo.get(key)
        if found is not None:
            self._memo.move_to_end(key)
            return found
        computed = tuple(self.hasher.event_hashes(
            token_ids, cache_salt=cache_salt, lora_name=lora_name
        ))
        self._memo[key] = computed
        if len(self._memo) > self.max_entries:
            self._memo.popitem(last=False)
        return computed
