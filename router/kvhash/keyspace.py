"""How the precise prefix index keys blocks, per ModelServer: vLLM's hashes, or tokens.

Two key spaces, both chained per block, so equal keys mean equal prefixes:

- `hashes`: the engine's own event ints (`vllm.event_hash` of vLLM's digests). The request
  path recomputes them with the ModelServer's hash algo, PYTHONHASHSEED and block size;
  events are indexed as published. Needs the engine's PYTHONHASHSEED.
- `tokens`: the router's own keys, recomputed from the token ids that `BlockStored`
  carries: key_i = xxh3_64(block i's token ids as uint32 + msgpack(extra keys),
  seed=key_{i-1}), key_{-1} = `TOKENS_ROOT`. The request path computes the same from the
  prompt's tokens; an event's first key chains from its `parent_block_hash`, looked up in
  what the pod (or its store pool) published before. Needs only token parity.

Why both, and why `auto` picks `tokens` unless the seed is known: vLLM draws its root hash
at random in every engine process when PYTHONHASHSEED is unset, which is its default
(`init_none_hash`). Then no router can compute an engine's hashes, and two replicas of one
model do not even agree with each other; keying on tokens still matches, and it survives a
wrong algo or seed setting. When the seed is known (`pdgate.io/python-hash-seed`, or
`preciseIndex.hashSeed`), `hashes` is exact too and costs less: no translation from engine
hash to router key is kept per block, and an event is indexed without rehashing. A
`parent_block_hash` the router never saw (it joined late with replay off, or evicted the
parent under its bound) leaves those blocks out in `tokens` mode: the index under-reports,
it never invents a hit.

Extra keys in `tokens` mode: from the event's per-block `extra_keys` when vLLM publishes
them (vllm#33304 and later), else `(lora_name,)` when set, else none. Older vLLM therefore
does not tell the router a block's `cache_salt`: salted prompts then match nothing (safe).

Annotations on a ModelServer (defaults from the scheduler config's `preciseIndex`):
`pdgate.io/precise-index-keys` (auto | hashes | tokens), `pdgate.io/prefix-caching-hash-algo`
(vLLM's flag), `pdgate.io/python-hash-seed` (the engine's PYTHONHASHSEED, absent = unset),
`pdgate.io/block-size`.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import repeat
from typing import Any, Final, Literal

import msgspec
import xxhash

from router.kvhash.vllm import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_HASH_ALGO,
    ExtraKeys,
    HashAlgo,
    VllmHashConfig,
    block_extra_keys,
    event_hash,
    hash_function,
    none_hash,
    parse_algo,
)

log = logging.getLogger("pdgate.kvhash")

KeyMode = Literal["hashes", "tokens"]
KeysSetting = Literal["auto", "hashes", "tokens"]
KEYS_SETTINGS: Final[tuple[KeysSetting, ...]] = ("auto", "hashes", "tokens")
KEYS_ANNOTATION: Final = "pdgate.io/precise-index-keys"
ALGO_ANNOTATION: Final = "pdgate.io/prefix-caching-hash-algo"
SEED_ANNOTATION: Final = "pdgate.io/python-hash-seed"
BLOCK_SIZE_ANNOTATION: Final = "pdgate.io/block-size"
#: Largest block size accepted from an annotation (vLLM's largest is 256; hybrid models'
#: attention blocks can be larger).
MAX_BLOCK_SIZE: Final = 1 << 16
TOKENS_ROOT: Final = xxhash.xxh3_64_intdigest(b"pdgate/kv-tokens/v1")

_xxh3 = xxhash.xxh3_64_intdigest
_encode = msgspec.msgpack.Encoder().encode
ChainState = bytes | int


@dataclass(frozen=True, slots=True)
class KeySettings:
    """One ModelServer's block keying: `keys` plus what vLLM's hashes depend on."""

    keys: KeysSetting = "auto"
    vllm: VllmHashConfig = field(default_factory=VllmHashConfig)

    @property
    def block_size(self) -> int:
        return self.vllm.block_size

    @property
    def mode(self) -> KeyMode:
        """`hashes` when asked for (or `auto`) and the seed is known; else `tokens`."""
        if self.keys == "tokens" or not self.vllm.reproducible:
            return "tokens"
        return "hashes"

    def with_annotations(self, annotations: Mapping[str, str], where: str = "") -> KeySettings:
        """These settings overridden by a ModelServer's annotations (bad values are logged
        and ignored: one typo must not stop the index for every other server)."""
        keys = self.keys
        vllm = self.vllm
        raw = annotations.get(KEYS_ANNOTATION)
        if raw is not None:
            text = raw.strip().lower()
            if text in KEYS_SETTINGS:
                keys = text  # type: ignore[assignment]
            else:
                log.warning("%s: %s=%r is not auto, hashes or tokens", where, KEYS_ANNOTATION, raw)
        raw = annotations.get(ALGO_ANNOTATION)
        if raw is not None:
            try:
                vllm = replace(vllm, algo=parse_algo(raw))
            except ValueError as exc:
                log.warning("%s: %s: %s", where, ALGO_ANNOTATION, exc)
        raw = annotations.get(SEED_ANNOTATION)
        if raw is not None:
            vllm = replace(vllm, python_hash_seed=raw)
        raw = annotations.get(BLOCK_SIZE_ANNOTATION)
        if raw is not None:
            try:
                size = int(raw.strip())
            except ValueError:
                size = 0
            if 0 < size <= MAX_BLOCK_SIZE:
                vllm = replace(vllm, block_size=size)
            else:
                log.warning("%s: %s=%r is not a block size", where, BLOCK_SIZE_ANNOTATION, raw)
        if keys == "hashes" and not vllm.reproducible:
            log.warning(
                "%s: precise index keys 'hashes' need the engine's PYTHONHASHSEED (%s); "
                "keying on tokens instead", where, SEED_ANNOTATION,
            )
        return KeySettings(keys, vllm)


def _pack(tokens: Sequence[int]) -> bytes:
    if isinstance(tokens, array) and tokens.typecode == "I":
        return tokens.tobytes()
    return array("I", tokens).tobytes()


def token_key(parent: int, tokens: Sequence[int], extra_keys: Any = None) -> int:
    """The router's key of one block in `tokens` mode (see the module docstring)."""
    data = _pack(tokens)
    if extra_keys is not None:
        data += _encode(extra_keys)
    return _xxh3(data, parent)


