"""The two presets (`quick`, `full`): sizes, durations and the simulator's shape per phase.

Budgets on this 2-core machine: `quick` under 3 minutes, `full` under 20, start-up and
shutdown of every process included. Durations below are per run; the phases multiply
them by routers, rounds and levels (see `plan.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.workloads import (
    MultiRoundParams,
    OverheadParams,
    RandomParams,
    SharedPrefixParams,
)


@dataclass(frozen=True, slots=True)
class OverheadConfig:
    """Router cost on `--fast` engines: latency at low concurrency, max req/s at 64."""

    rounds: int  # A B A B ... rounds (order reversed every other round)
    latency_concurrency: int
    latency_requests: int
    latency_seconds: float  # a latency run stops at whichever bound comes first
    throughput_concurrency: int
    throughput_seconds: float
    warmup_requests: int
    idle_seconds: float  # routers' CPU with no traffic, measured after the warm-up
    agg_pods: int
    pd_groups: int
    params: OverheadParams
    #: Per round and router: requests one after another from a sequential client
    #: (`benchmarks.sequential`), for the added latency at concurrency 1.
    sequential_requests: int = 600


@dataclass(frozen=True, slots=True)
class SweepConfig:
    """Throughput against offered load: open-loop Poisson levels, as fractions of the
    fastest router's closed-loop maximum measured in the overhead phase."""

    fractions: tuple[float, ...]
    seconds: float
    modes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class OverloadConfig:
    """Past saturation: open-loop Poisson at multiples of pdgate's own closed-loop maximum,
    every router at the same rates, interleaved. The phase runs with the load generator on
    a core of its own (`benchmarks.pinning`) and first measures every router's maximum at
    the overhead phase's throughput concurrency under those pins, `max_rounds` interleaved
    rounds (pdgate's median is the reference). Goodput (successful requests per second) is
    reported as a share of that maximum, and CPU per success against the router's own at
    its maximum."""

    multiples: tuple[float, ...]
    seconds: float
    modes: tuple[str, ...]
    max_rounds: int = 2


@dataclass(frozen=True, slots=True)
class StreamingConfig:
    """Relaying long streams: closed loop at each concurrency on pods that stream
    `output_tokens` tokens `itl_ms` apart; every router beside the direct floor. One of
    the streams at each level is the probe client's (`benchmarks.probe`): streams of
    `probe_tokens` tokens, one at a time, from a process of its own."""

    concurrencies: tuple[int, ...]
    output_tokens: int
    itl_ms: float
    seconds: float
    agg_pods: int
    modes: tuple[str, ...]
    probe_tokens: int = 16

    @property
    def sim_flags(self) -> tuple[str, ...]:
        # ITL independent of the batch: the stream's pace is the pods', not the load's.
        return ("--itl-ms", f"{self.itl_ms:g}", "--itl-per-running-ms", "0")


@dataclass(frozen=True, slots=True)
class SchedulingConfig:
    """Prefix-cache-sensitive workloads on engines with the latency model on."""

    shared_prefix: SharedPrefixParams
    multi_round: MultiRoundParams
    random: RandomParams
    concurrency: int
    multi_round_concurrency: int
    workloads: tuple[str, ...]
    pd_groups: int
    agg_pods: int
    include_agg: bool
    time_limit: float
    sim_flags: tuple[str, ...]

    @property
    def prefill_ms_per_token(self) -> float:
        """The engines' prefill cost per token (the simulator's default unless flagged)."""
        flags = list(self.sim_flags)
        if "--prefill-per-token-ms" in flags:
            return float(flags[flags.index("--prefill-per-token-ms") + 1])
        return 0.1


@dataclass(frozen=True, slots=True)
class BenchConfig:
    name: str
    seed: int
    request_timeout: float
    overhead: OverheadConfig
    sweep: SweepConfig
    overload: OverloadConfig
    streaming: StreamingConfig
    scheduling: SchedulingConfig


