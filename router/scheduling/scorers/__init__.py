"""The scorers, one module each with its formula in the docstring; `SCORERS` maps names."""

from __future__ import annotations

from typing import Final

from router.scheduling.scorers.base import ConfigError, Param, Scorer
from router.scheduling.scorers.cache_pressure import CachePressureScorer
from router.scheduling.scorers.kv_cache_usage import KVCacheUsageScorer
from router.scheduling.scorers.least_request import LeastRequestScorer
from router.scheduling.scorers.precise_prefix_cache import PrecisePrefixCacheScorer
from router.scheduling.scorers.prefill_backlog import PrefillBacklogScorer
from router.scheduling.scorers.prefix_cache import PrefixCacheScorer
from router.scheduling.scorers.queue_depth import QueueScorer
from router.scheduling.scorers.random_score import RandomScorer
from router.scheduling.scorers.round_robin import RoundRobinScorer
from router.scheduling.scorers.session_affinity import SessionAffinityScorer

SCORERS: Final[dict[str, type[Scorer]]] = {
    cls.type_name: cls
    for cls in (
        PrefixCacheScorer,
        PrecisePrefixCacheScorer,
        CachePressureScorer,
        LeastRequestScorer,
        PrefillBacklogScorer,
        QueueScorer,
        KVCacheUsageScorer,
        SessionAffinityScorer,
        RandomScorer,
        RoundRobinScorer,
    )
}

__all__ = [
    "SCORERS",
    "CachePressureScorer",
    "ConfigError",
    "KVCacheUsageScorer",
    "LeastRequestScorer",
    "Param",
    "PrecisePrefixCacheScorer",
    "PrefillBacklogScorer",
    "PrefixCacheScorer",
    "QueueScorer",
    "RandomScorer",
    "RoundRobinScorer",
    "Scorer",
    "SessionAffinityScorer",
]
