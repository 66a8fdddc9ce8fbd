"""vLLM's prefix-cache block hashes, reproduced: what its KV events and its cache key on.

Read from vLLM's source (main, 2026); nothing is copied, the algorithm is restated here.

Serializers and digests (`vllm/utils/hashing.py`: `sha256`, `sha256_cbor`, `xxhash`,
`xxhash_cbor`, `get_hash_fn_by_name`), chosen by `--prefix-caching-hash-algo`
(`vllm/config/cache.py`, `PrefixCachingHashAlgo`, default "sha256"):

    sha256       sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), 32 bytes
    sha256_cbor  sha256(cbor2.dumps(obj, canonical=True)), 32 bytes
    xxhash       xxh3_128(pickle bytes as above), 16 bytes
    xxhash_cbor  xxh3_128(canonical CBOR as above), 16 bytes

`pickle.HIGHEST_PROTOCOL` is 5 on every Python vLLM supports (3.8 to 3.14), so protocol 5
is pinned here. A fork adds `sha256_msgpack` / `xxhash_msgpack`; vLLM main does not accept
them, so neither does this module.

Root hash (`vllm/v1/core/kv_cache_utils.py`, `init_none_hash`, module global `NONE_HASH`):
with `PYTHONHASHSEED` set in the engine's environment, `NONE_HASH = hash_fn(seed)` where
`seed` is the environment string itself (so "0" hashes the str "0"); unset, it is 32
random bytes (`os.urandom(32)`), different in every engine process, for every algorithm.
vLLM only warns about that for the CBOR algorithms. So a router can reproduce an engine's
hashes only when it knows the engine's `PYTHONHASHSEED` (`none_hash`, below).

One block (`hash_block_tokens`): `hash_fn((parent, tuple(block_token_ids), extra_keys))`
where `parent` is the previous block's full digest (bytes), `NONE_HASH` for the first block
(vLLM substitutes it for any falsy parent), and `extra_keys` is a tuple or None.

A request's blocks (`get_request_block_hasher`): only full blocks of `block_size` tokens
(the scheduler's `hash_block_size`, normally the KV block size) are hashed, chained in
order. Extra keys per block (`generate_block_hash_extra_keys`), concatenated in this order,
None when all are empty:

    LoRA        (lora_name,) on every block when the request uses an adapter
                (`_gen_lora_extra_hash_keys`);
    multimodal  one (identifier, offset - block_start) per multimodal item that overlaps
                the block [start, end), items in prompt order (`_gen_mm_extra_hash_keys`;
                the offset is relative to the block and may be negative);
    cache_salt  (cache_salt,) on the first block only, when the salt is non-empty;
    embeds      sha256 of the block's prompt-embedding bytes (`_gen_prompt_embeds_...`;
                not reproduced: the router never holds the tensors).

In events (`maybe_convert_block_hash`): with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1` (the
default, `vllm/envs.py`) a digest is published as
`int.from_bytes(digest, "big") & (2**64 - 1)`, i.e. its LAST 8 bytes read big-endian
(`event_hash`); with 0, the raw digest bytes. `BlockStored` (`vllm/distributed/
kv_events.py`, built in `BlockPool.cache_full_blocks`) carries `block_hashes`,
`parent_block_hash` (None for a prompt's first block), the blocks' `token_ids`,
`block_size`, `lora_id` (deprecated), `medium` ("GPU"), `lora_name`, and since vllm#33304
`extra_keys`: one entry per block, the tuple above or None.

Caveat, pickle only: pickle writes a repeated str object once and refers back to it, so
(lora_name, cache_salt) hashes differently when both are the SAME Python object; vLLM
builds them from different sources, and so does this module.

Golden values: `tests/unit/test_kvhash_vllm.py` (cross-checked against vectors published
from vLLM v0.17.0's own functions).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, get_args

import cbor2
import xxhash

HashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
#: Every value of vLLM's `--prefix-caching-hash-algo`.
HASH_ALGOS: Final[tuple[HashAlgo, ...]] = get_args(HashAlgo)
DEFAULT_HASH_ALGO: Final[HashAlgo] = "sha256"
#: vLLM's `CacheConfig.DEFAULT_BLOCK_SIZE`.
DEFAULT_BLOCK_SIZE: Final = 16
#: `pickle.HIGHEST_PROTOCOL` of every Python vLLM runs on.
PICKLE_PROTOCOL: Final = 5
#: Bytes of the random root vLLM draws when PYTHONHASHSEED is unset.
RANDOM_ROOT_BYTES: Final = 32
EVENT_HASH_MASK: Final = (1 << 64) - 1

HashFn = Callable[[Any], bytes]
ExtraKeys = tuple[Any, ...]

_xxh3_128 = xxhash.xxh3_128_digest
_sha256 = hashlib.sha256
_pickle = pickle.dumps
_cbor = cbor2.dumps


def sha256_pickle(obj: Any) -> bytes:
    """vLLM `sha256`."""
    return _sha256(_pickle(obj, protocol=PICKLE_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    """vLLM `sha256_cbor`."""
    return _sha256(_cbor(obj, canonical=True)).digest()


def xxhash_pickle(obj: Any) -> bytes:
    """vLLM `xxhash` (xxh3, 128 bits)."""
    return _xxh3_128(_pickle(obj, protocol=PICKLE_PROTOCOL))


def xxhash_cbor(obj: Any) -> bytes:
    """vLLM `xxhash_cbor`."""
    return _xxh3_128(_cbor(obj, canonical=True))


_FUNCTIONS: Final[dict[str, HashFn]] = {
    "sha256": sha256_pickle,
    "sha256_cbor": sha256_cbor,
    "xxhash": xxhash_pickle,
    "xxhash_cbor": xxhash_cbor,
}


def parse_algo(name: str) -> HashAlgo:
    """A `--prefix-caching-hash-algo` value, checked (ValueError names the valid ones)."""
    text = name.strip()
    for algo in HASH_ALGOS:
        if text == algo:
            return algo
    raise ValueError(f"unknown prefix caching hash algo {name!r} (vLLM: {', '.join(HASH_ALGOS)})")


def hash_function(algo: HashAlgo) -> HashFn:
    """vLLM `get_hash_fn_by_name`."""
    return _FUNCTIONS[algo]


def none_hash(algo: HashAlgo, python_hash_seed: str | None) -> bytes:
    """The root (`NONE_HASH`) of an engine started with this PYTHONHASHSEED (None: unset).

    Unset gives fresh random bytes, as in vLLM: nobody else can reproduce them.
    """
    if python_hash_seed is None:
        return os.urandom(RANDOM_ROOT_BYTES)
    return hash_function(algo)(python_hash_seed)


def hash_block_tokens(
    hash_fn: HashFn,
    parent: bytes,
    token_ids: Sequence[int],
    extra_keys: ExtraKeys | None = None,
) -> bytes:
    """The digest of one full block; `parent` is the previous digest or the root."""
    return hash_fn((parent, tuple(token_ids), extra_keys))


def event_hash(digest: bytes) -> int:
    """The int vLLM publishes for a digest (`maybe_convert_block_hash`): last 8 bytes, BE."""
    return int.from_bytes(digest[-8:], "big")


@dataclass(frozen=True, slots=True)
class MultiModalItem:
    """One multimodal input of a prompt: its placeholder tokens and its content hash.

    `identifier` is vLLM's `mm_feature.identifier` (the processor's content hash, prefixed
    by the LoRA name when the adapter has a tower of its own).
    """

    identifier: str
    offset: int
    length: int


def block_extra_keys(
    start: int,
    end: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    mm_items: Sequence[MultiModalItem] = (),
) -> ExtraKeys | None:
    """Extra keys of the block of tokens [start, end) (see the module docstring)."""
    keys: list[Any] = []
    if lora_name:
        keys.append(lora_name)
    for item in mm_items:
        if item.offset >= end:
            break
        if item.offset + item.length > start:
            keys.append((item.identifier, item.offset - start))
    if start == 0 and cache_salt:
        keys.append(cache_salt)
    return tuple(keys) if keys else None


def request_block_digests(
    hash_fn: HashFn,
    root: bytes,
    token_ids: Sequence[int],
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    mm_items: Sequence[MultiModalItem] = (),
) -> list[bytes]:
    """Digests of every full block of a prompt, chained from `root` (vLLM's request hasher)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    digests: list[bytes] = []
    parent = root
    plain = not (lora_name or cache_salt or mm_items)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        extra = None if plain else block_extra_keys(
            start, end, lora_name=lora_name, cache_salt=cache_salt, mm_items=mm_items
        )
        parent = hash_fn((parent, tuple(token_ids[start:end]), extra))
        digests.append(parent)
    return digests


@dataclass(frozen=True, slots=True)
class VllmHashConfig:
    """What decides an engine's hashes: `--prefix-caching-hash-algo`, PYTHONHASHSEED, and
    the block size. `python_hash_seed=None` means unset (a random root per engine)."""

    algo: HashAlgo = DEFAULT_HASH_ALGO
    python_hash_seed: str | None = None
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        parse_algo(self.algo)

    @property
    def reproducible(self) -> bool:
        """Whether another process can compute the same hashes (the root is not random)."""
        return self.python_hash_seed is not None


class VllmBlockHasher:
    """One engine's block hashing: its hash function and its root, fixed at creation.

    With an unset seed the root is drawn once here, as one vLLM process does.
    """

    __slots__ = ("config", "hash_fn", "root")

    def __init__(self, config: VllmHashConfig, root: bytes | None = None) -> None:
        self.config = config
        self.hash_fn = hash_function(config.algo)
        self.root = root if root is not None else none_hash(config.algo, config.python_hash_seed)

    def digests(
        self,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_items: Sequence[MultiModalItem] = (),
    ) -> list[bytes]:
        return request_block_digests(
            self.hash_fn, self.root, token_ids, self.config.block_size,
            lora_name=lora_name, cache_salt=cache_salt, mm_items=mm_items,
        )

    def event_hashes(
        self,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_items: Sequence[MultiModalItem] = (),
    ) -> list[int]:
        """The ints this engine's `BlockStored` events carry for a prompt's blocks."""
        return [
            event_hash(d)
            for d in self.digests(
                token_ids, lora_name=lora_name, cache_salt=cache_salt, mm_items=mm_items
            )
        ]


__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_HASH_ALGO",
    "EVENT_HASH_MASK",
    "HASH_ALGOS",
    "ExtraKeys",
    "HashAlgo",
    "HashFn",
    "MultiModalItem",
    "VllmBlockHasher",
    "VllmHashConfig",
    "block_extra_keys",
    "event_hash",
    "hash_block_tokens",
    "hash_function",
    "none_hash",
    "parse_algo",
    "request_block_digests",
    "sha256_cbor",
    "sha256_pickle",
    "xxhash_cbor",
    "xxhash_pickle",
]