def _token_chain(tokens: Sequence[int], block_size: int, parent: int,
                 extras: Iterable[Any]) -> list[int]:
    """`token_key` of each block of `tokens` in turn, each chained from the one before
    (the first from `parent`), with `extras` the blocks' extra keys: the tokens are packed
    once and each block is a slice of that."""
    packed = _pack(tokens)
    width = 4 * block_size
    keys: list[int] = []
    key = parent
    for offset, extra in enumerate(extras):
        data = packed[offset * width : (offset + 1) * width]
        if extra is not None:
            data += _encode(extra)
        key = _xxh3(data, key)
        keys.append(key)
    return keys


class KeySpace:
    """Block keys for one `KeySettings`: request path (`chain`) and event path
    (`event_keys`). Immutable once built; `ident` tells key spaces apart in memos."""

    __slots__ = ("_hash_fn", "block_size", "ident", "mode", "root", "settings")

    def __init__(self, settings: KeySettings) -> None:
        self.settings = settings
        self.mode: KeyMode = settings.mode
        self.block_size = settings.block_size
        vllm = settings.vllm
        self._hash_fn = hash_function(vllm.algo)
        if self.mode == "hashes":
            assert vllm.python_hash_seed is not None
            self.root: ChainState = none_hash(vllm.algo, vllm.python_hash_seed)
            ident = f"hashes\0{vllm.algo}\0{vllm.python_hash_seed}\0{self.block_size}"
        else:
            self.root = TOKENS_ROOT
            ident = f"tokens\0{self.block_size}"
        self.ident = _xxh3(ident.encode())

    @classmethod
    def of(
        cls,
        keys: KeysSetting = "auto",
        algo: HashAlgo = DEFAULT_HASH_ALGO,
        python_hash_seed: str | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> KeySpace:
        return cls(KeySettings(keys, VllmHashConfig(algo, python_hash_seed, block_size)))

    def of_size(self, block_size: int) -> KeySpace:
        """The same key space with another block size."""
        vllm = replace(self.settings.vllm, block_size=block_size)
        return KeySpace(replace(self.settings, vllm=vllm))

    def extend(
        self,
        tokens: Sequence[int],
        start_block: int,
        count: int,
        state: ChainState,
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> tuple[list[int], ChainState]:
        """Keys of blocks [start_block, count) of a prompt, chained from `state` (the
        state after block start_block - 1, or `root`), and the final state."""
        size = self.block_size
        blocks = range(start_block, max(start_block, count))
        extras: Iterable[ExtraKeys | None] = (
            repeat(None, len(blocks)) if not (cache_salt or lora_name) else (
                block_extra_keys(index * size, (index + 1) * size, lora_name=lora_name,
                                 cache_salt=cache_salt)
                for index in blocks
            )
        )
        if self.mode == "tokens":
            assert isinstance(state, int)
            keys = _token_chain(tokens[start_block * size : count * size], size, state, extras)
            return keys, keys[-1] if keys else state
        assert isinstance(state, bytes)
        hashes: list[int] = []
        for index, extra in zip(blocks, extras, strict=True):
            state = self._hash_fn((state, tuple(tokens[index * size : (index + 1) * size]),
                                   extra))
            hashes.append(event_hash(state))
        return hashes, state

    def chain(
        self,
        tokens: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> list[int]:
        """Index keys of every full block of a prompt (the request path, unmemoized)."""
        count = len(tokens) // self.block_size
        keys, _ = self.extend(
            tokens, 0, count, self.root, cache_salt=cache_salt, lora_name=lora_name
        )
        return keys

    def event_keys(
        self,
        parent_key: int,
        token_ids: Sequence[int],
        count: int,
        extra_keys: Sequence[Any] | None,
        lora_name: str | None,
    ) -> list[int] | None:
        """`tokens` mode: router keys of a `BlockStored` run of `count` blocks whose parent
        has router key `parent_key` (TOKENS_ROOT for a prompt's first block). None when
        the event does not carry one full block of tokens per hash."""
        size = self.block_size
        if len(token_ids) != count * size:
            return None
        if extra_keys is not None and len(extra_keys) != count:
            return None
        lora_extra = (lora_name,) if lora_name else None
        extras = extra_keys if extra_keys is not None else repeat(lora_extra, count)
        return _token_chain(token_ids, size, parent_key, extras)


__all__ = [
    "ALGO_ANNOTATION",
    "BLOCK_SIZE_ANNOTATION",
    "KEYS_ANNOTATION",
    "KEYS_SETTINGS",
    "SEED_ANNOTATION",
    "TOKENS_ROOT",
    "ChainState",
    "KeyMode",
    "KeySettings",
    "KeySpace",
    "KeysSetting",
    "token_key",
]
