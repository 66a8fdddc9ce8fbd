"""Upstream vLLM MooncakeConnector on the simulator: prefill's bootstrap server and the
transfer-id rendezvous, KV still moving through the Mooncake Store.

Why it differs from the NIXL-shaped flow (`kv_params.py`): upstream vLLM's prefill answers
with no handle. The router makes up one `transfer_id`, sends it to both engines (at once, as
vLLM's reference proxy and pdgate do, or prefill first, as vLLM Router 0.1.17 does), and
tells decode where prefill's bootstrap server is and which engine id to pull from. vLLM then
pushes the blocks over its transfer engine; here prefill writes the prompt's blocks (keys
from the block hashes, `kv_blocks.py`) and then a small manifest under a key derived from
the transfer id, and decode waits a bounded time for that manifest, reads the blocks and
checks their bytes. Either arrival order works.

The exchange, as vLLM implements it (vllm-project/vllm, kv_connector/v1/mooncake/
mooncake_utils.py `MooncakeBootstrapServer`; mooncake_connector.py
`update_state_after_alloc`, `request_finished`, `_connect_to_prefiller_bootstrap`):

- `GET /query` on the bootstrap port (vLLM: `VLLM_MOONCAKE_BOOTSTRAP_PORT`, default 8998;
  here `--bootstrap-port`, prefill pods only, bound on `--host`) answers
  `{"<dp_rank>": {"engine_id": str, "worker_addr": {"<tp_rank>": {"<pp_rank>":
  "tcp://host:port"}}}}` (FastAPI turns the int keys into strings). `{}` until a worker
  has registered; with data parallelism one entry per rank, its engine id
  `<--engine-id>_dp<rank>`. On a node of a multi-node deployment (hybrid or external load
  balancing) each node serves its own bootstrap server, listing its engines under their
  local ranks 0..L-1 (vLLM's worker registers `data_parallel_rank_local` when
  `local_engines_only`, else the global rank; its engine ids carry the local rank too).
  Newer vLLM adds fields (`tp_size`, `pp_size`, ...); readers ignore them.
  The simulator has no ZMQ side channel: its worker address names its HTTP port.
- `POST /register` `{engine_id, dp_rank, tp_rank, pp_rank, addr}` -> `{"status": "ok"}`;
  400 when the rank already has another engine id or the worker slot is taken.
- Prefill request: `kv_transfer_params: {do_remote_decode: true, do_remote_prefill:
  false, transfer_id}`. vLLM answers with `kv_transfer_params: null`, as here, after the
  blocks and the manifest are in the store.
- Decode request: `kv_transfer_params: {do_remote_decode: false, do_remote_prefill: true,
  transfer_id, remote_bootstrap_addr: "http://host:port", remote_engine_id}`. All three
  named fields are needed, else decode prefills locally with a warning (as vLLM does).
  Decode GETs `remote_bootstrap_addr + "/query"` for an engine id it does not know yet
  and fails (503) when that engine is not listed, then claims the transfer.

Failures are `KVTransferError`s: `bootstrap` and `unknown_engine` (503: the bootstrap
server cannot be asked or does not list the engine), `missing` (503: no manifest within
`--kv-wait-timeout`), `wrong_engine`, `wrong_prompt`, `corrupt` and `store` (500).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Final

import aiohttp
import orjson
from aiohttp import web

from engine_sim.kv_params import RendezvousParams
from engine_sim.kv_transfer import ImportResult, KVTransferError, StoreKVTransfer
from engine_sim.kvstore import KVStoreError

if TYPE_CHECKING:
    from engine_sim.config import SimConfig

log = logging.getLogger(__name__)

#: vLLM's `VLLM_MOONCAKE_BOOTSTRAP_PORT` default.
DEFAULT_BOOTSTRAP_PORT: Final = 8998
#: How long decode waits for prefill's KV by default (the two legs may run at once).
DEFAULT_KV_WAIT_TIMEOUT_S: Final = 30.0
#: Longest wait for one `/query` from decode.
BOOTSTRAP_QUERY_TIMEOUT_S: Final = 5.0
#: Key namespace of transfer manifests (block keys live under `kv_blocks.KEY_NAMESPACE`).
MANIFEST_NAMESPACE: Final = "engine_sim/xfer/v1"
#: Engine ids a decode pod remembers from `/query` answers before starting over.
_MAX_KNOWN_ENGINES: Final = 1024
_POLL_FIRST_S: Final = 0.002
_POLL_MAX_S: Final = 0.05


class BootstrapFault(Enum):
    """What `--bootstrap-fault` makes the bootstrap server do, for router failure tests."""

    NONE = "none"
    DOWN = "down"  # never started: connections are refused
    ERROR = "error"  # /query answers 500
    GARBAGE = "garbage"  # /query answers 200 with a body that is not JSON
    EMPTY = "empty"  # /query answers {} (no worker registered yet)
    MALFORMED = "malformed"  # /query answers JSON without engine_id / worker_addr


class BootstrapError(Exception):
    """The bootstrap server cannot start on the port it was explicitly given."""


class RegistrationConflict(Exception):
    """A `/register` that vLLM's bootstrap server refuses with 400."""


