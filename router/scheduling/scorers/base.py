"""What a scorer is: a 0..1 score per candidate, a weight, and a scale in seconds.

A profile combines its scorers into one cost per candidate (lower is better):

    unit "score":  cost = sum_i w_i * (1 - s_i) / sum_i w_i            (0..1)
    unit "ttft":   cost = sum_i w_i * scale_i * (1 - s_i)               (seconds)

`scale_i` is what a score of 0 instead of 1 costs in predicted time to first token, for
this request and these candidates (each scorer's docstring gives it). With the natural
scales the ttft sum is the predicted-TTFT model: queue wait (load scorers) plus uncached
prompt tokens x per-token prefill cost (prefix scorers).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from router.scheduling.context import Candidates, PickContext, SchedulerDeps


class ConfigError(ValueError):
    """A scorer or filter was configured with a parameter it does not accept."""


@dataclass(frozen=True, slots=True)
class Param:
    kind: type[Any]
    default: Any
    minimum: float | None = None
    maximum: float | None = None


def check_params(
    owner: str, declared: Mapping[str, Param], given: Mapping[str, Any]
) -> dict[str, Any]:
    """Validate `given` against `declared`; return every parameter with defaults filled in."""
    out: dict[str, Any] = {}
    for name in given:
        if name not in declared:
            known = ", ".join(sorted(declared)) or "none"
            raise ConfigError(f"{owner}: unknown parameter {name!r} (known: {known})")
    for name, param in declared.items():
        value = given.get(name, param.default)
        if param.kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, param.kind) or (
            param.kind is not bool and isinstance(value, bool)
        ):
            raise ConfigError(f"{owner}: {name} must be a {param.kind.__name__}")
        if param.minimum is not None and value < param.minimum:
            raise ConfigError(f"{owner}: {name} must be >= {param.minimum}")
        if param.maximum is not None and value > param.maximum:
            raise ConfigError(f"{owner}: {name} must be <= {param.maximum}")
        out[name] = value
    return out


def fill_unknown(scores: list[float | None]) -> list[float]:
    """Replace unknown (None) scores by the mean of the known ones (1.0 if none is known)."""
    known = [s for s in scores if s is not None]
    if len(known) == len(scores):
        return known
    neutral = sum(known) / len(known) if known else 1.0
    return [neutral if s is None else s for s in scores]


class Scorer:
    """Base of every scorer. Subclasses set `type_name`, `PARAMS`, and override `score`."""

    type_name: ClassVar[str] = ""
    #: Affinity scorers (cache, session) are the ones the anti-herding rules may override.
    affinity: ClassVar[bool] = False
    PARAMS: ClassVar[Mapping[str, Param]] = {}

    def __init__(self, weight: float, deps: SchedulerDeps, params: Mapping[str, Any]) -> None:
        self.weight = weight
        self.deps = deps
        self.params = check_params(f"scorer {self.type_name}", self.PARAMS, params)

    def score(self, ctx: PickContext, cands: Candidates) -> list[float]:
        """A score in [0, 1] per candidate, in the candidates' order."""
        raise NotImplementedError

    def scale_s(self, ctx: PickContext, cands: Candidates) -> float:
        """Seconds of predicted TTFT between a score of 1 and a score of 0."""
        return ctx.cost.seconds_per_point

    def picked(self, ctx: PickContext, cands: Candidates, index: int) -> None:
        """Called with the chosen candidate (stateful scorers remember it)."""
