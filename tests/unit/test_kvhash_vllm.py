"""vLLM's block hashes reproduced (`router.kvhash.vllm`): golden values.

Cross-checked values come from vectors computed with vLLM v0.17.0's own functions
(`init_none_hash`, `hash_block_tokens`, `maybe_convert_block_hash`, `sha256_cbor`,
`xxhash_cbor`) and published in loxilb-io/loxilb-inference-gateway,
`cicd/common/kv_hash/fixtures/kv_hash_vectors.json`: tokens 101, 202, ..., 1616 (block 0)
and 1717, 1818, ..., 3232 (block 1), PYTHONHASHSEED=0. The pickle algorithms follow the
definition vLLM's own test checks (`tests/utils_/test_hashing.py`: sha256 ==
hashlib.sha256(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL))), frozen here as values.
"""

from __future__ import annotations

import hashlib
import pickle

import cbor2
import pytest
import xxhash

from router.kvhash.vllm import (
    HASH_ALGOS,
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

BLOCK0 = [101 * i for i in range(1, 17)]
BLOCK1 = [101 * i for i in range(17, 33)]
PROMPT = BLOCK0 + BLOCK1 + [7, 8, 9]  # two full blocks and a partial tail


def test_every_algo_vllm_accepts() -> None:
    assert HASH_ALGOS == ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
    assert parse_algo(" xxhash_cbor ") == "xxhash_cbor"
    with pytest.raises(ValueError, match="sha256_cbor"):
        parse_algo("sha256_msgpack")  # a fork's; not vLLM main's
    with pytest.raises(ValueError):
        VllmHashConfig("md5")  # type: ignore[arg-type]


def test_cbor_roots_and_chains_equal_vectors_from_vllm() -> None:
    sha = VllmBlockHasher(VllmHashConfig("sha256_cbor", "0"))
    assert sha.root.hex() == "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
    digests = sha.digests(PROMPT)
    assert [d.hex() for d in digests] == [
        "d450abdaf2c9ebdd0e0cbfbc4e24a5c07ff71dcab37be7426d4fa0e5fdb93342",
        "0d95d2dc02f528b32afbd33ebffedd911ed1978087b0a01679b4ddd62261c5db",
    ]
    assert sha.event_hashes(PROMPT) == [7876691182959014722, 8769878286166771163]
    xx = VllmBlockHasher(VllmHashConfig("xxhash_cbor", "0"))
    assert xx.root.hex() == "1ebe36576dcb573f26b99533a20aaeca"
    assert xx.event_hashes(PROMPT) == [11066090714971094433, 8162514883595054550]
    # The serialized bytes of (parent, tokens, None) are canonical CBOR, as published.
    parent = bytes(32)
    assert cbor2.dumps((parent, tuple(BLOCK0), None), canonical=True).hex() == (
        "835820" + "00" * 32 + "90186518ca19012f1901941901f919025e1902c319032819038d1903f2"
        "1904571904bc1905211905861905eb190650f6"
    )
    assert event_hash(hash_block_tokens(hash_function("sha256_cbor"), parent, BLOCK0)) == (
        14515664427994421226
    )


def test_pickle_algos_follow_vllms_definition() -> None:
    for algo, digest in (("sha256", hashlib.sha256), ("xxhash", None)):
        fn = hash_function(algo)  # type: ignore[arg-type]
        obj = (b"\x01" * 32, tuple(BLOCK0), ("salt",))
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        expected = digest(data).digest() if digest else xxhash.xxh3_128_digest(data)
        assert fn(obj) == expected
    # Frozen golden values (PYTHONHASHSEED=0), so a change of serializer cannot pass.
    assert VllmBlockHasher(VllmHashConfig("sha256", "0")).event_hashes(PROMPT) == [
        GOLDEN["sha256"][0], GOLDEN["sha256"][1]
    ]
    assert VllmBlockHasher(VllmHashConfig("xxhash", "0")).event_hashes(PROMPT) == [
        GOLDEN["xxhash"][0], GOLDEN["xxhash"][1]
    ]


#: sha256 / xxh3_128 over pickle protocol 5 of ("0"), then of (parent, block, None).
GOLDEN = {
    "sha256": (13188941767242063533, 10294115706567728630),
    "xxhash": (4994190775040855699, 11351645450473316060),
}


def test_event_int_is_the_digests_last_eight_bytes_big_endian() -> None:
    digest = bytes(range(32))
    assert event_hash(digest) == int.from_bytes(digest, "big") & (2**64 - 1)
    assert event_hash(digest) == int.from_bytes(bytes(range(24, 32)), "big")
    assert event_hash(bytes(range(16))) == int.from_bytes(bytes(range(8, 16)), "big")


def test_root_follows_pythonhashseed_semantics() -> None:
    for algo in HASH_ALGOS:
        fn = hash_function(algo)
        assert none_hash(algo, "42") == fn("42")  # the environment string itself
        assert none_hash(algo, "42") != none_hash(algo, "43")
        unset = none_hash(algo, None)
        assert len(unset) == 32 and unset != none_hash(algo, None)  # random per process
    # Two engines with the seed unset name the same prompt differently; with one, alike.
    config = VllmHashConfig("sha256", None)
    assert VllmBlockHasher(config).event_hashes(PROMPT) != VllmBlockHasher(config).event_hashes(
        PROMPT
    )
    seeded = VllmHashConfig("sha256", "0")
    assert VllmBlockHasher(seeded).event_hashes(PROMPT) == VllmBlockHasher(seeded).event_hashes(
        PROMPT
    )
    assert not config.reproducible and seeded.reproducible


def test_extra_keys_lora_multimodal_then_salt_on_the_first_block() -> None:
    assert block_extra_keys(0, 16) is None
    assert block_extra_keys(0, 16, cache_salt="s") == ("s",)
    assert block_extra_keys(16, 32, cache_salt="s") is None  # only the first block
    assert block_extra_keys(16, 32, lora_name="ad") == ("ad",)  # every block
    image = MultiModalItem("img-hash", offset=10, length=20)  # tokens 10..29
    items = [image, MultiModalItem("audio", offset=40, length=4)]
    assert block_extra_keys(0, 16, lora_name="ad", cache_salt="s", mm_items=items) == (
        "ad", ("img-hash", 10), "s",
    )
    assert block_extra_keys(16, 32, mm_items=items) == (("img-hash", -6),)  # started earlier
    assert block_extra_keys(32, 48, mm_items=items) == (("audio", 8),)
    assert block_extra_keys(48, 64, mm_items=items) is None


def test_request_chain_applies_extra_keys_per_block() -> None:
    fn = hash_function("sha256")
    root = none_hash("sha256", "0")
    salted = request_block_digests(fn, root, PROMPT, 16, cache_salt="t")
    first = hash_block_tokens(fn, root, BLOCK0, ("t",))
    assert salted == [first, hash_block_tokens(fn, first, BLOCK1, None)]
    plain = request_block_digests(fn, root, PROMPT, 16)
    assert plain[0] != salted[0] and plain[1] != salted[1]  # the salt moves the whole chain
    lora = request_block_digests(fn, root, PROMPT, 16, lora_name="ad")
    assert lora[1] == hash_block_tokens(fn, lora[0], BLOCK1, ("ad",))
    assert request_block_digests(fn, root, PROMPT[:15], 16) == []  # only full blocks
