"""Deterministic output text, so a test can prove where a response's KV came from.

Output token i is one word from `WORDS` with a leading space, picked by bytes drawn from a
seed. The seed depends on the prompt's tokens and on where the prompt's KV came from:

- computed locally (including local prefix-cache hits): sha256(b"local" + tokens);
- read from the KV store: sha256(b"store" + kv_digest(bytes read) + tokens).

So a decode pod that really used prefill's KV answers `expected_text(..., kv_from_store=
True)`, and one that silently prefilled locally answers something else.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Final

from engine_sim.block_hash import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_HASH_ALGO,
    DEFAULT_HASH_SEED,
    hash_prompt_blocks,
    pack_tokens,
)
from engine_sim.kv_blocks import DEFAULT_KV_BLOCK_BYTES, block_payload, kv_digest
from router.kvhash.vllm import HashAlgo

WORDS: Final = (
    "the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with",
    "be", "by", "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but",
    "have", "an", "had", "they", "you", "were", "their", "one", "all", "we", "can", "her",
    "has", "there", "been", "if", "more", "when", "will", "would", "who", "so", "no",
    "river", "mountain", "city", "capital", "north", "light", "stone", "music", "garden",
    "engine", "signal", "cache", "prefix", "token",
)  # fmt: skip


def local_seed(token_ids: Sequence[int]) -> bytes:
    """Seed of a response whose prompt KV was computed on this pod."""
    return hashlib.sha256(b"local" + pack_tokens(token_ids)).digest()


def store_seed(kv_bytes_digest: bytes, token_ids: Sequence[int]) -> bytes:
    """Seed of a response whose prompt KV was read from the store (digest of the bytes read)."""
    return hashlib.sha256(b"store" + kv_bytes_digest + pack_tokens(token_ids)).digest()


def output_pieces(seed: bytes, count: int) -> list[str]:
    """The `count` output tokens' texts drawn from `seed`."""
    stream = hashlib.shake_256(seed).digest(2 * count) if count > 0 else b""
    return [
        " " + WORDS[int.from_bytes(stream[2 * i : 2 * i + 2], "big") % len(WORDS)]
        for i in range(count)
    ]


def expected_text(
    token_ids: Sequence[int],
    max_tokens: int = 16,
    *,
    kv_from_store: bool,
    model: str,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_block_bytes: int = DEFAULT_KV_BLOCK_BYTES,
    cache_salt: str | None = None,
    hash_seed: str = DEFAULT_HASH_SEED,
    hash_algo: HashAlgo = DEFAULT_HASH_ALGO,
) -> str:
    """The text a pod answers for a prompt of these token ids (the engine's own: e.g. its
    `/tokenize` answer, or `engine_sim.prompts.load_tokenizer().request_ids(...)`).

    With `kv_from_store`, assumes prefill exported every full block of the prompt, which is
    what the simulator's prefill does. Defaults match pdgate's launchers (the pods' seed
    is `DEFAULT_HASH_SEED`).
    """
    if isinstance(token_ids, str):
        raise TypeError("expected_text takes the prompt's token ids, not its text")
    token_ids = list(token_ids)
    if kv_from_store:
        hashes = hash_prompt_blocks(
            token_ids, block_size, cache_salt=cache_salt, seed=hash_seed, algo=hash_algo
        )
        digest = kv_digest(block_payload(model, h, kv_block_bytes) for h in hashes)
        seed = store_seed(digest, token_ids)
    else:
        seed = local_seed(token_ids)
    return "".join(output_pieces(seed, max_tokens))
