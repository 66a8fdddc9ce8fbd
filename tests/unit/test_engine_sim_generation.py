"""Output text, the kv_transfer_params shape, and KV export/import against an in-memory store."""

from __future__ import annotations

import pytest

from engine_sim.block_hash import hash_prompt_blocks
from engine_sim.generation import WORDS, expected_text, local_seed, output_pieces
from engine_sim.kv_blocks import block_payload, store_key
from engine_sim.kv_params import (
    STORE_KEYS_FIELD,
    TransferMode,
    build_prefill_handle,
    parse_kv_transfer_params,
)
from engine_sim.kv_transfer import KVTransferError, StoreKVTransfer
from engine_sim.kvstore import MemoryKVStore
from tests.sim_tokens import prompt_ids

MODEL = "m"
TEXT = "a fairly long prompt that spans more than two blocks of sixteen tokens each, " * 4
PROMPT = prompt_ids(TEXT)


def test_expected_text_is_deterministic_and_tells_kv_source_apart() -> None:
    local = expected_text(PROMPT, 8, kv_from_store=False, model=MODEL)
    assert local == expected_text(tuple(PROMPT), 8, kv_from_store=False, model=MODEL)
    with pytest.raises(TypeError):
        expected_text(TEXT, 8, kv_from_store=False, model=MODEL)  # type: ignore[arg-type]
    assert len(local.split(" ")) == 9 and all(w in WORDS for w in local.split())
    stored = expected_text(PROMPT, 8, kv_from_store=True, model=MODEL)
    assert stored != local
    assert stored != expected_text(PROMPT, 8, kv_from_store=True, model="other")
    assert expected_text(PROMPT, 3, kv_from_store=False, model=MODEL) == "".join(
        output_pieces(local_seed(PROMPT), 3)
    )


def test_parse_kv_transfer_params_modes() -> None:
    assert parse_kv_transfer_params(None).mode is TransferMode.NONE
    assert parse_kv_transfer_params({"do_remote_decode": True}).mode is TransferMode.EXPORT
    handle = build_prefill_handle(
        engine_id="e", request_id="r", host="127.0.0.1", port=1, block_ids=[3, 4],
        num_tokens=40, store_keys=["k1", "k2"],
    )  # fmt: skip
    assert handle["remote_block_ids"] == [3, 4] and handle["tp_size"] == 1
    plan = parse_kv_transfer_params(handle)
    assert plan.mode is TransferMode.IMPORT and plan.handle is not None
    assert plan.handle.store_keys == ("k1", "k2") and plan.handle.block_ids == (3, 4)
    nested = build_prefill_handle(
        engine_id="e", request_id="r", host="h", port=1, block_ids=[3], num_tokens=20,
        store_keys=["k"], per_group=True,
    )  # fmt: skip
    assert nested["remote_block_ids"] == [[3]]
    assert parse_kv_transfer_params(nested).mode is TransferMode.IMPORT
    for broken in ({**handle, "remote_block_ids": None}, {**handle, STORE_KEYS_FIELD: None}):
        assert parse_kv_transfer_params(broken).mode is TransferMode.INCOMPLETE
    with pytest.raises(ValueError):
        parse_kv_transfer_params([1])


async def test_export_then_import_roundtrip_and_skip() -> None:
    store = MemoryKVStore(max_entries=100)
    transfer = StoreKVTransfer(store, MODEL, block_bytes=64)
    hashes = hash_prompt_blocks(PROMPT, 16)
    assert len(hashes) >= 2
    first = await transfer.export_blocks(hashes)
    assert first.written == len(hashes) and first.skipped == 0
    again = await transfer.export_blocks(hashes)
    assert again.written == 0 and again.skipped == len(hashes)
    imported = await transfer.import_blocks(first.keys, hashes)
    assert imported.blocks == len(hashes)
    assert expected_text(PROMPT, 4, kv_from_store=True, model=MODEL, kv_block_bytes=64)


async def test_import_failures_are_clear() -> None:
    store = MemoryKVStore()
    transfer = StoreKVTransfer(store, MODEL, block_bytes=64)
    hashes = hash_prompt_blocks(PROMPT, 16)
    keys = [store_key(MODEL, h) for h in hashes]
    with pytest.raises(KVTransferError) as missing:
        await transfer.import_blocks(keys, hashes)
    assert missing.value.status == 503 and missing.value.reason == "missing"
    await store.put(keys, [b"x" * 64] * len(keys))
    with pytest.raises(KVTransferError) as corrupt:
        await transfer.import_blocks(keys, hashes)
    assert corrupt.value.reason == "corrupt" and corrupt.value.status == 500
    with pytest.raises(KVTransferError) as wrong:
        await transfer.import_blocks(["bogus"], hashes)
    assert wrong.value.reason == "wrong_prompt"
    with pytest.raises(KVTransferError):
        await transfer.import_blocks([*keys, "extra"], hashes)
    assert block_payload(MODEL, hashes[0], 64) != block_payload(MODEL, hashes[1], 64)
