"""One server's life: connect the KV store, start its engine (one per data-parallel rank),
serve HTTP until told to stop, close the store."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from aiohttp import web

from engine_sim.bootstrap import BootstrapServer, start_bootstrap
from engine_sim.config import SimConfig
from engine_sim.data_parallel import EngineGroup
from engine_sim.engine import Engine
from engine_sim.faults import Faults
from engine_sim.kv_events_pub import KVEventPublisher, add_debug_routes, start_kv_events
from engine_sim.kvstore import KVStore, MooncakeConfig, MooncakeKVStore
from engine_sim.metrics import MetricFamilies
from engine_sim.server import SimServer

log = logging.getLogger(__name__)

#: Listen backlog: benchmarks open many connections at once.
LISTEN_BACKLOG = 1024


async def connect_store(config: SimConfig) -> KVStore | None:
    """The Mooncake store when the config names a master, else None."""
    if config.mooncake_master is None or config.metadata_server is None:
        return None
    return await MooncakeKVStore.connect(
        MooncakeConfig(
            master_address=config.mooncake_master,
            metadata_server=config.metadata_server,
            local_hostname=config.advertise_host,
            global_segment_bytes=config.global_segment_bytes,
            local_buffer_bytes=config.local_buffer_bytes,
        )
    )


async def serve(config: SimConfig, stop: asyncio.Event) -> None:
    """Run until `stop` is set. The store connects before the port opens, so /health
    answering means the pod can move KV."""
    store = await connect_store(config)
    publishers: list[KVEventPublisher] = []
    try:
        engines = start_engines(config, store, publishers)
        app = SimServer(EngineGroup(engines), Faults(config.faults)).app()
        add_debug_routes(app, engines)  # GET /sim/cache
        runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            keepalive_timeout=config.keep_alive_timeout_s,
            # Cancel a handler whose client went away, as vLLM aborts such a request.
            handler_cancellation=True,
        )
        await runner.setup()
        bootstrap = None
        try:
            # Before the HTTP port: once /health answers, /query lists this engine.
            bootstrap = await start_bootstrap(config)
            site = web.TCPSite(runner, config.host, config.port, backlog=LISTEN_BACKLOG)
            await site.start()
            port = int(runner.addresses[0][1])
            for engine in engines:
                engine.bootstrap = bootstrap
                engine.address = (config.advertise_host, port)
            if bootstrap is not None:
                register_workers(bootstrap, engines, config.advertise_host, port)
            if config.port_file:
                _write_atomically(Path(config.port_file), f"{port}\n")
            log.info(
                "engine_sim %s serving %s on http://%s:%d (engine_id %s, kv store %s)",
                config.role,
                config.model,
                config.host,
                port,
                config.engine_id,
                config.mooncake_master or "none",
            )
            await stop.wait()
            log.info("engine_sim stopping")
        finally:
            if bootstrap is not None:
                await bootstrap.stop()
            await runner.cleanup()
    finally:
        for publisher in publishers:
            publisher.close()
        if store is not None:
            await store.close()


def start_engines(
    config: SimConfig, store: KVStore | None, publishers: list[KVEventPublisher]
) -> list[Engine]:
    """One engine per data-parallel rank this process runs (`config.data_parallel_ranks`:
    all N, or one node's), each with its KV events publisher (appended to `publishers` as
    it starts, for the caller to close), sharing the store, the tokenizer and the
    `/metrics` page. Each engine keeps its global rank; its index here is its local rank."""
    families = MetricFamilies(config.block_size, config.kv_capacity_blocks)
    engines: list[Engine] = []
    for local_rank, rank in enumerate(config.data_parallel_ranks):
        # Before the engine: its prefix cache reports every block from the first request on.
        kv_events = start_kv_events(config, rank)
        if kv_events is not None:
            publishers.append(kv_events)
        engine = Engine(
            config,
            store,
            kv_events.on_cache_event if kv_events else None,
            engines[0].tokenizer if engines else None,
            rank=rank,
            local_rank=local_rank,
            metric_families=families,
        )
        engine.kv_events = kv_events
        engines.append(engine)
    return engines


def register_workers(
    bootstrap: BootstrapServer, engines: Sequence[Engine], host: str, port: int
) -> None:
    """List every engine of the pod on its bootstrap server under its local rank: vLLM's
    worker registers `data_parallel_rank_local` when the server serves its local engines
    only (hybrid or external load balancing; each node then has its own bootstrap server),
    else the global rank, the same number with one API server for all ranks."""
    for engine in engines:
        bootstrap.register_self(engine.engine_id, host, port, engine.local_rank)


def _write_atomically(path: Path, text: str) -> None:
    """Readers polling for the file never see it half written."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)
