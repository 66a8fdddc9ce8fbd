"""Everything one simulated engine is started with (filled from the command line)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine_sim.block_hash import DEFAULT_BLOCK_SIZE, DEFAULT_HASH_ALGO
from engine_sim.bootstrap import DEFAULT_KV_WAIT_TIMEOUT_S
from engine_sim.compute import DEFAULT_MAX_NUM_BATCHED_TOKENS
from engine_sim.faults import FaultSpec
from engine_sim.kv_blocks import DEFAULT_KV_BLOCK_BYTES
from engine_sim.kvstore import DEFAULT_GLOBAL_SEGMENT_BYTES, DEFAULT_LOCAL_BUFFER_BYTES
from engine_sim.latency import LatencyModel
from engine_sim.prefix_cache import DEFAULT_CAPACITY_BLOCKS
from engine_sim.prompts import DEFAULT_TOKENIZER
from engine_sim.scheduler import DEFAULT_MAX_WAITING
from engine_sim.stats import DEFAULT_RECENT_RECORDS
from router.kvhash.vllm import HashAlgo

Role = Literal["prefill", "decode", "both"]


@dataclass(frozen=True, slots=True)
class SimConfig:
    role: Role
    model: str
    port: int
    host: str = "127.0.0.1"
    advertise_host: str = "127.0.0.1"
    engine_id: str = "engine-sim"
    pod_name: str = "engine-sim"
    mooncake_master: str | None = None
    metadata_server: str | None = None
    global_segment_bytes: int = DEFAULT_GLOBAL_SEGMENT_BYTES
    local_buffer_bytes: int = DEFAULT_LOCAL_BUFFER_BYTES
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS
    kv_block_bytes: int = DEFAULT_KV_BLOCK_BYTES
    # vLLM's --prefix-caching-hash-algo and PYTHONHASHSEED (None: unset, a random root).
    hash_algo: HashAlgo = DEFAULT_HASH_ALGO
    python_hash_seed: str | None = None
    block_ids_per_group: bool = False
    # vLLM's NixlConnector side channel (VLLM_NIXL_SIDE_CHANNEL_HOST / _PORT): the handle's
    # remote_host, and remote_port + the data-parallel rank. Named, not listened on: the
    # simulator's KV moves through the Mooncake Store.
    nixl_side_channel_host: str = "localhost"
    nixl_side_channel_port: int = 5600
    # Upstream vLLM MooncakeConnector (engine_sim.bootstrap). None: 8998, best effort.
    bootstrap_port: int | None = None
    bootstrap_fault: str = "none"
    kv_wait_timeout_s: float = DEFAULT_KV_WAIT_TIMEOUT_S
    # vLLM KV events (engine_sim.kv_events_pub). None: 5557 / 5558, best effort; 0: off.
    kv_events_port: int | None = None
    kv_events_replay_port: int | None = None
    kv_events_layout: str = "map"  # vLLM's since vllm#42892; "array": the releases before
    # LoRA adapters served besides the model (vLLM `--lora-modules name=path`).
    lora_modules: tuple[tuple[str, str], ...] = ()
    # Prefix reuse through the store (vLLM with a Mooncake Store connector): prefill reads
    # the leading blocks its own cache lacks from the store, at the latency model's KV
    # transfer cost (bytes per token / bandwidth), or this fixed cost per token if set.
    store_prefix_cache: bool = False
    store_load_per_token_s: float | None = None
    # vLLM's --data-parallel-size: the deployment's ranks 0..N-1, each a whole engine
    # (engine_sim.data_parallel). This process runs ranks S..S+L-1 (S: start rank, L: local
    # size, None: N); L < N is one node of a multi-node deployment, whose API server serves
    # its own ranks only (hybrid or external load balancing; cli.py checks the flags).
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    max_num_seqs: int = 256
    # Tokens a step computes at most: a longer prompt is prefilled in chunks (compute.py).
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_waiting: int = DEFAULT_MAX_WAITING
    max_model_len: int = 32_768
    default_max_tokens: int = 16
    latency: LatencyModel = field(default_factory=LatencyModel)
    recent_records: int = DEFAULT_RECENT_RECORDS
    keep_alive_timeout_s: float = 5.0  # vLLM (uvicorn) closes idle connections after 5 s
    port_file: str | None = None
    faults: FaultSpec = field(default_factory=FaultSpec)  # --fault-* flags, see faults.py
    # --tokenizer / --chat-template (engine_sim.prompts): the real DeepSeek tokenizer by
    # default, "stand-in" for the deterministic stand-in.
    tokenizer: str = DEFAULT_TOKENIZER
    chat_template: str | None = None

    @property
    def data_parallel_ranks(self) -> range:
        """The global ranks this process runs, in order (vLLM's `engine_ranks_managed`)."""
        local = self.data_parallel_size_local
        start = self.data_parallel_start_rank
        return range(start, start + (self.data_parallel_size if local is None else local))
