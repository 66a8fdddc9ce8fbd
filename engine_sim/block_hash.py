"""vLLM-style chained block hashes: the ids the prefix cache, the KV store and KV events share.

Like vLLM, a block is `block_size` consecutive prompt tokens (only full blocks count), and
a block's hash covers its parent's hash, its own token ids and optional extra keys, so
equal hashes mean equal prefixes. vLLM's default algorithm is sha256 over a pickle of
`(parent, tokens, extra_keys)`, published as the low 64 bits; pickle bytes are not a
contract, so the simulator hashes this canonical encoding instead (all integers
big-endian):

    parent hash   8 bytes, unsigned
    token count   4 bytes, unsigned
    token ids     4 bytes each, unsigned
    extra keys    b"" when None, else orjson.dumps(list(extra_keys))

`hash = int.from_bytes(sha256(encoding).digest(), "big") & (2**64 - 1)` (vLLM's
`maybe_convert_block_hash`). The first block's parent is `root_hash(seed)`: the low 64
bits of sha256(b"engine_sim/root/" + seed utf-8), with a fixed default seed so that every
process (engines and router) agrees, as vLLM does for sha256. When a request carries a
`cache_salt`, the first block's extra keys are `(cache_salt,)`, as in vLLM.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

import orjson

HASH_MASK_64: Final = (1 << 64) - 1
DEFAULT_HASH_SEED: Final = "0"
DEFAULT_BLOCK_SIZE: Final = 16
#: Default bound of a `BlockHashMemo` (prompts).
BLOCK_HASH_MEMO_SIZE: Final = 256

ExtraKeys = tuple[str | int, ...]


def root_hash(seed: str = DEFAULT_HASH_SEED) -> int:
    """Parent hash of the first block of every prompt."""
    digest = hashlib.sha256(b"engine_sim/root/" + seed.encode("utf-8")).digest()
    return int.from_bytes(digest, "big") & HASH_MASK_64


def hash_block_tokens(
    parent_hash: int, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None
) -> int:
    """Hash of one block given its parent's hash (see the module docstring)."""
    count = len(token_ids)
    encoded = struct.pack(f">QI{count}I", parent_hash & HASH_MASK_64, count, *token_ids)
    if extra_keys is not None:
        encoded += orjson.dumps(list(extra_keys))
    return int.from_bytes(hashlib.sha256(encoded).digest(), "big") & HASH_MASK_64


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as 4-byte unsigned big-endian integers (the encoding used above)."""
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
) -> list[int]:
    """Chained hashes of every full block of a prompt, in order (the partial tail is skipped).

    Same result as chaining `hash_block_tokens`, with the tokens packed once.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    num_blocks = len(token_ids) // block_size
    packed = pack_tokens(token_ids[: num_blocks * block_size])
    count = struct.pack(">I", block_size)
    stride = 4 * block_size
    sha256 = hashlib.sha256
    hashes: list[int] = []
    parent = root_hash(seed)
    for index in range(num_blocks):
        encoded = parent.to_bytes(8, "big") + count + packed[index * stride : (index + 1) * stride]
        if index == 0 and cache_salt is not None:
            encoded += orjson.dumps([cache_salt])
        parent = int.from_bytes(sha256(encoded).digest()[-8:], "big")
        hashes.append(parent)
    return hashes


class BlockHashMemo:
    """`hash_prompt_blocks` for one engine, remembering recent prompts (bounded LRU).

    Hashing costs about 1.3 us per block in Python; benchmarks repeat prompts.
    """

    def __init__(
        self,
        block_size: int = DEFAULT_BLOCK_SIZE,
        seed: str = DEFAULT_HASH_SEED,
        max_entries: int = BLOCK_HASH_MEMO_SIZE,
    ) -> None:
        self.block_size = block_size
        self.seed = seed
        self.max_entries = max_entries
        self._memo: OrderedDict[tuple[tuple[int, ...], str | None], tuple[int, ...]] = OrderedDict()

    def hashes(self, token_ids: tuple[int, ...], cache_salt: str | None = None) -> tuple[int, ...]:
        key = (token_ids, cache_salt)
        found = self._memo.get(key)
        if found is not None:
            self._memo.move_to_end(key)
            return found
        computed = tuple(
            hash_prompt_blocks(token_ids, self.block_size, cache_salt=cache_salt, seed=self.seed)
        )
        self._memo[key] = computed
        if len(self._memo) > self.max_entries:
            self._memo.popitem(last=False)
        return computed
