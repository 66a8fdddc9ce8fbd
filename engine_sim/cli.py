"""`python -m engine_sim`: parse flags, run one simulated engine, stop cleanly on SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import uuid
from collections.abc import Callable, Sequence
from typing import cast

from engine_sim.block_hash import DEFAULT_BLOCK_SIZE, DEFAULT_HASH_ALGO
from engine_sim.bootstrap import (
    DEFAULT_BOOTSTRAP_PORT,
    DEFAULT_KV_WAIT_TIMEOUT_S,
    BootstrapError,
    BootstrapFault,
)
from engine_sim.compute import DEFAULT_MAX_NUM_BATCHED_TOKENS
from engine_sim.config import Role, SimConfig
from engine_sim.data_parallel import check_layout
from engine_sim.faults import FaultSpec, check_spec
from engine_sim.kv_blocks import DEFAULT_KV_BLOCK_BYTES
from engine_sim.kv_events_pub import DEFAULT_EVENTS_PORT, DEFAULT_REPLAY_PORT, KVEventsError
from engine_sim.kvstore import (
    DEFAULT_GLOBAL_SEGMENT_BYTES,
    DEFAULT_LOCAL_BUFFER_BYTES,
    KVStoreError,
)
from engine_sim.latency import (
    DEFAULT_KV_BANDWIDTH_BYTES_PER_S,
    MLA_KV_BYTES_PER_TOKEN,
    LatencyModel,
)
from engine_sim.prefix_cache import DEFAULT_CAPACITY_BLOCKS
from engine_sim.prompts import DEFAULT_TOKENIZER, STAND_IN
from engine_sim.scheduler import DEFAULT_MAX_WAITING
from engine_sim.service import serve
from engine_sim.stats import DEFAULT_RECENT_RECORDS
from router.kvhash.vllm import HASH_ALGOS
from router.tokenization import TokenizerLoadError, TokenizerNotFound

_WILDCARD_HOSTS = ("", "0.0.0.0", "::")
_MIB = 1 << 20


class _DefaultsFormatter(argparse.HelpFormatter):
    """Show defaults that exist (argparse's own formatter also prints 'default: None')."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text:
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    defaults = LatencyModel()
    parser = argparse.ArgumentParser(
        prog="python -m engine_sim",
        description="A vLLM look-alike engine that moves KV through a real Mooncake Store.",
        formatter_class=_DefaultsFormatter,
    )
    add = parser.add_argument
    add("--role", choices=("prefill", "decode", "both"), required=True, help="PD role")
    add("--port", type=int, required=True, help="HTTP port (0: any free port, see --port-file)")
    add("--host", default="127.0.0.1", help="address to listen on")
    add("--advertise-host", help="host put in KV handles (default: --host, or $POD_IP)")
    add("--model", required=True, help="served model name")
    add("--mooncake-master", help="Mooncake master RPC address HOST:PORT")
    add("--metadata-server", help="Mooncake metadata URL, e.g. http://127.0.0.1:8080/metadata")
    add("--engine-id", help="engine id in KV handles (default: a random uuid)")
    add("--pod-name", help="pod name in /sim/stats (default: $POD_NAME or the hostname)")
    add("--fast", action="store_true", help="zero every simulated latency")
    add(
        "--tokenizer",
        default=DEFAULT_TOKENIZER,
        help="tokenizer: a directory, python:<package>, a Hugging Face repo id in the local "
        f"cache, or {STAND_IN!r} for the deterministic stand-in",
    )
    add("--chat-template", help="Jinja chat template file (default: the tokenizer's; for the "
        "default tokenizer, engine_sim/templates/deepseek_v3.jinja)")
    add(
        "--prefill-overhead-ms",
        type=float,
        default=defaults.prefill_overhead_s * 1e3,
        help="fixed prefill cost",
    )
    add(
        "--prefill-per-token-ms",
        type=float,
        default=defaults.prefill_per_token_s * 1e3,
        help="prefill cost per prompt token not found in the prefix cache or the KV store",
    )
    add("--itl-ms", type=float, default=defaults.itl_base_s * 1e3, help="base inter-token latency")
    add(
        "--itl-per-running-ms",
        type=float,
        default=defaults.itl_per_running_s * 1e3,
        help="inter-token latency added per running request",
    )
    add("--max-num-seqs", type=int, default=256, help="requests running at once")
    add(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine cores of the deployment, ranks 0..N-1, each with its own cache, "
        "scheduler, KV events ports (+rank) and engine id (_dp<rank>); X-data-parallel-rank "
        "pins a request, else the least loaded rank serves it (vLLM's flag)",
    )
    add(
        "--data-parallel-size-local",
        "-dpl",
        type=int,
        help="ranks this process runs, a node of a multi-node deployment (default: "
        "--data-parallel-size); fewer needs --data-parallel-hybrid-lb (vLLM's flag)",
    )
    add(
        "--data-parallel-start-rank",
        "-dpr",
        type=int,
        help="global rank of this node's first engine (default 0; a nonzero one implies "
        "--data-parallel-hybrid-lb, as in vLLM)",
    )
    add(
        "--data-parallel-hybrid-lb",
        "-dph",
        action="store_true",
        help="this server serves its local ranks only: X-data-parallel-rank i pins global "
        "rank start + i (vLLM's flag)",
    )
    add(
        "--data-parallel-rank",
        "-dpn",
        type=int,
        help="run the one engine of global rank R behind its own server (vLLM's external "
        "load balancing: local size 1, start rank R)",
    )
    add(
        "--max-num-batched-tokens",
        type=int,
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        help="tokens a step computes at most: longer prompts prefill in chunks, each "
        "chunk's KV events sent as it ends (vLLM's flag)",
    )
    add("--max-waiting", type=int, default=DEFAULT_MAX_WAITING, help="waiting-queue bound (503)")
    add("--kv-capacity-blocks", type=int, default=DEFAULT_CAPACITY_BLOCKS, help="KV cache size")
    add("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    add(
        "--kv-block-bytes",
        type=int,
        default=DEFAULT_KV_BLOCK_BYTES,
        help="bytes of one simulated KV block in the store",
    )
    add(
        "--prefix-caching-hash-algo",
        choices=HASH_ALGOS,
        default=DEFAULT_HASH_ALGO,
        help="block hash algorithm, as vLLM's flag",
    )
    add(
        "--python-hash-seed",
        default=os.environ.get("PYTHONHASHSEED"),
        help="root of block hashes, as vLLM's PYTHONHASHSEED (default: that variable; "
        "unset: random per process)",
    )
    add(
        "--block-ids-per-group",
        action="store_true",
        help="emit remote_block_ids as one list per KV group ([[...]]), as newer vLLM does",
    )
    add("--max-model-len", type=int, default=32_768, help="prompt + output token limit")
    add("--default-max-tokens", type=int, default=16, help="output length without max_tokens")
    add(
        "--global-segment-mib",
        type=int,
        default=DEFAULT_GLOBAL_SEGMENT_BYTES // _MIB,
        help="memory this pod contributes to the Mooncake Store",
    )
    add(
        "--local-buffer-mib",
        type=int,
        default=DEFAULT_LOCAL_BUFFER_BYTES // _MIB,
        help="Mooncake client transfer buffer",
    )
    add("--recent-records", type=int, default=DEFAULT_RECENT_RECORDS, help="/sim/stats ring size")
    add("--keep-alive-timeout", type=float, default=5.0, help="idle keep-alive seconds")
    add("--port-file", help="write the bound port to this file once serving")
    add(
        "--bootstrap-port",
        type=int,
        help="prefill pods: port of upstream vLLM MooncakeConnector's bootstrap server "
        f"(GET /query), on --host; 0: any free port (default: {DEFAULT_BOOTSTRAP_PORT}, "
        "skipped with a warning if taken)",
    )
    add(
        "--bootstrap-fault",
        choices=[fault.value for fault in BootstrapFault],
        default=BootstrapFault.NONE.value,
        help="make the bootstrap server misbehave (down, error, garbage, empty, malformed)",
    )
    add(
        "--kv-wait-timeout",
        type=float,
        default=DEFAULT_KV_WAIT_TIMEOUT_S,
        help="decode: seconds to wait for KV of a transfer_id (upstream vLLM Mooncake flow)",
    )
    add(
        "--kv-events-port",
        type=int,
        help="vLLM KV events ZMQ PUB port, bound on --host; 0: off "
        f"(default: {DEFAULT_EVENTS_PORT}, skipped with a warning if taken)",
    )
    add(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters served besides --model, as vLLM's flag (a request naming one "
        "gets its own prefix-cache blocks; no weights are read)",
    )
    add(
        "--kv-events-layout",
        choices=("map", "array"),
        default="map",
        help="KV event batches as maps (vLLM since vllm#42892; default) or positional "
        "arrays (the releases before)",
    )
    add(
        "--kv-events-replay-port",
        type=int,
        help="KV events replay (ZMQ ROUTER) port; 0: no replay "
        f"(default: {DEFAULT_REPLAY_PORT}, skipped with a warning if taken; with "
        "--data-parallel-size > 1 off unless given)",
    )
    add(
        "--store-prefix-cache",
        action="store_true",
        help="read prompt blocks the prefix cache lacks from the Mooncake Store when it holds "
        "them (an external prefix cache, as vLLM with a store connector)",
    )
    add(
        "--store-load-per-token-ms",
        type=float,
        help="fixed cost of a prompt token read from the store by --store-prefix-cache "
        "(default: --kv-bytes-per-token / --kv-gbytes-per-s)",
    )
    add(
        "--kv-bytes-per-token",
        type=int,
        default=MLA_KV_BYTES_PER_TOKEN,
        help="KV bytes of one token, for the time KV takes to move (store loads, PD "
        f"transfers); model-dependent, default {MLA_KV_BYTES_PER_TOKEN}: DeepSeek-V3 / "
        "Kimi K2 MLA in bf16 (see engine_sim/latency.py)",
    )
    add(
        "--kv-gbytes-per-s",
        type=float,
        default=DEFAULT_KV_BANDWIDTH_BYTES_PER_S / 1e9,
        help="bandwidth KV moves at, GB/s (default 12.5: one 100 Gb/s RDMA NIC)",
    )
    add("--log-level", default="info", help="Python logging level")
    _add_fault_flags(parser)
    return parser


def _add_fault_flags(parser: argparse.ArgumentParser) -> None:
    """`--fault-*`: faults to inject from the start (also settable at runtime: /sim/faults)."""
    group = parser.add_argument_group("fault injection (see engine_sim/faults.py)")
    add = group.add_argument
    add("--fault-error-rate", type=float, default=0.0, help="share of requests answered 5xx")
    add("--fault-error-status", type=int, default=500, help="status of an injected error")
    add("--fault-hang-rate", type=float, default=0.0, help="share of requests never answered")
    add("--fault-hang-seconds", type=float, default=3600.0, help="how long a hang lasts")
    add("--fault-slow-start-ms", type=float, default=0.0, help="delay before every request")
    add("--fault-drop-rate", type=float, default=0.0, help="share of connections dropped")
    add("--fault-drop-after", type=int, default=2, help="stream chunks sent before a drop")
    add(
        "--fault-no-kv-params-rate",
        type=float,
        default=0.0,
        help="share of prefill answers sent without kv_transfer_params",
    )
    add(
        "--fault-kv-missing-rate",
        type=float,
        default=0.0,
        help="share of decode requests that cannot find their KV in the store",
    )
    add("--fault-crash-on-request", type=int, default=0, help="exit on this request number")
    add("--fault-match", default="", help="only fault requests whose body contains this text")
    add("--fault-seed", type=int, default=0, help="seed of the fault draws")


def _fault_spec(args: argparse.Namespace) -> FaultSpec:
    spec = FaultSpec(
        error_rate=args.fault_error_rate,
        error_status=args.fault_error_status,
        hang_rate=args.fault_hang_rate,
        hang_s=args.fault_hang_seconds,
        slow_start_ms=args.fault_slow_start_ms,
        drop_rate=args.fault_drop_rate,
        drop_after_chunks=args.fault_drop_after,
        no_kv_params_rate=args.fault_no_kv_params_rate,
        kv_missing_rate=args.fault_kv_missing_rate,
        crash_on_request=args.fault_crash_on_request,
        match=args.fault_match,
        seed=args.fault_seed,
    )
    check_spec(spec)
    return spec


def _lora_module(spec: str) -> tuple[str, str]:
    """`NAME=PATH` (vLLM's short form) as (name, path)."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules takes NAME=PATH, not {spec!r}")
    return name, path


def parse_config(argv: Sequence[str] | None = None) -> SimConfig:
    """Flags to a `SimConfig` (exits with usage on bad flags)."""
    return _parse(argv)[0]


def _data_parallel_layout(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Resolve which global ranks this process runs into `args.data_parallel_size_local`
    (L) and `args.data_parallel_start_rank` (S), refusing what vLLM refuses or the
    simulator cannot play.

    As vLLM's `EngineArgs.create_engine_config`: `--data-parallel-rank R` is external load
    balancing, one engine of rank R (a local size other than 1 is refused); a nonzero start
    rank on a node with an API server implies hybrid load balancing; a node running every
    rank is internal load balancing whatever the flags. Hybrid and external both make the
    server serve its local engines only. Beyond vLLM: the rank with the hybrid flag is
    refused (vLLM ignores the flag), and so is a node running part of the ranks without
    either (S = 0, L < N): with vLLM's internal balancing across nodes only the head node
    has an API server and the others run `--headless`, which the simulator does not."""
    size = args.data_parallel_size
    if args.data_parallel_rank is not None:
        rank = args.data_parallel_rank
        if args.data_parallel_hybrid_lb:
            parser.error("--data-parallel-rank (external load balancing) and "
                         "--data-parallel-hybrid-lb exclude each other")
        if args.data_parallel_size_local not in (None, 1):
            parser.error("--data-parallel-rank runs one engine: --data-parallel-size-local "
                         "must be 1")
        if args.data_parallel_start_rank not in (None, rank):
            parser.error(f"--data-parallel-start-rank {args.data_parallel_start_rank} "
                         f"contradicts --data-parallel-rank {rank}")
        if not 0 <= rank < size:
            parser.error(f"--data-parallel-rank {rank} is out of range [0, {size})")
        local, start, local_only = 1, rank, True
    else:
        if args.data_parallel_hybrid_lb and args.data_parallel_size_local is None:
            parser.error("--data-parallel-hybrid-lb needs --data-parallel-size-local")
        local = size if args.data_parallel_size_local is None else args.data_parallel_size_local
        start = args.data_parallel_start_rank or 0
        local_only = args.data_parallel_hybrid_lb or start > 0
    try:
        check_layout(size, local, start)
    except ValueError as exc:
        parser.error(str(exc))
    if local < size and not local_only:
        parser.error(
            f"--data-parallel-size-local {local} < --data-parallel-size {size} runs part of "
            "the ranks: give --data-parallel-hybrid-lb (this server serves its own ranks) or "
            "--data-parallel-rank R; the simulator has no headless nodes, which vLLM's "
            "internal load balancing across nodes needs"
        )
    args.data_parallel_size_local, args.data_parallel_start_rank = local, start


def _rank_ports(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Global rank r binds the events and replay ports + r: the two runs of this process's
    ranks S..S+L-1 must not overlap. The offset S moves both runs alike, so they overlap
    when the two bases are fewer than L apart.

    With the default ports they would for L > 1 (5557 + 1 is 5558), so with more than one
    local rank replay is off unless a port is given, as in vLLM, whose replay socket is off
    by default; a given replay port inside the events ports' run is refused. One local
    rank (no data parallelism, `--data-parallel-rank R`, or L = 1) binds one port of each
    run, events + S and replay + S, which differ whenever the bases do: the single
    engine's default replay port (5558, + S) stays on."""
    local = args.data_parallel_size_local
    events = DEFAULT_EVENTS_PORT if args.kv_events_port is None else args.kv_events_port
    if local == 1 or not events:
        return
    if args.kv_events_replay_port is None:
        args.kv_events_replay_port = 0
    replay = args.kv_events_replay_port
    start = args.data_parallel_start_rank
    if replay and abs(replay - events) < local:
        bound = f" (both + start rank {start})" if start else ""
        parser.error(f"--kv-events-replay-port {replay} is inside the events ports "
                     f"{events}..{events + local - 1} of {local} ranks{bound}")


def _env_int(parser: argparse.ArgumentParser, name: str, default: int) -> int:
    """An integer from the environment, as vLLM's envs read it (`int()`, else refused)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        parser.error(f"{name}={raw!r} is not an integer")


def _parse(argv: Sequence[str] | None) -> tuple[SimConfig, argparse.Namespace]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.mooncake_master is None) != (args.metadata_server is None):
        parser.error("--mooncake-master and --metadata-server go together")
    if args.role != "both" and args.mooncake_master is None:
        parser.error(f"--role {args.role} needs --mooncake-master and --metadata-server")
    for name in ("max_num_seqs", "data_parallel_size", "max_num_batched_tokens",
                 "kv_capacity_blocks", "block_size", "kv_block_bytes"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.bootstrap_port is not None and not 0 <= args.bootstrap_port < 65536:
        parser.error("--bootstrap-port must be a TCP port (0: any free port)")
    if args.kv_bytes_per_token < 0 or args.kv_gbytes_per_s <= 0:
        parser.error("--kv-bytes-per-token must be >= 0 and --kv-gbytes-per-s positive")
    for spec in args.lora_modules:
        try:
            _lora_module(spec)
        except argparse.ArgumentTypeError as exc:
            parser.error(str(exc))
    if args.kv_wait_timeout <= 0:
        parser.error("--kv-wait-timeout must be positive")
    for name in ("kv_events_port", "kv_events_replay_port"):
        value = getattr(args, name)
        if value is not None and not 0 <= value < 65536:
            parser.error(f"--{name.replace('_', '-')} must be a TCP port (0: off)")
    _data_parallel_layout(parser, args)
    _rank_ports(parser, args)
    try:
        faults = _fault_spec(args)
    except ValueError as exc:
        parser.error(f"fault flags: {exc}")
    latency = (
        LatencyModel.fast()
        if args.fast
        else LatencyModel(
            prefill_overhead_s=args.prefill_overhead_ms / 1e3,
            prefill_per_token_s=args.prefill_per_token_ms / 1e3,
            itl_base_s=args.itl_ms / 1e3,
            itl_per_running_s=args.itl_per_running_ms / 1e3,
            kv_bytes_per_token=args.kv_bytes_per_token,
            kv_bandwidth_bytes_per_s=args.kv_gbytes_per_s * 1e9,
        )
    )
    advertise = args.advertise_host or (
        os.environ.get("POD_IP", "127.0.0.1") if args.host in _WILDCARD_HOSTS else args.host
    )
    config = SimConfig(
        role=cast(Role, args.role),
        model=args.model,
        port=args.port,
        host=args.host,
        advertise_host=advertise,
        engine_id=args.engine_id or str(uuid.uuid4()),
        pod_name=args.pod_name or os.environ.get("POD_NAME") or socket.gethostname(),
        mooncake_master=args.mooncake_master,
        metadata_server=args.metadata_server,
        global_segment_bytes=args.global_segment_mib * _MIB,
        local_buffer_bytes=args.local_buffer_mib * _MIB,
        block_size=args.block_size,
        kv_capacity_blocks=args.kv_capacity_blocks,
        kv_block_bytes=args.kv_block_bytes,
        hash_algo=args.prefix_caching_hash_algo,
        python_hash_seed=args.python_hash_seed,
        block_ids_per_group=args.block_ids_per_group,
        nixl_side_channel_host=os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost"),
        # vLLM reads it where a NixlConnector is built; here, where a handle is made.
        nixl_side_channel_port=(
            _env_int(parser, "VLLM_NIXL_SIDE_CHANNEL_PORT", 5600) if args.role == "prefill"
            else 5600
        ),
        max_num_seqs=args.max_num_seqs,
        data_parallel_size=args.data_parallel_size,
        data_parallel_size_local=args.data_parallel_size_local,
        data_parallel_start_rank=args.data_parallel_start_rank,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_waiting=args.max_waiting,
        max_model_len=args.max_model_len,
        default_max_tokens=args.default_max_tokens,
        latency=latency,
        recent_records=args.recent_records,
        keep_alive_timeout_s=args.keep_alive_timeout,
        port_file=args.port_file,
        bootstrap_port=args.bootstrap_port,
        bootstrap_fault=args.bootstrap_fault,
        kv_wait_timeout_s=args.kv_wait_timeout,
        kv_events_port=args.kv_events_port,
        kv_events_replay_port=args.kv_events_replay_port,
        kv_events_layout=args.kv_events_layout,
        lora_modules=tuple(_lora_module(spec) for spec in args.lora_modules),
        store_prefix_cache=args.store_prefix_cache,
        store_load_per_token_s=(
            0.0 if args.fast
            else None if args.store_load_per_token_ms is None
            else args.store_load_per_token_ms / 1e3
        ),
        faults=faults,
        tokenizer=args.tokenizer,
        chat_template=args.chat_template,
    )
    return config, args


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return cast(Callable[[], asyncio.AbstractEventLoop], uvloop.new_event_loop)


async def _run(config: SimConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await serve(config, stop)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one engine; 0 after a clean stop, 1 when the KV store cannot be reached or the
    tokenizer cannot be loaded."""
    config, args = _parse(argv)
    logging.basicConfig(
        level=str(args.log_level).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(_run(config))
    except (
        KVStoreError, BootstrapError, KVEventsError, TokenizerNotFound, TokenizerLoadError
    ) as exc:
        print(f"engine_sim: {exc}", file=sys.stderr)
        return 1
    return 0
