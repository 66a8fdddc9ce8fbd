"""Upstream vLLM MooncakeConnector on the simulator, in process: bootstrap server, params,
and the transfer-id rendezvous between two engines sharing one in-memory store."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import pytest

from engine_sim import bootstrap as bootstrap_module
from engine_sim.bootstrap import (
    BootstrapError,
    BootstrapFault,
    BootstrapServer,
    Rendezvous,
    manifest_key,
    start_bootstrap,
)
from engine_sim.cli import parse_config
from engine_sim.config import Role, SimConfig
from engine_sim.engine import Engine
from engine_sim.generation import expected_text
from engine_sim.kv_params import (
    RendezvousParams,
    TransferMode,
    TransferPlan,
    parse_kv_transfer_params,
)
from engine_sim.kv_transfer import KVTransferError, StoreKVTransfer
from engine_sim.kvstore import KVStoreError, MemoryKVStore
from engine_sim.latency import LatencyModel
from engine_sim.ports import free_port
from engine_sim.protocol import Limits, parse_request
from tests.sim_tokens import chat_ids, prompt_ids, sim_tokenizer

MODEL = "m"
PROMPT = "Tell me a story about rivers and mountains. " * 6  # several full KV blocks


async def get(url: str) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.read()


@pytest.fixture
async def server() -> AsyncIterator[BootstrapServer]:
    bootstrap = BootstrapServer("127.0.0.1", 0)
    await bootstrap.start()
    bootstrap.register_self("eng-p", "127.0.0.1", 1234)
    yield bootstrap
    await bootstrap.stop()


def url(server: BootstrapServer, path: str = "/query") -> str:
    return f"http://127.0.0.1:{server.port}{path}"


async def test_query_answers_vllms_shape(server: BootstrapServer) -> None:
    status, body = await get(url(server))
    assert status == 200
    assert json.loads(body) == {
        "0": {"engine_id": "eng-p", "worker_addr": {"0": {"0": "tcp://127.0.0.1:1234"}}}
    }
    assert server.status_json()["queries"] == 1


async def test_register_follows_vllms_rules(server: BootstrapServer) -> None:
    async def register(payload: Any) -> tuple[int, Any]:
        async with (
            aiohttp.ClientSession() as session,
            session.post(url(server, "/register"), json=payload) as response,
        ):
            return response.status, await response.json()

    worker = {"engine_id": "eng-p", "dp_rank": 0, "tp_rank": 1, "pp_rank": 0, "addr": "tcp://h:2"}
    assert await register(worker) == (200, {"status": "ok"})
    status, body = await register(worker)  # the same worker slot again
    assert status == 400 and "already registered" in body["detail"]
    status, body = await register({**worker, "engine_id": "other", "tp_rank": 2})
    assert status == 400 and "Engine ID mismatch" in body["detail"]
    assert (await register({**worker, "engine_id": "eng-q", "dp_rank": 1}))[0] == 200
    assert (await register({"engine_id": "x"}))[0] == 422
    _, raw = await get(url(server))
    answer = json.loads(raw)
    assert answer["0"]["worker_addr"] == {
        "0": {"0": "tcp://127.0.0.1:1234"},
        "1": {"0": "tcp://h:2"},
    }
    assert answer["1"]["engine_id"] == "eng-q"


@pytest.mark.parametrize(
    ("fault", "status", "body"),
    [
        (BootstrapFault.ERROR, 500, b"Internal Server Error"),
        (BootstrapFault.GARBAGE, 200, b"<html>bootstrap</html>"),
        (BootstrapFault.EMPTY, 200, b"{}"),
        (BootstrapFault.MALFORMED, 200, b'{"0":{"engine":"?","workers":[]}}'),
    ],
)
async def test_faults_break_query(fault: BootstrapFault, status: int, body: bytes) -> None:
    server = BootstrapServer("127.0.0.1", 0, fault)
    await server.start()
    try:
        server.register_self("eng-p", "127.0.0.1", 1)
        assert await get(url(server)) == (status, body)
    finally:
        await server.stop()


async def test_fault_down_never_listens() -> None:
    port = free_port()
    server = BootstrapServer("127.0.0.1", port, BootstrapFault.DOWN)
    await server.start()
    assert server.port is None and server.error
    with pytest.raises(aiohttp.ClientConnectionError):
        await get(f"http://127.0.0.1:{port}/query")


def sim_config(role: Role, **overrides: Any) -> SimConfig:
    fields: dict[str, Any] = {
        "role": role, "model": MODEL, "port": 0, "engine_id": f"eng-{role}",
        "latency": LatencyModel.fast(), "kv_wait_timeout_s": 5.0,
        "python_hash_seed": "0",  # prefill and decode share one root, as they must
    }  # fmt: skip
    fields.update(overrides)
    return SimConfig(**fields)


async def test_explicit_port_taken_fails_default_port_taken_warns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = int(holder.getsockname()[1])
        with pytest.raises(BootstrapError, match="cannot listen"):
            await start_bootstrap(sim_config("prefill", bootstrap_port=taken))
        monkeypatch.setattr(bootstrap_module, "DEFAULT_BOOTSTRAP_PORT", taken)
        server = await start_bootstrap(sim_config("prefill"))
        assert server is not None and server.port is None and "cannot listen" in str(server.error)
    assert await start_bootstrap(sim_config("decode")) is None


def test_cli_flags() -> None:
    base = ["--role", "prefill", "--port", "0", "--model", MODEL, "--mooncake-master", "h:1",
            "--metadata-server", "http://h:2/metadata"]  # fmt: skip
    config = parse_config(base)
    assert config.bootstrap_port is None and config.bootstrap_fault == "none"
    assert bootstrap_module.DEFAULT_BOOTSTRAP_PORT == 8998
    config = parse_config([*base, "--bootstrap-port", "0", "--bootstrap-fault", "garbage",
                           "--kv-wait-timeout", "2.5"])  # fmt: skip
    assert (config.bootstrap_port, config.bootstrap_fault, config.kv_wait_timeout_s) == (
        0,
        "garbage",
        2.5,
    )
    for bad in (["--bootstrap-port", "70000"], ["--kv-wait-timeout", "0"],
                ["--bootstrap-fault", "nope"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_config([*base, *bad])


def test_the_nixl_side_channel_is_read_from_vllms_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = ["--role", "prefill", "--port", "0", "--model", MODEL, "--mooncake-master", "h:1",
            "--metadata-server", "http://h:2/metadata"]  # fmt: skip
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_HOST", raising=False)
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_PORT", raising=False)
    config = parse_config(base)
    assert (config.nixl_side_channel_host, config.nixl_side_channel_port) == ("localhost", 5600)
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "10.1.2.3")
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "6000")
    config = parse_config(base)
    assert (config.nixl_side_channel_host, config.nixl_side_channel_port) == ("10.1.2.3", 6000)
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "x")
    with pytest.raises(SystemExit):
        parse_config(base)
    decode = ["--role", "decode", *base[2:]]  # makes no handle: vLLM would start, so do we
    assert parse_config(decode).role == "decode"


def test_params_of_both_protocols() -> None:
    prefill = parse_kv_transfer_params(
        {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "xfer-1"}
    )
    assert prefill == TransferPlan(TransferMode.EXPORT, transfer_id="xfer-1")
    nixl = parse_kv_transfer_params(
        {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
         "remote_block_ids": None, "remote_host": None, "remote_port": None}
    )  # fmt: skip
    assert nixl == TransferPlan(TransferMode.EXPORT)
    decode = {
        "do_remote_decode": False, "do_remote_prefill": True, "transfer_id": "xfer-1",
        "remote_bootstrap_addr": "http://10.0.0.1:8998", "remote_engine_id": "eng-p",
    }  # fmt: skip
    assert parse_kv_transfer_params(decode) == TransferPlan(
        TransferMode.IMPORT, rendezvous=RendezvousParams("xfer-1", "http://10.0.0.1:8998", "eng-p")
    )
    for missing in ("transfer_id", "remote_bootstrap_addr", "remote_engine_id"):
        incomplete = {k: v for k, v in decode.items() if k != missing}
        assert parse_kv_transfer_params(incomplete).mode is TransferMode.INCOMPLETE
    assert parse_kv_transfer_params({**decode, "transfer_id": None}).mode is (
        TransferMode.INCOMPLETE
    )


class Pair:
    """A prefill and a decode engine sharing one store, the prefill's bootstrap server up."""

    def __init__(self, bootstrap: BootstrapServer, **decode: Any) -> None:
        self.store = MemoryKVStore()
        self.prefill = Engine(sim_config("prefill"), self.store)
        self.decode = Engine(sim_config("decode", **decode), self.store)
        self.bootstrap = bootstrap
        self.addr = f"http://127.0.0.1:{bootstrap.port}"

    async def run(
        self, engine: Engine, prompt: str, max_tokens: int, params: dict[str, Any]
    ) -> tuple[str, Any]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                "kv_transfer_params": params}  # fmt: skip
        parsed = parse_request(body, "completion", sim_tokenizer(), _LIMITS)
        plan = parse_kv_transfer_params(parsed.kv_transfer_params)
        async with engine.run(parsed, "req", plan, 0.0) as generation:
            return "".join(generation.pieces), generation.kv_transfer_params

    async def prefill_leg(self, transfer_id: str, prompt: str = PROMPT) -> Any:
        params = {"do_remote_decode": True, "do_remote_prefill": False,
                  "transfer_id": transfer_id}  # fmt: skip
        return await self.run(self.prefill, prompt, 1, params)

    async def decode_leg(
        self, transfer_id: str, prompt: str = PROMPT, engine_id: str = "eng-prefill"
    ) -> str:
        params = {"do_remote_decode": False, "do_remote_prefill": True,
                  "transfer_id": transfer_id, "remote_bootstrap_addr": self.addr,
                  "remote_engine_id": engine_id}  # fmt: skip
        text, _ = await self.run(self.decode, prompt, 8, params)
        return text


