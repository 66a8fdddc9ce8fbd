"""Who is measured: pdgate's scheduling policies and the peers' configurations.

pdgate's policies are scheduler configs (`pdgate serve --scheduler-config`, schema in
`router/scheduling/config.py`, defaults in `config/scheduler.yaml`). The names are the
report's labels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from benchmarks.cluster import Mode
from benchmarks.phases import Lineup
from benchmarks.routers import RouterSpec

_HEADER: Final = "apiVersion: pdgate.io/v1alpha1\nkind: SchedulerConfig\n"
_FILTERS: Final = "    filters: [ready, not-ejected, not-saturated]\n"


def _profile(role: str, scorers: Sequence[str], unit: str = "ttft") -> str:
    lines = "".join(f"    - {{{scorer}}}\n" for scorer in scorers)
    return f"  {role}:\n    unit: {unit}\n{_FILTERS}    scorers:\n{lines}"


_LEAST_REQUEST: Final = "profiles:\n" + "".join(
    _profile(role, ["type: least-request, weight: 1.0"], unit="score")
    for role in ("prefill", "decode", "aggregated")
)
_AFFINITY: Final = ["type: session-affinity, weight: 1.0", "type: prefix-cache, weight: 1.0",
                    "type: least-request, weight: 1.0", "type: queue, weight: 0.5"]
_SESSION: Final = (
    "profiles:\n"
    + _profile("prefill", _AFFINITY)
    + _profile("aggregated", [*_AFFINITY, "type: kv-cache-usage, weight: 1.0"])
)

#: name -> the `profiles` section of its scheduler config ("" = pdgate's default profiles:
#: prefix-cache + prefill-backlog + queue + cache-pressure for prefill, load and KV headroom
#: for decode).
PDGATE_POLICIES: Final[dict[str, str]] = {
    "prefix-cache": "",
    "least-request": _LEAST_REQUEST,
    "session+prefix": _SESSION,
}
#: The policy the overhead phase runs (its cost is what a default install pays).
OVERHEAD_POLICY: Final = "prefix-cache"
#: `--quick` measures these only (the full run measures every policy).
QUICK_POLICIES: Final = ("prefix-cache", "least-request")


def scheduler_yaml(policy: str, prefill_ms_per_token: float) -> str:
    """The whole config: the policy's profiles plus a cost model calibrated to the engines
    (pdgate's default assumes 0.1 ms a prefill token; the benchmark's engines may differ)."""
    cost = f"costModel:\n  prefillSecondsPerToken: {prefill_ms_per_token / 1e3:.6g}\n"
    return _HEADER + PDGATE_POLICIES[policy] + cost


def pdgate_specs(names: Sequence[str], prefill_ms_per_token: float) -> list[RouterSpec]:
    unknown = [n for n in names if n not in PDGATE_POLICIES]
    if unknown:
        raise ValueError(f"unknown pdgate policies {unknown}; known: {list(PDGATE_POLICIES)}")
    return [RouterSpec("pdgate", name, scheduler_yaml(name, prefill_ms_per_token))
            for name in names]


def lineup(
    modes: Sequence[Mode],
    policies: Sequence[str],
    include_agg_scheduling: bool,
    prefill_ms_per_token: float,
) -> Lineup:
    """`prefill_ms_per_token`: the scheduling engines' prefill cost, for pdgate's cost model."""
    pdgate = pdgate_specs(policies, prefill_ms_per_token)
    default = pdgate_specs([OVERHEAD_POLICY], prefill_ms_per_token)[0]
    direct = RouterSpec("direct")
    overhead: dict[Mode, tuple[RouterSpec, ...]] = {
        "agg": (direct, default, RouterSpec("vllm-router", "round_robin"),
                RouterSpec("sglang-router", "round_robin")),
        "pd": (direct, default, RouterSpec("vllm-router", "round_robin")),
    }  # fmt: skip
    scheduling: dict[Mode, tuple[RouterSpec, ...]] = {
        "pd": (*pdgate, RouterSpec("vllm-router", "round_robin"),
               RouterSpec("vllm-router", "cache_aware")),
    }  # fmt: skip
    if include_agg_scheduling:
        scheduling["agg"] = (*pdgate, RouterSpec("sglang-router", "round_robin"),
                             RouterSpec("sglang-router", "cache_aware"))  # fmt: skip
    return Lineup(
        overhead={m: overhead[m] for m in modes if m in overhead},
        scheduling={m: scheduling[m] for m in modes if m in scheduling},
    )
