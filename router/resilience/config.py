"""The knobs of the reliability layer, filled from `pdgate serve` flags.

Defaults suit a cluster: a pod is ejected after five failures in a row and probed back
after 5 s (doubling while it keeps failing, up to 2 minutes); every pod's `/health` is
checked every 5 s; admission bounds requests in flight to 256 per serving pod (vLLM's
default `max_num_seqs`) and below that to what the router's event loop keeps up with
(a 50 ms lag target, never below 256); retries in flight
may reach 20 % of the requests in flight, and at least 3 (Envoy's retry budget); a SIGTERM
drains for up to 30 s.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ResilienceConfig:
    # Passive outlier ejection (0 consecutive failures turns it off).
    consecutive_failures: int = 5
    base_ejection_s: float = 5.0
    max_ejection_s: float = 120.0
    #: How often ejected pods whose backoff ran out are probed for readmission.
    probe_tick_s: float = 0.25
    # Active health checks (interval 0 turns them off).
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0
    health_path: str = "/health"
    #: Failed checks in a row that eject a pod.
    unhealthy_threshold: int = 2
    # Admission control (0 = unbounded).
    #: Requests in flight router-wide; None sizes it from the pods (`inflight_per_pod`
    #: x the aggregated and decode pods), 0 turns the global bound off.
    max_inflight: int | None = None
    #: What one engine runs at once: vLLM's default `max_num_seqs` (256).
    inflight_per_pod: int = 256
    #: The adaptive limit's target for the event loop's lag, seconds (0: no adaptive limit).
    loop_lag_target_s: float = 0.05
    #: The adaptive limit never goes below this many requests in flight.
    min_inflight: int = 256
    max_inflight_per_model: int = 0
    max_queue: int = 0
    queue_timeout_s: float = 5.0
    # The router-wide retry budget (see retry_budget.py).
    retry_budget_percent: float = 20.0
    retry_min_concurrency: int = 3
    # Graceful drain on SIGTERM.
    drain_grace_s: float = 30.0
    #: Time `/readyz` stays false before the wait for requests starts (lets load
    #: balancers notice); requests still arriving meanwhile are refused.
    drain_delay_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("consecutive_failures", "unhealthy_threshold", "max_inflight_per_model",
                     "max_queue", "retry_min_concurrency"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        if self.max_inflight is not None and self.max_inflight < 0:
            raise ValueError("max_inflight must not be negative")
        if self.inflight_per_pod < 1 or self.min_inflight < 1:
            raise ValueError("inflight_per_pod and min_inflight must be positive")
        for name in ("base_ejection_s", "max_ejection_s", "health_interval_s",
                     "health_timeout_s", "queue_timeout_s", "drain_grace_s", "drain_delay_s",
                     "loop_lag_target_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        if not 0 <= self.retry_budget_percent <= 100:
            raise ValueError("retry_budget_percent must be between 0 and 100")
        if self.probe_tick_s <= 0:
            raise ValueError("probe_tick_s must be positive")
        if not self.health_path.startswith("/"):
            raise ValueError("health_path must start with /")