_LIMITS = Limits(MODEL, max_model_len=32_768, default_max_tokens=16)


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    bootstrap = BootstrapServer("127.0.0.1", 0)
    await bootstrap.start()
    bootstrap.register_self("eng-prefill", "127.0.0.1", 1)
    yield Pair(bootstrap)
    await bootstrap.stop()


async def test_decode_sent_first_waits_for_prefill_kv(pair: Pair) -> None:
    decode = asyncio.create_task(pair.decode_leg("xfer-a"))
    await asyncio.sleep(0.05)  # decode is already waiting for the transfer
    assert not decode.done()
    _, handle = await pair.prefill_leg("xfer-a")
    assert handle is None  # upstream vLLM's prefill answers without a handle
    text = await asyncio.wait_for(decode, 5)
    assert text == expected_text(prompt_ids(PROMPT), 8, kv_from_store=True, model=MODEL)
    assert text != expected_text(prompt_ids(PROMPT), 8, kv_from_store=False, model=MODEL)
    stats = pair.decode.stats_json()
    assert stats["kv_blocks_read"] >= 2
    assert stats["mooncake_vllm"]["transfers_claimed"] == 1
    assert stats["mooncake_vllm"]["bootstrap_queries"] == 1
    assert pair.prefill.stats_json()["mooncake_vllm"]["transfers_published"] == 1
    assert pair.bootstrap.queries == 1