@dataclass(slots=True)
class EngineEntry:
    """One data-parallel engine: its id and `{tp_rank: {pp_rank: worker address}}`."""

    engine_id: str
    worker_addr: dict[int, dict[int, str]] = field(default_factory=dict)


class BootstrapRegistry:
    """The state behind `/register` and `/query`, with vLLM's conflict rules."""

    def __init__(self) -> None:
        self.workers: dict[int, EngineEntry] = {}

    def register(self, engine_id: str, dp_rank: int, tp_rank: int, pp_rank: int, addr: str) -> None:
        """Add one worker; raises RegistrationConflict where vLLM answers 400."""
        entry = self.workers.setdefault(dp_rank, EngineEntry(engine_id))
        if entry.engine_id != engine_id:
            raise RegistrationConflict(
                f"Engine ID mismatch for dp_rank={dp_rank}: expected {entry.engine_id}, "
                f"got {engine_id}"
            )
        ranks = entry.worker_addr.setdefault(tp_rank, {})
        if pp_rank in ranks:
            raise RegistrationConflict(
                f"Worker with dp_rank={dp_rank}, tp_rank={tp_rank}, pp_rank={pp_rank} is "
                f"already registered at {ranks[pp_rank]}, but still want to register at {addr}"
            )
        ranks[pp_rank] = addr

    def query_json(self) -> dict[str, Any]:
        """The `/query` body: JSON object keys are strings, as FastAPI writes them."""
        return {
            str(dp): {
                "engine_id": entry.engine_id,
                "worker_addr": {
                    str(tp): {str(pp): addr for pp, addr in pps.items()}
                    for tp, pps in entry.worker_addr.items()
                },
            }
            for dp, entry in self.workers.items()
        }


