"""Fault injection: the ways a real engine fails, on demand, so router tests can target them.

Every fault is decided when a generate request arrives, by a seeded random generator drawn
in a fixed order, so a run with the same seed and the same request order injects the same
faults. `match` narrows faults to requests whose raw body contains a marker (a test can
fault exactly the requests it chooses), and `/sim/faults` changes the spec at runtime so
one pod can turn faulty mid-test.

Kinds (counted in `injected` when they fire):

- `error`: answer `error_status` (5xx) with a body full of internals (a traceback and an
  address) that a gateway must not pass on;
- `hang`: never answer (sleep `hang_s`, or until the client goes away);
- `slow_start`: wait `slow_start_ms` before doing anything;
- `drop`: drop the connection after `drop_after_chunks` stream chunks (before any byte of
  a non-streaming answer);
- `no_kv_params`: a prefill answers without `kv_transfer_params`;
- `kv_missing`: a decode cannot find the KV its handle names (503, as a real miss);
- `crash`: the process exits on the `crash_on_request`-th request.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Final

FAULT_KINDS: Final = (
    "error", "hang", "slow_start", "drop", "no_kv_params", "kv_missing", "crash",
)
#: Exit status of a simulated crash (the shell's "killed by SIGKILL" code, recognisable).
CRASH_EXIT_STATUS: Final = 137
#: What an injected 5xx carries: the kind of body a gateway must never forward.
LEAKY_ERROR_MESSAGE: Final = (
    "Traceback (most recent call last):\n  File \"/opt/engine/worker.py\", line 42, in "
    "step\nRuntimeError: CUDA error on worker 10.12.0.7:29500 (engine_sim fault injection)"
)
_RATES: Final = ("error_rate", "hang_rate", "drop_rate", "no_kv_params_rate", "kv_missing_rate")


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """Which faults a pod injects. Rates are probabilities per request (0 = never)."""

    error_rate: float = 0.0
    error_status: int = 500
    hang_rate: float = 0.0
    hang_s: float = 3600.0
    slow_start_ms: float = 0.0
    drop_rate: float = 0.0
    drop_after_chunks: int = 2
    no_kv_params_rate: float = 0.0
    kv_missing_rate: float = 0.0
    crash_on_request: int = 0  # 1-based request number; 0 = never
    match: str = ""  # only requests whose raw body contains this text ("" = every request)
    seed: int = 0

    @property
    def armed(self) -> bool:
        """Whether any fault can fire (the per-request check is skipped otherwise)."""
        return (
            any(getattr(self, name) > 0 for name in _RATES)
            or self.slow_start_ms > 0
            or self.crash_on_request > 0
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def spec_from_json(data: object, base: FaultSpec | None = None) -> FaultSpec:
    """`base` with the fields of `data` (a JSON object) applied. Raises ValueError if bad."""
    if not isinstance(data, dict):
        raise ValueError("the fault spec must be a JSON object")
    known = {f.name: f for f in fields(FaultSpec)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"unknown fault fields: {', '.join(unknown)}")
    changes: dict[str, Any] = {}
    for name, value in data.items():
        kind = type(getattr(FaultSpec(), name))
        if kind is str:
            if not isinstance(value, str):
                raise ValueError(f"{name} must be a string")
        elif isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name} must be a number")
        elif kind is int:
            if value != int(value):
                raise ValueError(f"{name} must be an integer")
            value = int(value)
        changes[name] = value
    spec = replace(base or FaultSpec(), **changes)
    check_spec(spec)
    return spec


def check_spec(spec: FaultSpec) -> None:
    """Raise ValueError when a field is out of range."""
    for name in _RATES:
        if not 0.0 <= getattr(spec, name) <= 1.0:
            raise ValueError(f"{name} must be between 0 and 1")
    if not 500 <= spec.error_status <= 599:
        raise ValueError("error_status must be a 5xx status")
    if spec.hang_s < 0 or spec.slow_start_ms < 0:
        raise ValueError("hang_s and slow_start_ms must not be negative")
    if spec.drop_after_chunks < 0 or spec.crash_on_request < 0:
        raise ValueError("drop_after_chunks and crash_on_request must not be negative")


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """The faults one request will see (decided on arrival)."""

    crash: bool = False
    slow_start_s: float = 0.0
    hang_s: float | None = None
    error_status: int | None = None
    drop_after_chunks: int | None = None
    no_kv_params: bool = False
    kv_missing: bool = False


class Faults:
    """The pod's current spec, its random generator, and counts of what fired."""

    def __init__(self, spec: FaultSpec | None = None) -> None:
        self.spec = FaultSpec()
        self._rng = random.Random(0)
        self.requests = 0
        self.injected: dict[str, int] = dict.fromkeys(FAULT_KINDS, 0)
        self.set(spec or FaultSpec())

    def set(self, spec: FaultSpec) -> None:
        """Switch to `spec`; the generator restarts from its seed and requests count anew."""
        check_spec(spec)
        self.spec = spec
        self._rng = random.Random(spec.seed)
        self.requests = 0

    @property
    def armed(self) -> bool:
        return self.spec.armed

    def plan(self, raw_body: bytes) -> FaultPlan | None:
        """The faults for one request, or None when none applies to it."""
        spec = self.spec
        if spec.match and spec.match.encode() not in raw_body:
            return None
        self.requests += 1
        draw = self._rng.random
        # Always draw every rate, in this order: the sequence depends on the seed only.
        error, hang, drop, no_kv, missing = (draw() for _ in range(5))
        plan = FaultPlan(
            crash=spec.crash_on_request == self.requests,
            slow_start_s=spec.slow_start_ms / 1e3,
            hang_s=spec.hang_s if hang < spec.hang_rate else None,
            error_status=spec.error_status if error < spec.error_rate else None,
            drop_after_chunks=spec.drop_after_chunks if drop < spec.drop_rate else None,
            no_kv_params=no_kv < spec.no_kv_params_rate,
            kv_missing=missing < spec.kv_missing_rate,
        )
        return None if plan == _NO_FAULT else plan

    def count(self, kind: str) -> None:
        self.injected[kind] += 1

    def to_json(self) -> dict[str, Any]:
        return {
            "spec": self.spec.to_json(),
            "requests": self.requests,
            "injected": dict(self.injected),
        }


_NO_FAULT: Final = FaultPlan()
