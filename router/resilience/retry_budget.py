"""A router-wide retry budget, as Envoy's: retries bounded by the traffic, not per request.

`trafficPolicy.retry.attempts` bounds what one request may do. It does not bound the
router: when a pod fails every request, every request retries, and the load on the rest
of the cluster multiplies by up to (1 + attempts) exactly when it can least take it. The
budget lets retries in flight reach `budget_percent` of the requests in flight, and never
fewer than `min_retry_concurrency` (so a quiet router can still retry a transient
failure). A retry over budget is not made: the request ends with the error that
prompted it, and `pdgate_retries_refused_total{reason="budget"}` counts it.

Envoy's defaults are kept: 20 % and 3. Counting costs two integer updates per request.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

DEFAULT_BUDGET_PERCENT = 20.0
DEFAULT_MIN_RETRY_CONCURRENCY = 3
#: Why a retry was not made (the `reason` label; a closed set).
REFUSAL_REASONS = (
    "budget",  # the router-wide retry budget was spent
    "ejected",  # every pod (pair) left for the retry is ejected
)


class RetryBudget:
    """Requests and retries in flight; `try_acquire` admits a retry while within budget."""

    def __init__(
        self,
        budget_percent: float = DEFAULT_BUDGET_PERCENT,
        min_retry_concurrency: int = DEFAULT_MIN_RETRY_CONCURRENCY,
        registry: CollectorRegistry | None = None,
    ) -> None:
        if not 0.0 <= budget_percent <= 100.0:
            raise ValueError("budget_percent must be between 0 and 100")
        if min_retry_concurrency < 0:
            raise ValueError("min_retry_concurrency must not be negative")
        self._fraction = budget_percent / 100.0
        self._min = min_retry_concurrency
        self.requests = 0  # requests in flight (each one counted once, retrying or not)
        self.retries = 0  # retries in flight
        self._refused = (
            Counter(
                "pdgate_retries_refused",
                "Retries not made: over the router-wide retry budget, or only ejected "
                "pods left.",
                ["reason"], registry=registry,
            )
            if registry is not None
            else None
        )
        if self._refused is not None:
            for reason in REFUSAL_REASONS:
                self._refused.labels(reason=reason)

    @property
    def limit(self) -> int:
        """Retries allowed in flight now."""
        return max(self._min, int(self.requests * self._fraction))

    def try_acquire(self) -> bool:
        """Take a retry slot (then `release` it), or count a refusal and return False."""
        if self.retries >= self.limit:
            self.refuse("budget")
            return False
        self.retries += 1
        return True

    def release(self) -> None:
        self.retries -= 1

    def refuse(self, reason: str) -> None:
        if self._refused is not None:
            self._refused.labels(reason=reason).inc()


__all__ = [
    "DEFAULT_BUDGET_PERCENT", "DEFAULT_MIN_RETRY_CONCURRENCY", "REFUSAL_REASONS", "RetryBudget",
]
