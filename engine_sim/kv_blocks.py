"""The simulated KV of one block: its store key and its bytes, both derived from the block hash.

Keys depend only on the model and the block hash, so identical prefixes share keys across
requests and pods. Bytes depend on the same two things, so a reader can check that what it
fetched is the KV of the block it asked for, and a test can predict it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Final

KEY_NAMESPACE: Final = "engine_sim/kv/v1"
#: Default size of one simulated KV block in the store, in bytes.
DEFAULT_KV_BLOCK_BYTES: Final = 4096


def store_key(model: str, block_hash: int) -> str:
    """Store key of one block: `engine_sim/kv/v1/{model}/{block hash as 16 hex digits}`."""
    return f"{KEY_NAMESPACE}/{model}/{block_hash:016x}"


def block_payload(model: str, block_hash: int, size: int = DEFAULT_KV_BLOCK_BYTES) -> bytes:
    """The block's bytes: shake_256 of namespace, model and hash, `size` bytes long."""
    seed = f"{KEY_NAMESPACE}\0{model}\0".encode() + block_hash.to_bytes(8, "big")
    return hashlib.shake_256(seed).digest(size)


def kv_digest(payloads: Iterable[bytes]) -> bytes:
    """sha256 over the payloads in order: what the output text is seeded with."""
    digest = hashlib.sha256()
    for payload in payloads:
        digest.update(len(payload).to_bytes(4, "big"))
        digest.update(payload)
    return digest.digest()
