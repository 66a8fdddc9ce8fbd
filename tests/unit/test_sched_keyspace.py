"""Block keying per ModelServer: event path and request path give the same keys.

Engines here are the simulator's prefix cache hashing with vLLM's algorithm; their
`BlockStored` events go through the real encoder (`engine_sim.kv_events_pub`) and the
router's decoder, so the index sees what it would see on the wire.
"""

from __future__ import annotations

import random
import time
from typing import Any

import msgspec

from engine_sim.block_hash import BlockHashMemo
from engine_sim.cache_events import AllBlocksCleared as CacheCleared
from engine_sim.cache_events import BlockRemoved as CacheRemoved
from engine_sim.cache_events import BlockStored as CacheStored
from engine_sim.kv_events_pub import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    KVEventBatch,
    block_stored_event,
)
from engine_sim.prefix_cache import PrefixCache
from router.kvhash.keyspace import KeySettings, KeySpace
from router.kvhash.vllm import VllmBlockHasher, VllmHashConfig
from router.scheduling.block_hash import PreciseHasher
from router.scheduling.kv_events import apply_events, decode_batch
from router.scheduling.precise_index import PrecisePrefixIndex

SCOPE = "ns/srv"
BS = 16
_encode = msgspec.msgpack.Encoder().encode


class Engine:
    """One simulated vLLM engine: its own root (seed None: random, as vLLM unset)."""

    def __init__(self, key: str, index: PrecisePrefixIndex, seed: str | None = None,
                 capacity: int = 4096) -> None:
        self.key = key
        self.index = index
        self.memo = BlockHashMemo(BS, seed)
        self.events: list[Any] = []
        self.cache = PrefixCache(capacity, BS, on_event=self.events.append)

    def serve(self, tokens: list[int], salt: str | None = None) -> int:
        """Run a prompt; its prefix-cache hit in tokens, as the engine counts it."""
        hashes = self.memo.hashes(tuple(tokens), salt)
        hit = min(self.cache.match(hashes), (len(tokens) - 1) // BS) * BS
        self.cache.release(self.cache.acquire(hashes, tokens, salt))
        self.publish()
        return hit

    def hit(self, tokens: list[int], salt: str | None = None) -> int:
        hashes = self.memo.hashes(tuple(tokens), salt)
        return min(self.cache.match(hashes), (len(tokens) - 1) // BS) * BS

    def publish(self) -> None:
        wire: list[Any] = []
        for event in self.events:
            if isinstance(event, CacheStored):
                wire.append(block_stored_event(
                    event.block_hashes, event.parent_block_hash, event.token_ids,
                    event.block_size, MEDIUM_GPU, event.first_block, event.cache_salt,
                ))
            elif isinstance(event, CacheRemoved):
                wire.append(BlockRemoved(list(event.block_hashes), MEDIUM_GPU))
            elif isinstance(event, CacheCleared):
                wire.append(AllBlocksCleared())
        self.events.clear()
        payload = _encode(KVEventBatch(time.time(), wire, 0))
        apply_events(self.index, self.key, SCOPE, decode_batch(payload))


def predicted_hits(index: PrecisePrefixIndex, hasher: PreciseHasher, keys: list[str],
                   tokens: list[int], salt: str | None = None) -> list[int]:
    space = index.space(SCOPE)
    hashes = hasher.block_hashes(tokens, salt, (), space)
    local, _ = index.match(keys, SCOPE, hashes)
    return [min(depth, (len(tokens) - 1) // BS) * BS for depth in local]


def test_annotations_override_the_defaults() -> None:
    base = KeySettings()
    assert base.mode == "tokens"  # vLLM's default: PYTHONHASHSEED unset, random roots
    got = base.with_annotations({
        "pdgate.io/prefix-caching-hash-algo": "xxhash_cbor",
        "pdgate.io/python-hash-seed": "42",
        "pdgate.io/block-size": "32",
    })
    assert got == KeySettings("auto", VllmHashConfig("xxhash_cbor", "42", 32))
    assert got.mode == "hashes"
    forced = got.with_annotations({"pdgate.io/precise-index-keys": "tokens"})
    assert forced.mode == "tokens"
    # Bad values are ignored (logged), never fatal; `hashes` without a seed keys tokens.
    bad = base.with_annotations({
        "pdgate.io/prefix-caching-hash-algo": "md5", "pdgate.io/block-size": "-1",
        "pdgate.io/precise-index-keys": "hashes",
    })
    assert bad.vllm == base.vllm and bad.mode == "tokens"


def test_hashes_mode_request_keys_are_vllms_event_hashes() -> None:
    tokens = [random.Random(1).randrange(50_000) for _ in range(100)]
    for algo in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        space = KeySpace.of("hashes", algo, "7", BS)  # type: ignore[arg-type]
        engine = VllmBlockHasher(VllmHashConfig(algo, "7", BS))  # type: ignore[arg-type]
        assert space.chain(tokens, cache_salt="s") == engine.event_hashes(tokens, cache_salt="s")
        hasher = PreciseHasher(space)
        for _ in range(2):  # the second answer comes from the memo
            assert hasher.block_hashes(tokens, "s", (40, 90)) == engine.event_hashes(
                tokens, cache_salt="s"
            )


def test_tokens_mode_predicts_engines_with_random_roots() -> None:
    """PYTHONHASHSEED unset: every engine has its own root; token keys still match."""
    index = PrecisePrefixIndex()
    index.set_spaces({SCOPE: KeySpace.of("auto")})
    assert index.space(SCOPE) is not None and index.space(SCOPE).mode == "tokens"  # type: ignore[union-attr]
    hasher = PreciseHasher()
    a, b = Engine("ns/a", index), Engine("ns/b", index)
    rng = random.Random(5)
    system = [rng.randrange(50_000) for _ in range(100)]
    first = system + [rng.randrange(50_000) for _ in range(40)]
    a.serve(first)
    b.serve(system + [1, 2, 3] * 20)
    assert a.memo.hashes(tuple(first)) != b.memo.hashes(tuple(first))  # different roots
    for tokens in (first + [9] * 30, system + [4] * 50, [8] * 64):
        assert predicted_hits(index, hasher, ["ns/a", "ns/b"], tokens) == [
            a.hit(tokens), b.hit(tokens)
        ]
    assert predicted_hits(index, hasher, ["ns/a"], first + [9] * 30)[0] >= 128
    # A salted prompt: the salt travels in the event's extra keys of block 0.
    a.serve(first, salt="tenant")
    assert predicted_hits(index, hasher, ["ns/a"], first, "tenant") == [a.hit(first, "tenant")]
    assert predicted_hits(index, hasher, ["ns/a"], first, "other") == [0]
    assert index.unkeyed_blocks == 0


def test_tokens_mode_follows_evictions_exactly() -> None:
    index = PrecisePrefixIndex()
    index.set_spaces({SCOPE: KeySpace.of("tokens")})
    hasher = PreciseHasher()
    engine = Engine("p", index, capacity=40)
    rng = random.Random(3)
    prefixes = [[rng.randrange(30_000) for _ in range(BS * 6)] for _ in range(5)]
    for _ in range(80):
        tokens = prefixes[rng.randrange(5)] + [rng.randrange(30_000) for _ in range(40)]
        engine.serve(tokens, salt=rng.choice([None, "s"]))
        probe = prefixes[rng.randrange(5)] + [1] * 17
        salt = rng.choice([None, "s"])
        assert predicted_hits(index, hasher, ["p"], probe, salt) == [engine.hit(probe, salt)]
    assert index.blocks_of("p") == set(engine.cache._blocks)
    assert len(index.keys_of("p")) == len(index.blocks_of("p"))
    engine.cache.clear()
    engine.publish()
    assert index.blocks_of("p") == set(engine.cache._blocks)


def test_tokens_mode_store_writes_key_like_the_pods_own_blocks() -> None:
    """A prefill pod's store write repeats blocks it just stored on GPU: the pool gets the
    same router keys whether they are taken from the pod's table or hashed from tokens."""
    space = KeySpace.of("tokens")
    index = PrecisePrefixIndex()
    index.set_spaces({SCOPE: space})
    tokens = list(range(1000, 1000 + BS * 5))
    expected = space.chain(tokens, cache_salt="s")
    extra = [("s",)] + [None] * 4
    index.stored("p", SCOPE, [1, 2, 3, 4, 5], "GPU", token_ids=tokens, block_size=BS,
                 extra_keys=extra)
    assert index.keys_of("p") == set(expected)
    index.stored("p", SCOPE, [1, 2, 3, 4, 5], "cpu", token_ids=tokens, block_size=BS,
                 extra_keys=extra)  # reused from the pod's table
    index.stored("q", SCOPE, [1, 2, 3, 4, 5], "cpu", token_ids=tokens, block_size=BS,
                 extra_keys=extra)  # hashed: pod q never stored them
    index.stored("q", SCOPE, [6], "cpu", parent=5, token_ids=[7] * BS, block_size=BS)
    assert index.store_blocks(SCOPE) == {*expected, space.chain([*tokens, *[7] * BS],
                                                                cache_salt="s")[-1]}
    assert index.unkeyed_blocks == 0


def test_vllms_store_writes_one_block_an_event_key_as_the_pods_blocks() -> None:
    """vLLM's MooncakeStoreConnector publishes each block written as its own event, with no
    extra keys (so no salt on block 0) and at times no token ids: the pod's own GPU event
    of the same block keys it; a block no pod keyed and no token ids is left out."""
    space = KeySpace.of("tokens")
    index = PrecisePrefixIndex()
    index.set_spaces({SCOPE: space})
    tokens = list(range(2000, 2000 + BS * 3))
    expected = space.chain(tokens, cache_salt="s")
    index.stored("p", SCOPE, [1, 2, 3], "GPU", token_ids=tokens, block_size=BS,
                 extra_keys=[("s",), None, None])
    for i, block in enumerate((1, 2, 3)):
        index.stored("p", SCOPE, [block], "cpu", parent=block - 1 if i else None,
                     token_ids=tokens[i * BS:(i + 1) * BS] if i != 1 else [], block_size=BS)
    assert index.store_blocks(SCOPE) == set(expected)
    index.stored("q", SCOPE, [9], "cpu", parent=None, token_ids=[], block_size=BS)
    assert index.unkeyed_blocks == 1 and index.store_blocks(SCOPE) == set(expected)


def test_a_store_run_over_a_pods_partly_evicted_blocks_keys_as_block_by_block() -> None:
    """vLLM's store events carry no salt: a run of them (merged by the decoder) keeps the
    keys the pod's own GPU events gave its leading blocks and chains the rest from them, so
    a salted prompt's blocks stay salted when one of them left the pod's GPU cache."""
    space = KeySpace.of("tokens")
    tokens = list(range(3000, 3000 + BS * 4))
    expected = space.chain(tokens, cache_salt="s")
    pooled = []
    for merged in (True, False):
        index = PrecisePrefixIndex()
        index.set_spaces({SCOPE: space})
        index.stored("p", SCOPE, [1, 2, 3, 4], "GPU", token_ids=tokens, block_size=BS,
                     extra_keys=[("s",), None, None, None])
        index.removed("p", SCOPE, [3, 4], "GPU")  # blocks 3 and 4 left the GPU cache
        store = [[i] for i in (1, 2, 3, 4)]
        runs = [[1, 2, 3, 4]] if merged else store
        for run in runs:
            first = run[0] - 1
            index.stored("p", SCOPE, run, "cpu", parent=run[0] - 1 or None,
                         token_ids=tokens[first * BS:(first + len(run)) * BS], block_size=BS)
        pooled.append(index.store_blocks(SCOPE))
    assert pooled[0] == pooled[1] == set(expected)


def test_a_parent_the_router_never_saw_is_left_out_not_guessed() -> None:
    index = PrecisePrefixIndex()
    index.set_spaces({SCOPE: KeySpace.of("tokens")})
    index.stored("p", SCOPE, [11, 12], "GPU", parent=999, token_ids=[1] * 32, block_size=BS)
    index.stored("p", SCOPE, [13], "GPU", parent=None, token_ids=None, block_size=BS)
    index.stored("p", SCOPE, [14], "GPU", parent=None, token_ids=[1] * 8, block_size=8)
    assert index.unkeyed_blocks == 4 and index.blocks_of("p") == set()
    # Hashes mode (or no key space): events are indexed as published.
    index.set_spaces({})
    index.stored("p", SCOPE, [11, 12], "GPU", parent=999)
    assert index.keys_of("p") == {11, 12}


def test_tokens_mode_keys_resumed_block_by_block_equal_one_chain() -> None:
    """The request path's lazy walk extends a prompt's keys a few blocks at a time; the
    keys equal one `token_key` chain over the prompt, salted and with a LoRA too."""
    from router.kvhash.keyspace import TOKENS_ROOT, token_key
    from router.kvhash.vllm import block_extra_keys

    space = KeySpace.of("tokens", block_size=BS)
    rng = random.Random(11)
    tokens = [rng.randrange(150_000) for _ in range(BS * 9 + 5)]
    for salt, lora in ((None, None), ("tenant", None), (None, "adapter"), ("t", "a")):
        expected, key = [], TOKENS_ROOT
        for block in range(9):
            extra = block_extra_keys(block * BS, (block + 1) * BS, lora_name=lora,
                                     cache_salt=salt)
            key = token_key(key, tokens[block * BS:(block + 1) * BS], extra)
            expected.append(key)
        assert space.chain(tokens, cache_salt=salt, lora_name=lora) == expected
        keys, state = [], space.root
        for start, end in ((0, 2), (2, 2), (2, 7), (7, 9)):
            more, state = space.extend(tokens, start, end, state, cache_salt=salt,
                                       lora_name=lora)
            keys += more
        assert keys == expected and state == expected[-1]
