"""The router's model of how vLLM names KV blocks, and how the precise index keys them.

`router.kvhash.vllm` reproduces vLLM's prefix-cache block hashes (every
`--prefix-caching-hash-algo`, PYTHONHASHSEED semantics, extra keys, the int in KV events);
`router.kvhash.keyspace` decides per ModelServer whether the index keys on those hashes or
on the token ids the events carry. Neutral ground: the engine simulator imports this
package to hash as vLLM does; nothing here imports the simulator.
"""

from router.kvhash.keyspace import KeySettings, KeySpace, token_key
from router.kvhash.vllm import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_HASH_ALGO,
    HASH_ALGOS,
    HashAlgo,
    MultiModalItem,
    VllmBlockHasher,
    VllmHashConfig,
    block_extra_keys,
    event_hash,
    hash_block_tokens,
    hash_function,
    none_hash,
    parse_algo,
    request_block_digests,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_HASH_ALGO",
    "HASH_ALGOS",
    "HashAlgo",
    "KeySettings",
    "KeySpace",
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
    "token_key",
]