async def test_prefill_first_then_decode_and_engine_ids_are_cached(pair: Pair) -> None:
    for transfer_id in ("xfer-1", "xfer-2"):
        await pair.prefill_leg(transfer_id)
        text = await pair.decode_leg(transfer_id)
        assert text == expected_text(prompt_ids(PROMPT), 8, kv_from_store=True, model=MODEL)
    assert pair.bootstrap.queries == 1  # decode asks /query once per new engine id


async def test_chat_prompt_round_trip(pair: Pair) -> None:
    messages = [{"role": "user", "content": "Where is the capital of China? " * 4}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 5}
    params = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "xfer-c"}
    for engine, extra in (
        (pair.prefill, {"max_tokens": 1, "kv_transfer_params": params}),
        (pair.decode, {"kv_transfer_params": {
            "do_remote_prefill": True, "transfer_id": "xfer-c",
            "remote_bootstrap_addr": pair.addr, "remote_engine_id": "eng-prefill"}}),
    ):  # fmt: skip
        parsed = parse_request({**body, **extra}, "chat", sim_tokenizer(), _LIMITS)
        plan = parse_kv_transfer_params(parsed.kv_transfer_params)
        async with engine.run(parsed, "r", plan, 0.0) as generation:
            text = "".join(generation.pieces)
    assert text == expected_text(chat_ids(messages), 5, kv_from_store=True, model=MODEL)