# Engines with a small KV cache, so that where a prompt goes decides whether it hits:
# 768 blocks x 16 tokens = 12,288 tokens per pod: about 5 of the 10 shared-prefix groups, so
# spreading every group over every pod thrashes while partitioning them fits. Prefill at
# 0.4 ms a token (2,048 tokens: ~0.8 s uncached, ~25 ms cached) so that where the cache is
# shows above the CPU noise of a 2-core machine running the client, router and pods.
_SCHED_SIM_FLAGS = ("--kv-capacity-blocks", "768", "--prefill-per-token-ms", "0.4")


def quick(seed: int = 0) -> BenchConfig:
    return BenchConfig(
        name="quick",
        seed=seed,
        request_timeout=30.0,
        overhead=OverheadConfig(
            rounds=2,
            latency_concurrency=4,
            latency_requests=200,
            latency_seconds=1.5,
            throughput_concurrency=64,
            throughput_seconds=1.5,
            warmup_requests=30,
            idle_seconds=1.0,
            agg_pods=2,
            pd_groups=1,
            sequential_requests=150,
            params=OverheadParams(requests=8000),
        ),
        sweep=SweepConfig(fractions=(0.4, 0.8, 1.2), seconds=1.5, modes=("pd",)),
        overload=OverloadConfig(multiples=(1.5, 3.0), seconds=2.0, modes=("agg",)),
        streaming=StreamingConfig(concurrencies=(64, 256), output_tokens=256, itl_ms=5.0,
                                  seconds=3.0, agg_pods=2, modes=("agg",)),
        scheduling=SchedulingConfig(
            shared_prefix=SharedPrefixParams(
                groups=10, questions=5, system_tokens=2048, question_tokens=48, output_tokens=8
            ),
            multi_round=MultiRoundParams(
                users=8, rounds=3, system_tokens=1024, question_tokens=48, answer_tokens=8
            ),
            random=RandomParams(requests=40, prompt_tokens=1024, output_tokens=8),
            concurrency=4,
            multi_round_concurrency=4,
            workloads=("shared-prefix", "multi-round"),
            pd_groups=2,
            agg_pods=2,
            include_agg=False,
            time_limit=15.0,
            sim_flags=_SCHED_SIM_FLAGS,
        ),
    )


def full(seed: int = 0) -> BenchConfig:
    return BenchConfig(
        name="full",
        seed=seed,
        request_timeout=60.0,
        overhead=OverheadConfig(
            rounds=4,
            latency_concurrency=4,
            latency_requests=1000,
            latency_seconds=3.0,
            throughput_concurrency=64,
            throughput_seconds=5.0,
            warmup_requests=100,
            idle_seconds=5.0,
            agg_pods=2,
            pd_groups=1,
            params=OverheadParams(requests=30000),
        ),
        sweep=SweepConfig(
            fractions=(0.25, 0.5, 0.75, 1.0, 1.25), seconds=3.0, modes=("agg", "pd")
        ),
        overload=OverloadConfig(multiples=(1.5, 3.0), seconds=4.0, modes=("agg", "pd")),
        streaming=StreamingConfig(concurrencies=(64, 256), output_tokens=256, itl_ms=5.0,
                                  seconds=8.0, agg_pods=2, modes=("agg",)),
        scheduling=SchedulingConfig(
            shared_prefix=SharedPrefixParams(
                groups=10, questions=16, system_tokens=2048, question_tokens=48, output_tokens=16
            ),
            multi_round=MultiRoundParams(
                users=16, rounds=6, system_tokens=1024, question_tokens=48, answer_tokens=16
            ),
            random=RandomParams(requests=64, prompt_tokens=1024, output_tokens=16),
            concurrency=4,
            multi_round_concurrency=4,
            workloads=("shared-prefix", "multi-round", "random"),
            pd_groups=2,
            agg_pods=2,
            include_agg=True,
            time_limit=60.0,
            sim_flags=_SCHED_SIM_FLAGS,
        ),
    )
