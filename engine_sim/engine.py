"""The simulated engine: admission, prefill (local, cached or from the store), token pacing.

One `Engine` per engine core owns the prefix cache, the scheduler, the stats and the
metrics: one per process, or one per data-parallel rank (`data_parallel.py`) sharing the
tokenizer, the KV store and the `/metrics` page. HTTP handling (`server.py`) only parses,
calls `Engine.run` and formats.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Any

from engine_sim.block_hash import BlockHashMemo
from engine_sim.bootstrap import BootstrapServer, Rendezvous
from engine_sim.cache_events import CacheEventSink
from engine_sim.compute import ComputeLine, prefill_chunks
from engine_sim.config import SimConfig
from engine_sim.data_parallel import rank_engine_id
from engine_sim.generation import local_seed, output_pieces, store_seed
from engine_sim.kv_params import TransferMode, TransferPlan, build_prefill_handle
from engine_sim.kv_transfer import ExportResult, ImportResult, KVTransferError, StoreKVTransfer
from engine_sim.kvstore import KVStore
from engine_sim.latency import pause
from engine_sim.metrics import EngineMetrics, MetricFamilies
from engine_sim.pending_blocks import PendingBlocks
from engine_sim.prefix_cache import CacheLease, PrefixCache, PublishCursor
from engine_sim.prompts import PromptTokenizer, load_tokenizer
from engine_sim.protocol import Limits, ParsedRequest
from engine_sim.scheduler import Scheduler
from engine_sim.stats import RecordKind, RequestRecord, SimStats

if TYPE_CHECKING:
    from engine_sim.kv_events_pub import KVEventPublisher

log = logging.getLogger(__name__)

_KIND: dict[TransferMode, RecordKind] = {
    TransferMode.NONE: "both",
    TransferMode.EXPORT: "prefill",
    TransferMode.IMPORT: "decode",
    TransferMode.INCOMPLETE: "decode",
}

# vLLM's null block id: stands for blocks the simulated cache had no room to hold.
_NULL_BLOCK_ID = 0


@dataclass(frozen=True, slots=True)
class Generation:
    """A prefilled request, ready to emit its tokens."""

    pieces: list[str]
    prompt_tokens: int
    cached_tokens: int
    kv_from_store: bool
    kv_transfer_params: dict[str, Any] | None


class Engine:
    """Serves parsed requests; see the module docstring."""

    def __init__(
        self,
        config: SimConfig,
        store: KVStore | None,
        on_cache_event: CacheEventSink | None = None,
        tokenizer: PromptTokenizer | None = None,
        *,
        rank: int = 0,
        local_rank: int | None = None,
        metric_families: MetricFamilies | None = None,
    ) -> None:
        self.config = config
        # Global data-parallel rank (0 without data parallelism): KV events, metrics, stats.
        self.rank = rank
        # Index among this process's engines (vLLM's local_dp_rank; None: the rank): the
        # engine id's suffix and the bootstrap server's dp_rank.
        self.local_rank = rank if local_rank is None else local_rank
        self.engine_id = rank_engine_id(config.engine_id, self.local_rank,
                                        config.data_parallel_size)
        self.tokenizer = tokenizer or load_tokenizer(config.tokenizer, config.chat_template)
        self.limits = Limits(config.model, config.max_model_len, config.default_max_tokens,
                             tuple(name for name, _ in config.lora_modules))
        self.block_hashes = BlockHashMemo(
            config.block_size, config.python_hash_seed, config.hash_algo
        )
        self.cache = PrefixCache(config.kv_capacity_blocks, config.block_size, on_cache_event)
        self.pending = PendingBlocks()
        self.scheduler = Scheduler(config.max_num_seqs, config.max_waiting)
        self.compute = ComputeLine()
        self.transfer = (
            StoreKVTransfer(store, config.model, config.kv_block_bytes) if store else None
        )
        # Upstream vLLM MooncakeConnector: transfer-id rendezvous, bootstrap server (prefill).
        self.rendezvous = (
            Rendezvous(self.transfer, self.engine_id, config.kv_wait_timeout_s)
            if self.transfer
            else None
        )
        self.bootstrap: BootstrapServer | None = None  # set by service.serve on prefill pods
        self.kv_events: KVEventPublisher | None = None  # set by service.serve when publishing
        self.store_prefix_queries = 0  # --store-prefix-cache: tokens looked up, tokens read
        self.store_prefix_hits = 0
        self.stats = SimStats(config.recent_records)
        self.metrics = EngineMetrics(
            config.model,
            running=lambda: self.running,
            waiting=lambda: self.waiting,
            kv_usage=self.cache.usage,
            block_size=config.block_size,
            num_gpu_blocks=config.kv_capacity_blocks,
            families=metric_families,
            engine=rank,
        )
        self.latency = config.latency
        self.address = (config.advertise_host, config.port)  # updated once the port is bound

    @asynccontextmanager
    async def run(
        self, request: ParsedRequest, internal_id: str, plan: TransferPlan, arrival: float
    ) -> AsyncIterator[Generation]:
        """Admit, prefill, then hold the slot while the caller emits the tokens.

        Raises QueueFullError before admission and KVTransferError from prefill.
        """
        await self.scheduler.acquire()
        kind = _KIND[plan.mode]
        lease: CacheLease | None = None
        private = 0
        error: str | None = None
        generation: Generation | None = None
        blocks = 0
        try:
            generation, lease, private, blocks = await self._prefill(request, internal_id, plan)
            self.metrics.observe_ttft(time.perf_counter() - arrival, len(request.token_ids))
            yield generation
        except KVTransferError as exc:
            error = exc.reason
            raise
        except BaseException as exc:
            error = type(exc).__name__
            raise
        finally:
            if lease is not None:
                self.cache.release(lease)
            self.cache.release_private(private)
            self.scheduler.release()
            if error is None:
                self.metrics.observe_finished(time.perf_counter() - arrival, request.max_tokens)
            self.stats.record(
                RequestRecord(
                    request_id=internal_id,
                    kind=kind,
                    kv_from_store=generation.kv_from_store if generation else False,
                    blocks=blocks,
                    prompt_tokens=len(request.token_ids),
                    cached_tokens=generation.cached_tokens if generation else 0,
                    error=error,
                    rank=self.rank if self.config.data_parallel_size > 1 else None,
                )
            )

    @property
    def running(self) -> int:
        """Requests in the running batch (vLLM's RUNNING): admitted, not queued for compute."""
        return self.scheduler.running - self.compute.waiting

    @property
    def waiting(self) -> int:
        """Requests waiting to be admitted or for the compute line (vLLM's WAITING)."""
        return self.scheduler.waiting + self.compute.waiting

    async def token_gap(self) -> None:
        """Wait one inter-token latency for the current batch size."""
        await pause(self.latency.inter_token_seconds(self.running))

    @property
    def paces_tokens(self) -> bool:
        """Whether tokens are spaced in time at all (not with --fast)."""
        return self.latency.inter_token_seconds(1) > 0

    async def _prefill(
        self, request: ParsedRequest, internal_id: str, plan: TransferPlan
    ) -> tuple[Generation, CacheLease, int, int]:
        config = self.config
        size = config.block_size
        token_ids = request.token_ids
        num_tokens = len(token_ids)
        hashes = self.block_hashes.hashes(token_ids, request.cache_salt, request.lora_name)
        # vLLM always computes at least the last prompt token.
        hit_blocks = min(self.cache.match(hashes), (num_tokens - 1) // size)
        cached_tokens = hit_blocks * size
        self.metrics.observe_prefix_cache(num_tokens, cached_tokens)
        self.stats.prefix_cache_queries += num_tokens
        self.stats.prefix_cache_hits += cached_tokens

        blocks = 0
        kv_from_store = False
        computed = cached_tokens
        loaded = 0
        # Wall time of the real store reads below: they carry proof bytes, and their time is
        # part of the modelled cost (the pause), not added to it (README: hardware, not our
        # CPU). A rendezvous claim waits for the prefill first: that wait is not a read.
        reads_s = 0.0
        started = time.perf_counter()
        if (
            plan.mode is not TransferMode.IMPORT
            and config.store_prefix_cache
            and self.transfer is not None
        ):
            loaded = await self._load_prefix(hashes, hit_blocks, (num_tokens - 1) // size)
            computed += loaded * size
            reads_s = time.perf_counter() - started
        moved_tokens = 0  # KV tokens that crossed the network (store load, PD transfer)
        if plan.mode is TransferMode.IMPORT:
            imported = await self._import(plan, hashes)
            if plan.rendezvous is None:
                reads_s = time.perf_counter() - started
            moved_tokens = imported.blocks * size
            self.stats.kv_blocks_read += imported.blocks
            blocks = imported.blocks
            kv_from_store = True
            computed = max(computed, imported.blocks * size)
            seed = store_seed(imported.digest, token_ids)
        else:
            if plan.mode is TransferMode.INCOMPLETE:
                log.warning(
                    "request %s: incomplete kv_transfer_params, prefilling locally", internal_id
                )
            seed = local_seed(token_ids)

        # Its new blocks' `BlockStored` go out once the step that fills them is done (vLLM
        # publishes a step's events after the step: `prefix_cache.py`).
        lease = self.cache.acquire(hashes, token_ids, request.cache_salt, defer_stored=True,
                                   lora=request.lora)
        published = PublishCursor(self.cache, lease)
        claim = self.pending.claim(lease.block_hashes, writes_from=hit_blocks)
        total_blocks = -(-(num_tokens + request.max_tokens) // size)
        private = max(0, total_blocks - len(lease.block_hashes))
        self.cache.reserve_private(private)
        writing: asyncio.Task[ExportResult] | None = None
        try:
            per_token = config.store_load_per_token_s
            # Beside the compute line: the step's fixed cost and the KV that crossed the
            # network (the connector loads it before the request is scheduled).
            beside = (
                self.latency.prefill_overhead_s
                + self.latency.kv_transfer_seconds(moved_tokens)
                + (
                    self.latency.kv_transfer_seconds(loaded * size)
                    if per_token is None
                    else loaded * size * per_token
                )
            )
            if plan.mode is TransferMode.EXPORT:
                # Mooncake streams a prefill's KV to the store layer by layer, overlapped
                # with compute: the real write runs during the modelled prefill.
                writing = asyncio.create_task(self._require_transfer().export_blocks(hashes))
            try:
                await self.pending.wait(claim)  # a hit on blocks still being written
                await pause(beside - reads_s)
                published.through(computed // size)  # the connector's load has landed
                ends = prefill_chunks(computed, num_tokens, config.max_num_batched_tokens)
                steps = [self.latency.compute_seconds(end - start)
                         for start, end in pairwise([computed, *ends])]
                await self.compute.run(steps, lambda step: published.through(ends[step] // size))
            finally:
                published.through(len(lease.block_hashes))  # computed, or given up: held
                self.pending.release(claim)
            handle: dict[str, Any] | None = None
            if writing is not None:
                exported = await writing
                self.stats.kv_blocks_written += exported.written
                self.stats.kv_blocks_write_skipped += exported.skipped
                if self.kv_events is not None and exported.written_indices:
                    self.kv_events.store_written(
                        hashes, exported.written_indices, token_ids, size, request.cache_salt
                    )
                blocks = len(exported.keys)
                if plan.transfer_id is not None:  # upstream vLLM Mooncake: no handle
                    await self._require_rendezvous().publish(
                        plan.transfer_id, exported.keys, num_tokens, internal_id
                    )
                else:
                    block_ids = list(lease.block_ids)
                    block_ids += [_NULL_BLOCK_ID] * (len(hashes) - len(block_ids))
                    handle = build_prefill_handle(
                        engine_id=self.engine_id,
                        request_id=internal_id,
                        host=config.nixl_side_channel_host,
                        port=config.nixl_side_channel_port + self.rank,
                        block_ids=block_ids,
                        num_tokens=num_tokens,
                        store_keys=exported.keys,
                        per_group=config.block_ids_per_group,
                    )
        except BaseException:
            self.pending.release(claim)
            if writing is not None:
                if not writing.done():
                    writing.cancel()
                elif not writing.cancelled():
                    writing.exception()  # retrieved: the error that matters is being raised
            self.cache.release(lease)
            self.cache.release_private(private)
            raise
        generation = Generation(
            pieces=output_pieces(seed, request.max_tokens),
            prompt_tokens=num_tokens,
            cached_tokens=cached_tokens,
            kv_from_store=kv_from_store,
            kv_transfer_params=handle,
        )
        return generation, lease, private, blocks

    async def _load_prefix(self, hashes: tuple[int, ...], start: int, stop: int) -> int:
        """Blocks `start`.. of the prompt read from the store (`--store-prefix-cache`).

        A store error only costs the hit: prefill computes those blocks instead.
        """
        assert self.transfer is not None
        loaded = 0
        if start < stop:
            try:
                loaded = await self.transfer.load_prefix(hashes[start:stop])
            except KVTransferError as exc:
                log.warning("store prefix lookup failed, computing instead: %s", exc.message)
        size = self.config.block_size
        queried, hit = (stop - start) * size, loaded * size
        self.store_prefix_queries += queried
        self.store_prefix_hits += hit
        self.metrics.observe_external_prefix_cache(queried, hit)
        return loaded

    async def _import(self, plan: TransferPlan, hashes: tuple[int, ...]) -> ImportResult:
        """Read the prompt's KV named by a NIXL-shaped handle or claimed by transfer id."""
        if plan.rendezvous is not None:
            return await self._require_rendezvous().claim(plan.rendezvous, hashes)
        assert plan.handle is not None
        return await self._require_transfer().import_blocks(plan.handle.store_keys, hashes)

    def _require_rendezvous(self) -> Rendezvous:
        self._require_transfer()
        assert self.rendezvous is not None
        return self.rendezvous

    def _require_transfer(self) -> StoreKVTransfer:
        if self.transfer is None:
            raise KVTransferError(
                "no_store",
                503,
                "this pod has no KV store (start it with --mooncake-master and "
                "--metadata-server to serve PD requests)",
            )
        return self.transfer

    def stats_json(self) -> dict[str, Any]:
        """`/sim/stats`: identity, load and counters."""
        config = self.config
        rank = {"data_parallel_rank": self.rank} if config.data_parallel_size > 1 else {}
        return {
            "role": config.role,
            "engine_id": self.engine_id,
            **rank,
            "pod_name": config.pod_name,
            "model": config.model,
            "running": self.running,
            "waiting": self.waiting,
            "kv_cache": {
                "capacity_blocks": self.cache.capacity,
                "cached_blocks": self.cache.num_cached,
                "in_use_blocks": self.cache.num_in_use,
                "usage": self.cache.usage(),
            },
            "kv_events": self.kv_events.stats_json() if self.kv_events else None,
            "store_prefix_cache": {
                "queries": self.store_prefix_queries,
                "hits": self.store_prefix_hits,
            },
            "mooncake_vllm": {
                "bootstrap": self.bootstrap.status_json() if self.bootstrap else None,
                **(self.rendezvous.stats_json() if self.rendezvous else {}),
            },
            **self.stats.to_json(),
        }