class BootstrapServer:
    """vLLM's prefill-side bootstrap server on its own port (`start`, `stop`)."""

    def __init__(self, host: str, port: int, fault: BootstrapFault = BootstrapFault.NONE) -> None:
        self.host = host
        self.requested_port = port
        self.port: int | None = None
        self.fault = fault
        self.registry = BootstrapRegistry()
        self.queries = 0
        self.error: str | None = None
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/query", self.query)
        app.router.add_post("/register", self.register)
        return app

    async def start(self) -> None:
        """Bind and serve; raises OSError when the port is taken."""
        if self.fault is BootstrapFault.DOWN:
            self.error = "not started (--bootstrap-fault down)"
            return
        runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self.requested_port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        log.info("mooncake bootstrap server on http://%s:%d", self.host, self.port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def register_self(self, engine_id: str, host: str, port: int, dp_rank: int = 0) -> None:
        """Register the worker (tp 0, pp 0) of this pod's engine `dp_rank` (its local
        rank: the global one unless the pod is one node of several), as vLLM's worker does
        at start: one server lists every data-parallel rank of the pod."""
        self.registry.register(engine_id, dp_rank, 0, 0, f"tcp://{host}:{port}")

    async def query(self, request: web.Request) -> web.Response:
        self.queries += 1
        fault = self.fault
        if fault is BootstrapFault.ERROR:
            return web.Response(status=500, text="Internal Server Error")
        if fault is BootstrapFault.GARBAGE:
            return web.Response(body=b"<html>bootstrap</html>", content_type="application/json")
        if fault is BootstrapFault.EMPTY:
            return _json({})
        if fault is BootstrapFault.MALFORMED:
            return _json({"0": {"engine": "?", "workers": []}})
        return _json(self.registry.query_json())

    async def register(self, request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read())
            fields = [body[name] for name in ("engine_id", "dp_rank", "tp_rank", "pp_rank", "addr")]
        except (orjson.JSONDecodeError, TypeError, KeyError) as exc:
            return _json({"detail": f"invalid registration: {exc!r}"}, 422)
        engine_id, dp, tp, pp, addr = fields
        if not (isinstance(engine_id, str) and isinstance(addr, str)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in (dp, tp, pp)
        ):
            return _json({"detail": "invalid registration: wrong field types"}, 422)
        try:
            self.registry.register(engine_id, dp, tp, pp, addr)
        except RegistrationConflict as exc:
            return _json({"detail": str(exc)}, 400)
        return _json({"status": "ok"})

    def status_json(self) -> dict[str, Any]:
        return {
            "port": self.port,
            "fault": self.fault.value,
            "queries": self.queries,
            "error": self.error,
        }


async def start_bootstrap(config: SimConfig) -> BootstrapServer | None:
    """The bootstrap server of a prefill pod, started; None on other roles.

    With the default port a bind failure is only logged (several simulated prefill pods may
    share one address, and the NIXL-shaped flow does not need the server); with an explicit
    `--bootstrap-port` it raises BootstrapError.
    """
    if config.role != "prefill":
        return None
    explicit = config.bootstrap_port is not None
    port = DEFAULT_BOOTSTRAP_PORT if config.bootstrap_port is None else config.bootstrap_port
    server = BootstrapServer(config.host, port, BootstrapFault(config.bootstrap_fault))
    try:
        await server.start()
    except OSError as exc:
        if explicit:
            raise BootstrapError(
                f"mooncake bootstrap server cannot listen on {config.host}:{port}: {exc}"
            ) from exc
        server.error = f"cannot listen on {config.host}:{port}: {exc}"
        log.warning("mooncake bootstrap server not started: %s", server.error)
    return server


def manifest_key(model: str, transfer_id: str) -> str:
    """Store key of a transfer's manifest: hashed, since transfer ids are any client text."""
    digest = hashlib.sha256(transfer_id.encode()).hexdigest()[:32]
    return f"{MANIFEST_NAMESPACE}/{model}/{digest}"


class Rendezvous:
    """Prefill publishes a transfer by id; decode claims it (bounded wait), then reads the KV."""

    def __init__(
        self,
        transfer: StoreKVTransfer,
        engine_id: str,
        wait_timeout_s: float = DEFAULT_KV_WAIT_TIMEOUT_S,
        query_timeout_s: float = BOOTSTRAP_QUERY_TIMEOUT_S,
    ) -> None:
        self.transfer = transfer
        self.engine_id = engine_id
        self.wait_timeout_s = wait_timeout_s
        self.query_timeout_s = query_timeout_s
        self.known_engines: dict[str, str] = {}  # engine id -> bootstrap address it came from
        self.published = 0
        self.claimed = 0
        self.bootstrap_queries = 0

    async def publish(
        self, transfer_id: str, store_keys: tuple[str, ...], num_tokens: int, request_id: str
    ) -> None:
        """Prefill: the blocks are in the store; name them under the transfer id."""
        manifest = {
            "transfer_id": transfer_id,
            "engine_id": self.engine_id,
            "request_id": request_id,
            "num_tokens": num_tokens,
            "store_keys": list(store_keys),
        }
        # Counted before the write: decode can see the manifest (and its client the answer)
        # before this coroutine resumes, and the router cancels a prefill request still
        # open when decode is done, here at this await. Taken back if the write fails;
        # shielded, so that a cancelled request's write still settles the count.
        self.published += 1
        write = asyncio.ensure_future(self.transfer.store.put(
            [manifest_key(self.transfer.model, transfer_id)], [orjson.dumps(manifest)]
        ))
        write.add_done_callback(self._unpublish_failed)
        try:
            await asyncio.shield(write)
        except KVStoreError as exc:
            raise KVTransferError("store", 500, f"KV manifest write failed: {exc}") from exc

    def _unpublish_failed(self, write: asyncio.Future[None]) -> None:
        if write.cancelled() or write.exception() is not None:
            self.published -= 1

    async def claim(self, params: RendezvousParams, block_hashes: Sequence[int]) -> ImportResult:
        """Decode: check the engine with its bootstrap server, wait for the manifest, read KV."""
        await self._check_engine(params)
        manifest = await self._wait_manifest(params)
        writer = manifest.get("engine_id")
        if writer != params.engine_id or manifest.get("transfer_id") != params.transfer_id:
            raise KVTransferError(
                "wrong_engine",
                500,
                f"KV of transfer_id {params.transfer_id!r} was written by engine {writer!r}, "
                f"but decode was told to pull from {params.engine_id!r}",
            )
        keys = manifest.get("store_keys")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise KVTransferError("corrupt", 500, "KV manifest has no list of store keys")
        result = await self.transfer.import_blocks(keys, block_hashes)
        self.claimed += 1
        return result

    async def _check_engine(self, params: RendezvousParams) -> None:
        if params.engine_id in self.known_engines:
            return
        engines = await self._query(params.bootstrap_addr)
        if len(self.known_engines) + len(engines) > _MAX_KNOWN_ENGINES:
            self.known_engines.clear()
        for engine_id in engines:
            self.known_engines[engine_id] = params.bootstrap_addr
        if params.engine_id not in engines:
            raise KVTransferError(
                "unknown_engine",
                503,
                f"prefill engine {params.engine_id!r} is not registered at the bootstrap "
                f"server {params.bootstrap_addr} (it lists {sorted(engines)})",
            )

    async def _query(self, bootstrap_addr: str) -> list[str]:
        """Engine ids `/query` lists, as vLLM's `_connect_to_prefiller_bootstrap` reads them."""
        url = bootstrap_addr + "/query"
        self.bootstrap_queries += 1
        try:
            timeout = aiohttp.ClientTimeout(total=self.query_timeout_s)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                async with session.get(url) as response:
                    if response.status != 200:
                        raise ValueError(f"HTTP {response.status}")
                    data = orjson.loads(await response.read())
            engines = [entry["engine_id"] for entry in data.values()]
            if not all(isinstance(e, str) for e in engines):
                raise ValueError("an engine_id is not a string")
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            raise KVTransferError(
                "bootstrap", 503, f"decode could not query the bootstrap server {url}: {exc}"
            ) from exc
        except (AttributeError, KeyError, TypeError) as exc:
            raise KVTransferError(
                "bootstrap", 503, f"the bootstrap server {url} answered a malformed body: {exc!r}"
            ) from exc
        return engines

    async def _wait_manifest(self, params: RendezvousParams) -> dict[str, Any]:
        key = manifest_key(self.transfer.model, params.transfer_id)
        store = self.transfer.store
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_timeout_s
        delay = _POLL_FIRST_S
        try:
            while not (await store.exists([key]))[0]:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise KVTransferError(
                        "missing",
                        503,
                        f"no KV for transfer_id {params.transfer_id!r} from engine "
                        f"{params.engine_id!r} within {self.wait_timeout_s:g} s: the prefill "
                        "request with this transfer_id never finished",
                    )
                await asyncio.sleep(min(delay, remaining))
                delay = min(delay * 2, _POLL_MAX_S)
            raw = (await store.get([key]))[0]
        except KVStoreError as exc:
            raise KVTransferError("store", 500, f"KV manifest read failed: {exc}") from exc
        try:
            manifest = orjson.loads(raw or b"")
        except orjson.JSONDecodeError as exc:
            raise KVTransferError("corrupt", 500, f"KV manifest is not JSON: {exc}") from exc
        if not isinstance(manifest, dict):
            raise KVTransferError("corrupt", 500, "KV manifest is not a JSON object")
        return manifest

    def stats_json(self) -> dict[str, Any]:
        return {
            "transfers_published": self.published,
            "transfers_claimed": self.claimed,
            "bootstrap_queries": self.bootstrap_queries,
        }


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")