async def test_missing_kv_fails_after_the_bounded_wait() -> None:
    bootstrap = BootstrapServer("127.0.0.1", 0)
    await bootstrap.start()
    bootstrap.register_self("eng-prefill", "127.0.0.1", 1)
    try:
        pair = Pair(bootstrap, kv_wait_timeout_s=0.2)
        with pytest.raises(KVTransferError) as caught:
            await pair.decode_leg("xfer-never")
        assert caught.value.reason == "missing" and caught.value.status == 503
        assert "xfer-never" in caught.value.message and "0.2 s" in caught.value.message
        assert pair.decode.stats_json()["errors"] == 1
    finally:
        await bootstrap.stop()


async def test_unknown_engine_and_unreachable_bootstrap_fail_clearly(pair: Pair) -> None:
    await pair.prefill_leg("xfer-u")
    with pytest.raises(KVTransferError) as caught:
        await pair.decode_leg("xfer-u", engine_id="eng-elsewhere")
    assert caught.value.reason == "unknown_engine" and "eng-elsewhere" in caught.value.message
    pair.addr = f"http://127.0.0.1:{free_port()}"
    pair.decode.rendezvous.known_engines.clear()  # type: ignore[union-attr]
    with pytest.raises(KVTransferError) as caught:
        await pair.decode_leg("xfer-u")
    assert caught.value.reason == "bootstrap" and "/query" in caught.value.message


async def test_wrong_engine_and_wrong_prompt_are_caught(pair: Pair) -> None:
    pair.bootstrap.registry.register("eng-other", 1, 0, 0, "tcp://127.0.0.1:2")
    await pair.prefill_leg("xfer-w")
    with pytest.raises(KVTransferError) as caught:
        await pair.decode_leg("xfer-w", engine_id="eng-other")
    assert caught.value.reason == "wrong_engine"
    with pytest.raises(KVTransferError) as caught:
        await pair.decode_leg("xfer-w", prompt="A different prompt entirely, " * 8)
    assert caught.value.reason == "wrong_prompt"


async def test_corrupt_manifest_is_refused(pair: Pair) -> None:
    await pair.store.put([manifest_key(MODEL, "xfer-bad")], [b"not json"])
    with pytest.raises(KVTransferError) as caught:
        await pair.decode_leg("xfer-bad")
    assert caught.value.reason == "corrupt"


def test_manifest_keys_hash_the_transfer_id() -> None:
    key = manifest_key(MODEL, "xfer-" + "x" * 500 + "/../\n")
    assert key.startswith("engine_sim/xfer/v1/m/") and len(key) < 64
    assert manifest_key(MODEL, "a") != manifest_key(MODEL, "b")


class GatedStore(MemoryKVStore):
    """A store whose writes wait for `gate` (then fail if `fail`), noting when they start."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.started = asyncio.Event()
        self.fail = fail

    async def put(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        self.started.set()
        await self.gate.wait()
        if self.fail:
            raise KVStoreError("the store went away")
        await super().put(keys, values)


def _rendezvous(store: GatedStore) -> Rendezvous:
    return Rendezvous(StoreKVTransfer(store, MODEL, 64), "eng-p")


async def test_a_publish_counts_before_decode_can_see_it() -> None:
    store = GatedStore()
    rendezvous = _rendezvous(store)
    task = asyncio.get_running_loop().create_task(rendezvous.publish("x1", ("k",), 16, "r1"))
    await store.started.wait()
    # The manifest is not readable yet, and the publish already counts: by the time decode
    # reads it (and its client asks the prefill pod's stats) the count is there.
    assert not (await store.exists([manifest_key(MODEL, "x1")]))[0]
    assert rendezvous.published == 1
    store.gate.set()
    await task
    assert rendezvous.published == 1


async def test_a_prefill_cancelled_during_its_manifest_write_still_counts_it() -> None:
    # The router cancels a prefill request still open when decode is done: the write
    # lands anyway, and so does the count.
    store = GatedStore()
    rendezvous = _rendezvous(store)
    task = asyncio.get_running_loop().create_task(rendezvous.publish("x2", ("k",), 16, "r2"))
    await store.started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    store.gate.set()
    for _ in range(10):
        await asyncio.sleep(0)
    assert (await store.exists([manifest_key(MODEL, "x2")]))[0]
    assert rendezvous.published == 1


async def test_a_failed_manifest_write_is_not_counted() -> None:
    store = GatedStore(fail=True)
    rendezvous = _rendezvous(store)
    store.gate.set()
    with pytest.raises(KVTransferError, match="manifest write failed"):
        await rendezvous.publish("x3", ("k",), 16, "r3")
    assert rendezvous.published == 0
