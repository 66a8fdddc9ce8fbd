"""Moving a prompt's KV blocks between pods through the store: the one place PD transfer lives.

`export_blocks` (prefill leg) writes the blocks the store lacks; `import_blocks` (decode
leg) reads the blocks a handle names and proves they are this prompt's KV: each key must
be the key of the prompt's block at that position, and each value the bytes that block
hash predicts. Protocol shapes (`kv_params.py`) stay out of here so that other handshakes
(SGLang bootstrap, upstream vLLM MooncakeConnector's transfer_id) can reuse this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine_sim.kv_blocks import block_payload, kv_digest, store_key
from engine_sim.kvstore import KVStore, KVStoreError


class KVTransferError(Exception):
    """A transfer failed. `status` is the HTTP status to answer with; `reason` a stable label.

    Reasons: `no_store` and `missing` (503: the KV is not there, a new prefill may help);
    `wrong_prompt` (the handle names blocks of another prompt), `corrupt` (the bytes are not
    the block's KV) and `store` (a store call failed): 500.
    """

    def __init__(self, reason: str, status: int, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class ExportResult:
    keys: tuple[str, ...]
    written: int
    skipped: int
    #: Positions (in the prompt's blocks) of the blocks this call wrote: KV events name them.
    written_indices: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ImportResult:
    blocks: int
    digest: bytes


class StoreKVTransfer:
    """Export and import of one model's KV blocks through a `KVStore`."""

    def __init__(self, store: KVStore, model: str, block_bytes: int) -> None:
        self.store = store
        self.model = model
        self.block_bytes = block_bytes

    async def export_blocks(self, block_hashes: Sequence[int]) -> ExportResult:
        """Write the blocks the store does not hold yet; return every block's key."""
        keys = [store_key(self.model, h) for h in block_hashes]
        if not keys:
            return ExportResult((), 0, 0)
        try:
            present = await self.store.exists(keys)
            missing = [i for i, found in enumerate(present) if not found]
            if missing:
                await self.store.put(
                    [keys[i] for i in missing],
                    [block_payload(self.model, block_hashes[i], self.block_bytes) for i in missing],
                )
        except KVStoreError as exc:
            raise KVTransferError("store", 500, f"KV store write failed: {exc}") from exc
        return ExportResult(tuple(keys), len(missing), len(keys) - len(missing), tuple(missing))

    async def load_prefix(self, block_hashes: Sequence[int]) -> int:
        """How many leading `block_hashes` the store holds, read and checked (prefix reuse).

        Reads the leading run of blocks present in the store and stops at the first block
        that is missing or does not hold that block's bytes.
        """
        if not block_hashes:
            return 0
        keys = [store_key(self.model, h) for h in block_hashes]
        try:
            present = await self.store.exists(keys)
            count = next((i for i, found in enumerate(present) if not found), len(keys))
            values = await self.store.get(keys[:count]) if count else []
        except KVStoreError as exc:
            raise KVTransferError("store", 500, f"KV store read failed: {exc}") from exc
        for index, value in enumerate(values):
            if value != block_payload(self.model, block_hashes[index], self.block_bytes):
                return index
        return count

    async def import_blocks(
        self, store_keys: Sequence[str], block_hashes: Sequence[int]
    ) -> ImportResult:
        """Read and verify the blocks named by `store_keys` against this prompt's hashes."""
        if len(store_keys) > len(block_hashes):
            raise KVTransferError(
                "wrong_prompt",
                500,
                f"KV handle names {len(store_keys)} blocks but this prompt has only "
                f"{len(block_hashes)} full blocks: the handle is for another prompt",
            )
        for index, key in enumerate(store_keys):
            if key != store_key(self.model, block_hashes[index]):
                raise KVTransferError(
                    "wrong_prompt",
                    500,
                    f"KV handle block {index} ({key}) is not block {index} of this prompt "
                    f"for model {self.model}",
                )
        try:
            values = await self.store.get(list(store_keys))
        except KVStoreError as exc:
            raise KVTransferError("store", 500, f"KV store read failed: {exc}") from exc
        for index, value in enumerate(values):
            if value is None:
                raise KVTransferError(
                    "missing", 503, f"KV block {index} ({store_keys[index]}) is not in the store"
                )
            if value != block_payload(self.model, block_hashes[index], self.block_bytes):
                raise KVTransferError(
                    "corrupt",
                    500,
                    f"KV block {index} ({store_keys[index]}) holds bytes that are not this "
                    "block's KV",
                )
        return ImportResult(len(values), kv_digest(v for v in values if v is not None))
