"""The KV store behind prefill-to-decode transfer: a real Mooncake Store client, kept off the loop.

Mooncake's Python client makes blocking C++ calls, so every call runs on a small dedicated
thread pool. Batches are split at `MAX_BATCH_KEYS` so one call never outgrows the client's
local buffer. `MemoryKVStore` has the same interface for unit tests.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, Final, Protocol, TypeVar

#: Keys per Mooncake batch call.
MAX_BATCH_KEYS: Final = 128
#: Threads that make Mooncake calls.
STORE_THREADS: Final = 4
#: Default sizes: modest, since tests run several pods on one machine.
DEFAULT_GLOBAL_SEGMENT_BYTES: Final = 64 << 20
DEFAULT_LOCAL_BUFFER_BYTES: Final = 32 << 20
#: Default bound of `MemoryKVStore` (entries).
MEMORY_STORE_MAX_ENTRIES: Final = 65_536

_T = TypeVar("_T")


class KVStoreError(Exception):
    """A store call failed."""


class KVStoreUnavailable(KVStoreError):
    """The store cannot be used at all (library missing, master unreachable)."""


class KVStore(Protocol):
    """What KV transfer needs from a store. Values are whole blocks."""

    async def exists(self, keys: Sequence[str]) -> list[bool]: ...

    async def put(self, keys: Sequence[str], values: Sequence[bytes]) -> None: ...

    async def get(self, keys: Sequence[str]) -> list[bytes | None]: ...

    async def close(self) -> None: ...


def load_mooncake_store_class() -> Any:
    """Import `MooncakeDistributedStore`, explaining the usual failure (no libibverbs).

    Also quiets Mooncake's INFO logging (MC_LOG_LEVEL=WARNING) unless the caller set it.
    """
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        if "libibverbs" in str(exc):
            raise KVStoreUnavailable(
                f"the Mooncake library cannot load ({exc}): run `apt-get install libibverbs1`"
            ) from exc
        raise KVStoreUnavailable(f"the Mooncake library cannot load: {exc}") from exc
    return MooncakeDistributedStore


def mooncake_import_error() -> str | None:
    """None when Mooncake's store client imports, else why not (for test skips)."""
    try:
        load_mooncake_store_class()
    except KVStoreUnavailable as exc:
        return str(exc)
    return None


@dataclass(frozen=True, slots=True)
class MooncakeConfig:
    """Where the master is and how much memory this client brings."""

    master_address: str
    metadata_server: str
    local_hostname: str = "127.0.0.1"
    global_segment_bytes: int = DEFAULT_GLOBAL_SEGMENT_BYTES
    local_buffer_bytes: int = DEFAULT_LOCAL_BUFFER_BYTES
    protocol: str = "tcp"
    connect_timeout_s: float = 15.0


def wait_for_tcp(address: str, timeout_s: float) -> None:
    """Block until `host:port` accepts a connection, else raise KVStoreUnavailable.

    Mooncake's own setup retries for about a minute and a half against an absent master;
    checking first gives a quick, clear error.
    """
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise KVStoreUnavailable(f"Mooncake master {address} unreachable: {exc}") from exc
            time.sleep(0.1)


class MooncakeKVStore:
    """A connected Mooncake Store client; create it with `await MooncakeKVStore.connect(...)`."""

    def __init__(self, client: Any, executor: ThreadPoolExecutor) -> None:
        self._client = client
        self._executor = executor

    @classmethod
    async def connect(cls, config: MooncakeConfig) -> MooncakeKVStore:
        """Reach the master, set up the client (mounting our segment) off the loop."""
        executor = ThreadPoolExecutor(max_workers=STORE_THREADS, thread_name_prefix="mooncake")
        loop = asyncio.get_running_loop()
        try:
            client = await loop.run_in_executor(executor, cls._setup, config)
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(client, executor)

    @staticmethod
    def _setup(config: MooncakeConfig) -> Any:
        # Without this, the TCP transport advertises the first non-loopback interface's
        # address for its data and RPC ports, and peers send KV there instead of to
        # `local_hostname`. Set before the transfer engine starts (it reads it at setup).
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", config.local_hostname)
        store_class = load_mooncake_store_class()
        wait_for_tcp(config.master_address, config.connect_timeout_s)
        client = store_class()
        code = client.setup(
            config.local_hostname,
            config.metadata_server,
            config.global_segment_bytes,
            config.local_buffer_bytes,
            config.protocol,
            "",
            config.master_address,
        )
        if code != 0:
            raise KVStoreUnavailable(
                f"Mooncake setup failed with code {code} (master {config.master_address}, "
                f"metadata {config.metadata_server})"
            )
        return client

    async def _call(self, fn: Callable[[], _T]) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        out: list[bool] = []
        for batch in _batches(keys):
            codes: list[int] = await self._call(partial(self._client.batch_is_exist, batch))
            out.extend(code == 1 for code in codes)
        return out

    async def put(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        for start in range(0, len(keys), MAX_BATCH_KEYS):
            batch_keys = list(keys[start : start + MAX_BATCH_KEYS])
            batch_values = list(values[start : start + MAX_BATCH_KEYS])
            code: int = await self._call(partial(self._client.put_batch, batch_keys, batch_values))
            if code != 0:
                raise KVStoreError(f"Mooncake put_batch failed with code {code}")

    async def get(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for batch in _batches(keys):
            values: list[bytes] = await self._call(partial(self._client.get_batch, batch))
            out.extend(value if value else None for value in values)
        return out

    async def close(self) -> None:
        """Unmount our segment and stop the client's threads."""
        try:
            await self._call(self._client.close)
        finally:
            self._executor.shutdown(wait=False)


class MemoryKVStore:
    """An in-process store with the same interface, bounded FIFO, for unit tests."""

    def __init__(self, max_entries: int = MEMORY_STORE_MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._data: OrderedDict[str, bytes] = OrderedDict()

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        return [key in self._data for key in keys]

    async def put(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        for key, value in zip(keys, values, strict=True):
            if key in self._data:
                continue  # Mooncake keeps the first value of a key too
            self._data[key] = bytes(value)
            while len(self._data) > self.max_entries:
                self._data.popitem(last=False)

    async def get(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self._data.get(key) for key in keys]

    async def close(self) -> None:
        self._data.clear()


def _batches(keys: Sequence[str]) -> list[list[str]]:
    return [list(keys[i : i + MAX_BATCH_KEYS]) for i in range(0, len(keys), MAX_BATCH_KEYS)]
