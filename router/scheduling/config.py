"""The scheduler's configuration: `config/scheduler.yaml`, defaults good without it.

    apiVersion: pdgate.io/v1alpha1        # optional; lets the file sit in a --config dir
    kind: SchedulerConfig                 # optional (the object sources ignore this kind)
    profiles:
      prefill:                            # choosing the prefill pod of a PD pair
        unit: ttft                        # ttft (seconds of predicted TTFT) | score (0..1)
        filters: [ready, not-ejected, {type: not-saturated, maxWaiting: 32}]
        scorers:
          - {type: prefix-cache, weight: 1.0}
          - {type: prefill-backlog, weight: 1.0}
          - {type: queue, weight: 0.5, threshold: 32}
          - {type: cache-pressure, weight: 1.0}
        picker: {tieTolerance: 0.05, cacheSimilarity: 0.1, workWeight: 0.25,
                 guard: {absolute: 8, relative: 2.0}}
      decode: ...                         # the decode pod, within the prefill pod's group
      aggregated: ...                     # servers without PD
    pairing: {decodeWeight: 1.0}          # pair cost = prefill + decodeWeight x decode
    costModel: {prefillSecondsPerToken: 0.0001, prefillOverhead: 5ms, ...}  # CostModel
    approximateIndex: {blockBytes: 256, charsPerToken: 4.0,
                       defaultCapacityTokens: 524288, maxBlocksPerPod: 1048576,
                       maxPromptBlocks: 4096}
    preciseIndex: {enabled: auto, blockSize: 16, keys: auto, hashAlgo: sha256,
                   hashSeed: null, eventsPort: 5557,
                   replayPort: 5558, replayTimeout: 500ms, replayOnJoin: true,
                   maxBlocksPerPod: 262144, maxStoreBlocks: 1048576,
                   storeMedia: [cpu]}
    engineMetrics: {enabled: true, interval: 200ms, timeout: 1s,
                    staleAfterIntervals: 5, maxConcurrency: 32}
    sessions: {maxSessions: 65536}
    reload: {interval: 1s}
    ttftModel: {enabled: true, window: 256, minSamples: 16, refitEvery: 8, huberK: 1.5,
                maxOverhead: 10s, maxRatio: 20.0, errorAlpha: 0.05}   # ttft_model.py
    poolView: {enabled: true, capacityTokens: 50000000}                # pool_view.py
    sloAdmission: {enabled: false, ttftTarget: 0, action: reject,      # slo.py
                   retryAfter: 1s, maxQueueWait: 2s, queuePoll: 50ms, lengthFactor: 0}

Every section and key is optional; a missing profile gets its default (DEFAULT_PROFILES),
a profile given replaces the default one whole. Unknown keys are errors (a typo must not
silently fall back to a default). Durations are Go-style strings ("200ms") or seconds.
`preciseIndex.enabled: auto` subscribes to KV events only when some profile uses the
`precise-prefix-cache` scorer. `preciseIndex.keys/hashAlgo/hashSeed/blockSize` are the
defaults of every ModelServer's block keying (`router.kvhash.keyspace`; per server, the
`pdgate.io/precise-index-keys`, `.../prefix-caching-hash-algo`, `.../python-hash-seed` and
`.../block-size` annotations): `hashSeed` is the engines' PYTHONHASHSEED, null when unset
(vLLM's default), which makes `keys: auto` key blocks by their token ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Final, Literal

import yaml

from router.kvhash.keyspace import KEYS_SETTINGS, KeySettings
from router.kvhash.vllm import HASH_ALGOS, VllmHashConfig, parse_algo
from router.resources import parse_duration
from router.scheduling.block_hash import DEFAULT_APPROX_BLOCK_BYTES
from router.scheduling.context import CostModel
from router.scheduling.filters import FILTERS
from router.scheduling.pool_view import DEFAULT_POOL_CAPACITY_TOKENS
from router.scheduling.scorers import SCORERS
from router.scheduling.scorers.base import ConfigError, check_params
from router.scheduling.slo import SLO_ACTIONS, SLOConfig
from router.scheduling.ttft_model import FitSettings

Unit = Literal["ttft", "score"]
PROFILE_NAMES: Final = ("prefill", "decode", "aggregated")
CONFIG_KIND: Final = "SchedulerConfig"
#: Largest scheduler config file read (bytes).
MAX_CONFIG_BYTES: Final = 1 << 20


class SchedulerConfigError(ValueError):
    """The scheduler config is invalid; the message names the file and the key."""


@dataclass(frozen=True, slots=True)
class ComponentSpec:
    """One filter or scorer of a profile: its type, weight (scorers) and parameters."""

    type: str
    weight: float = 1.0
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GuardConfig:
    """Anti-herding guard: a candidate this much busier than the least busy is excluded.

    Busier = load - min_load >= absolute AND load >= relative x max(min_load, 1), where
    load = router in-flight + engine waiting. 0 in either disables the guard.
    """

    absolute: float = 8.0
    relative: float = 2.0


@dataclass(frozen=True, slots=True)
class PickerConfig:
    #: Costs within tieTolerance x (1 in score unit, one mean prefill in ttft unit) of the
    #: best tie, and a tie is broken at random (never by list order).
    tie_tolerance: float = 0.05
    #: Affinity scores within this of the best candidate's count as equal to it, so
    #: among pods with a similar cache benefit, load decides.
    cache_similarity: float = 0.1
    #: PD prefill choice only (ttft unit): a candidate is chosen by its predicted TTFT plus
    #: workWeight x the prefill compute (and pool pull) seconds it would spend, so that
    #: where waiting on a warm pod and computing the prompt cold on an idle one predict
    #: the same TTFT, the warm pod wins (the compute spent elsewhere delays later
    #: requests, and the copy evicts other prompts). The predicted TTFT is unchanged.
    work_weight: float = 0.25
    guard: GuardConfig = GuardConfig()


@dataclass(frozen=True, slots=True)
class ProfileConfig:
    unit: Unit = "ttft"
    filters: tuple[ComponentSpec, ...] = ()
    scorers: tuple[ComponentSpec, ...] = ()
    picker: PickerConfig = PickerConfig()

    def uses(self, scorer_type: str) -> bool:
        return any(s.type == scorer_type and s.weight > 0 for s in self.scorers)


@dataclass(frozen=True, slots=True)
class PairingConfig:
    decode_weight: float = 1.0


@dataclass(frozen=True, slots=True)
class ApproximateIndexConfig:
    block_bytes: int = DEFAULT_APPROX_BLOCK_BYTES
    chars_per_token: float = 4.0
    default_capacity_tokens: int = 512 * 1024
    max_blocks_per_pod: int = 1 << 20
    max_prompt_blocks: int = 4096


@dataclass(frozen=True, slots=True)
class PreciseIndexConfig:
    enabled: bool | Literal["auto"] = "auto"
    block_size: int = 16
    keys: str = "auto"
    hash_algo: str = "sha256"
    hash_seed: str | None = None
    events_port: int = 5557
    replay_port: int | None = 5558
    replay_timeout_s: float = 0.5
    replay_on_join: bool = True
    max_blocks_per_pod: int = 262_144
    max_store_blocks: int = 1 << 20
    store_media: tuple[str, ...] = ("cpu",)


@dataclass(frozen=True, slots=True)
class EngineMetricsConfig:
    enabled: bool = True
    interval_s: float = 0.2
    timeout_s: float = 1.0
    stale_after_intervals: float = 5.0
    max_concurrency: int = 32


@dataclass(frozen=True, slots=True)
class SessionsConfig:
    max_sessions: int = 65_536


@dataclass(frozen=True, slots=True)
class ReloadConfig:
    interval_s: float = 1.0


@dataclass(frozen=True, slots=True)
class PoolViewConfig:
    """The router's view of ModelServers that declare a shared KV pool (pool_view.py): fed
    by dispatches (approximate index) or by their prefill pods' events (precise index)."""

    enabled: bool = True
    capacity_tokens: int = DEFAULT_POOL_CAPACITY_TOKENS


def key_settings(config: PreciseIndexConfig) -> KeySettings:
    """The default block keying of every ModelServer (validated by `_check`)."""
    keys = config.keys if config.keys in KEYS_SETTINGS else "auto"
    return KeySettings(
        keys,  # type: ignore[arg-type]
        VllmHashConfig(parse_algo(config.hash_algo), config.hash_seed, config.block_size),
    )


def component(kind: Literal["scorer", "filter"], name: str, weight: float = 1.0,
              **params: Any) -> ComponentSpec:
    """A filter or scorer spec with every parameter filled in (defaults included)."""
    registry: Mapping[str, Any] = SCORERS if kind == "scorer" else FILTERS
    cls = registry.get(name)
    if cls is None:
        raise SchedulerConfigError(
            f"unknown {kind} {name!r} (known: {', '.join(sorted(registry))})"
        )
    try:
        full = check_params(f"{kind} {name}", cls.PARAMS, params)
    except ConfigError as exc:
        raise SchedulerConfigError(str(exc)) from None
    return ComponentSpec(name, weight, full)


_FILTERS_DEFAULT: Final = (
    component("filter", "ready"),
    component("filter", "not-ejected"),
    component("filter", "not-saturated"),
)

DEFAULT_PROFILES: Final[Mapping[str, ProfileConfig]] = {
    "prefill": ProfileConfig(
        unit="ttft",
        filters=_FILTERS_DEFAULT,
        scorers=(
            component("scorer", "prefix-cache", 1.0),
            component("scorer", "prefill-backlog", 1.0),
            component("scorer", "queue", 0.5),
            component("scorer", "cache-pressure", 1.0),
        ),
    ),
    "decode": ProfileConfig(
        unit="ttft",
        filters=_FILTERS_DEFAULT,
        scorers=(
            component("scorer", "least-request", 1.0),
            component("scorer", "queue", 1.0),
            component("scorer", "kv-cache-usage", 1.0),
        ),
    ),
    "aggregated": ProfileConfig(
        unit="ttft",
        filters=_FILTERS_DEFAULT,
        scorers=(
            component("scorer", "prefix-cache", 1.0),
            component("scorer", "least-request", 1.0),
            component("scorer", "queue", 0.5),
            component("scorer", "kv-cache-usage", 1.0),
            component("scorer", "cache-pressure", 1.0),
        ),
    ),
}


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    profiles: Mapping[str, ProfileConfig] = field(default_factory=lambda: dict(DEFAULT_PROFILES))
    pairing: PairingConfig = PairingConfig()
    cost_model: CostModel = field(default_factory=CostModel)
    approximate_index: ApproximateIndexConfig = ApproximateIndexConfig()
    precise_index: PreciseIndexConfig = PreciseIndexConfig()
    engine_metrics: EngineMetricsConfig = EngineMetricsConfig()
    sessions: SessionsConfig = SessionsConfig()
    reload: ReloadConfig = ReloadConfig()
    ttft_model: FitSettings = field(default_factory=FitSettings)
    pool_view: PoolViewConfig = PoolViewConfig()
    slo: SLOConfig = field(default_factory=SLOConfig)

    def profile(self, name: str) -> ProfileConfig:
        return self.profiles.get(name) or DEFAULT_PROFILES[name]

    def uses(self, scorer_type: str) -> bool:
        return any(self.profile(name).uses(scorer_type) for name in PROFILE_NAMES)

    @property
    def precise_enabled(self) -> bool:
        enabled = self.precise_index.enabled
        return self.uses("precise-prefix-cache") if enabled == "auto" else bool(enabled)


# -- parsing -----------------------------------------------------------------------------------


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


_KEY_OVERRIDES: Final = {
    "prefill_s_per_token": "prefillSecondsPerToken",
    "transfer_s_per_token": "transferSecondsPerToken",
}


def _is_duration(name: str) -> bool:
    return name.endswith("_s")


def _field_key(name: str) -> str:
    """A dataclass field's YAML key: camelCase; a duration (`*_s`) loses its suffix."""
    override = _KEY_OVERRIDES.get(name)
    if override is not None:
        return override
    return _camel(name[:-2] if _is_duration(name) else name)


def _mapping(raw: Any, where: str) -> Mapping[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise SchedulerConfigError(f"{where}: must be a mapping")
    return raw


def _number(value: Any, where: str, integer: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SchedulerConfigError(f"{where}: must be a number")
    if integer and not isinstance(value, int):
        raise SchedulerConfigError(f"{where}: must be an integer")
    if value < 0:
        raise SchedulerConfigError(f"{where}: must not be negative")
    return value


def _seconds(value: Any, where: str) -> float:
    if isinstance(value, str):
        try:
            seconds = parse_duration(value)
        except ValueError as exc:
            raise SchedulerConfigError(f"{where}: {exc}") from None
    else:
        seconds = _number(value, where)
    if seconds < 0:
        raise SchedulerConfigError(f"{where}: must not be negative")
    return float(seconds)


def _section(cls: type[Any], raw: Any, where: str, base: Any = None) -> Any:
    """Build dataclass `cls` from a camelCase mapping, checking names and types."""
    data = _mapping(raw, where)
    current = base if base is not None else cls()
    by_key = {_field_key(f.name): f for f in fields(cls)}
    changes: dict[str, Any] = {}
    for key, value in data.items():
        f = by_key.get(str(key))
        if f is None:
            known = ", ".join(sorted(by_key))
            raise SchedulerConfigError(f"{where}: unknown key {key!r} (known: {known})")
        here = f"{where}.{key}"
        default = getattr(current, f.name)
        if _is_duration(f.name):
            changes[f.name] = _seconds(value, here)
        elif f.name == "hash_seed":
            if value is not None and not isinstance(value, str | int):
                raise SchedulerConfigError(f"{here}: must be a string or null")
            changes[f.name] = None if value is None else str(value)
        elif f.name == "replay_port":
            changes[f.name] = (
                None if value in (None, 0, "none") else int(_number(value, here, True))
            )
        elif f.name == "enabled" and isinstance(default, bool | str):
            if value != "auto" and not isinstance(value, bool):
                raise SchedulerConfigError(f"{here}: must be true, false or auto")
            if value == "auto" and cls is not PreciseIndexConfig:
                raise SchedulerConfigError(f"{here}: must be true or false")
            changes[f.name] = value
        elif isinstance(default, bool):
            if not isinstance(value, bool):
                raise SchedulerConfigError(f"{here}: must be true or false")
            changes[f.name] = value
        elif isinstance(default, int):
            changes[f.name] = int(_number(value, here, True))
        elif isinstance(default, float):
            changes[f.name] = float(_number(value, here))
        elif isinstance(default, str):
            if not isinstance(value, str | int):
                raise SchedulerConfigError(f"{here}: must be a string")
            changes[f.name] = str(value)
        elif isinstance(default, tuple):
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise SchedulerConfigError(f"{here}: must be a list of strings")
            changes[f.name] = tuple(value)
        else:  # pragma: no cover - every field type is handled above
            raise SchedulerConfigError(f"{here}: unsupported")
    return replace(current, **changes) if changes else current


def _component(raw: Any, where: str, kind: Literal["scorer", "filter"]) -> ComponentSpec:
    if isinstance(raw, str):
        raw = {"type": raw}
    data = dict(_mapping(raw, where))
    name = data.pop("type", None)
    if not isinstance(name, str):
        raise SchedulerConfigError(f"{where}: needs a string `type`")
    weight = 1.0
    if kind == "scorer":
        weight = float(_number(data.pop("weight", 1.0), f"{where}.weight"))
    try:
        return component(kind, name, weight, **data)
    except SchedulerConfigError as exc:
        raise SchedulerConfigError(f"{where}: {exc}") from None


def _profile(raw: Any, where: str) -> ProfileConfig:
    data = dict(_mapping(raw, where))
    unit = data.pop("unit", "ttft")
    if unit not in ("ttft", "score"):
        raise SchedulerConfigError(f"{where}.unit: must be ttft or score")
    filters_raw = data.pop("filters", [c.type for c in _FILTERS_DEFAULT])
    scorers_raw = data.pop("scorers", None)
    picker_raw = dict(_mapping(data.pop("picker", None), f"{where}.picker"))
    if data:
        raise SchedulerConfigError(f"{where}: unknown key(s) {', '.join(map(str, data))}")
    if not isinstance(filters_raw, list):
        raise SchedulerConfigError(f"{where}.filters: must be a list")
    if not isinstance(scorers_raw, list) or not scorers_raw:
        raise SchedulerConfigError(f"{where}.scorers: must be a non-empty list")
    filters = tuple(
        _component(item, f"{where}.filters[{i}]", "filter") for i, item in enumerate(filters_raw)
    )
    scorers = tuple(
        _component(item, f"{where}.scorers[{i}]", "scorer") for i, item in enumerate(scorers_raw)
    )
    guard = _section(GuardConfig, picker_raw.pop("guard", None), f"{where}.picker.guard")
    picker = _section(PickerConfig, picker_raw, f"{where}.picker")
    return ProfileConfig(
        unit=unit, filters=filters, scorers=scorers, picker=replace(picker, guard=guard)
    )


_SECTIONS: Final[dict[str, tuple[str, type[Any]]]] = {
    "pairing": ("pairing", PairingConfig),
    "costModel": ("cost_model", CostModel),
    "approximateIndex": ("approximate_index", ApproximateIndexConfig),
    "preciseIndex": ("precise_index", PreciseIndexConfig),
    "engineMetrics": ("engine_metrics", EngineMetricsConfig),
    "sessions": ("sessions", SessionsConfig),
    "reload": ("reload", ReloadConfig),
    "ttftModel": ("ttft_model", FitSettings),
    "poolView": ("pool_view", PoolViewConfig),
    "sloAdmission": ("slo", SLOConfig),
}


def parse_scheduler_config(raw: Any, source: str = "scheduler config") -> SchedulerConfig:
    """Build a `SchedulerConfig` from a parsed YAML document (None: all defaults)."""
    data = dict(_mapping(raw, source))
    data.pop("apiVersion", None)
    kind = data.pop("kind", CONFIG_KIND)
    if kind != CONFIG_KIND:
        raise SchedulerConfigError(f"{source}: kind must be {CONFIG_KIND}, not {kind!r}")
    data.pop("metadata", None)
    profiles: dict[str, ProfileConfig] = dict(DEFAULT_PROFILES)
    for name, body in _mapping(data.pop("profiles", None), f"{source}.profiles").items():
        if name not in PROFILE_NAMES:
            raise SchedulerConfigError(
                f"{source}.profiles: unknown profile {name!r} (known: {', '.join(PROFILE_NAMES)})"
            )
        profiles[name] = _profile(body, f"{source}.profiles.{name}")
    changes: dict[str, Any] = {"profiles": profiles}
    for key, value in data.items():
        section = _SECTIONS.get(str(key))
        if section is None:
            known = ", ".join(["profiles", *_SECTIONS])
            raise SchedulerConfigError(f"{source}: unknown key {key!r} (known: {known})")
        attr, cls = section
        changes[attr] = _section(cls, value, f"{source}.{key}")
    config = replace(SchedulerConfig(), **changes)
    _check(config, source)
    return config


def _check(config: SchedulerConfig, source: str) -> None:
    if config.profile("prefill").unit != config.profile("decode").unit:
        raise SchedulerConfigError(
            f"{source}.profiles: prefill and decode must use the same unit (their costs add up)"
        )
    if config.approximate_index.block_bytes <= 0:
        raise SchedulerConfigError(f"{source}.approximateIndex.blockBytes: must be positive")
    if config.approximate_index.chars_per_token <= 0:
        raise SchedulerConfigError(f"{source}.approximateIndex.charsPerToken: must be positive")
    if config.precise_index.block_size <= 0:
        raise SchedulerConfigError(f"{source}.preciseIndex.blockSize: must be positive")
    if config.precise_index.hash_algo not in HASH_ALGOS:
        raise SchedulerConfigError(
            f"{source}.preciseIndex.hashAlgo: must be one of {', '.join(HASH_ALGOS)}"
        )
    if config.precise_index.keys not in KEYS_SETTINGS:
        raise SchedulerConfigError(
            f"{source}.preciseIndex.keys: must be one of {', '.join(KEYS_SETTINGS)}"
        )
    if config.engine_metrics.interval_s <= 0 or config.engine_metrics.timeout_s <= 0:
        raise SchedulerConfigError(f"{source}.engineMetrics: interval and timeout must be > 0")
    if config.sessions.max_sessions <= 0:
        raise SchedulerConfigError(f"{source}.sessions.maxSessions: must be positive")
    if config.slo.action not in SLO_ACTIONS:
        raise SchedulerConfigError(
            f"{source}.sloAdmission.action: must be one of {', '.join(SLO_ACTIONS)}"
        )
    if config.slo.length_factor < 0:
        raise SchedulerConfigError(f"{source}.sloAdmission.lengthFactor: must be >= 0")
    if config.ttft_model.window < 3 or config.ttft_model.min_samples < 3:
        raise SchedulerConfigError(f"{source}.ttftModel: window and minSamples must be >= 3")
    if config.ttft_model.max_ratio < 1 or config.ttft_model.error_alpha > 1:
        raise SchedulerConfigError(
            f"{source}.ttftModel: maxRatio must be >= 1 and errorAlpha <= 1"
        )
    if config.cost_model.pool_gbytes_per_sec <= 0:
        raise SchedulerConfigError(f"{source}.costModel.poolGbytesPerSec: must be positive")
    if config.pool_view.capacity_tokens <= 0:
        raise SchedulerConfigError(f"{source}.poolView.capacityTokens: must be positive")
    if config.cost_model.ewma_alpha > 1:
        raise SchedulerConfigError(f"{source}.costModel.ewmaAlpha: must be <= 1")


def load_scheduler_config(path: Path | str | None) -> SchedulerConfig:
    """Read and validate a scheduler config file (None: every default).

    The file holds one YAML document, or several of which exactly one has
    `kind: SchedulerConfig`. Raises `SchedulerConfigError` naming the file.
    """
    if path is None:
        return SchedulerConfig()
    path = Path(path)
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise SchedulerConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise SchedulerConfigError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        docs = [d for d in yaml.safe_load_all(data.decode("utf-8")) if d is not None]
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise SchedulerConfigError(f"{path}: not valid YAML: {exc}") from None
    if len(docs) > 1:
        docs = [d for d in docs if isinstance(d, Mapping) and d.get("kind") == CONFIG_KIND]
        if len(docs) != 1:
            raise SchedulerConfigError(
                f"{path}: several YAML documents, need exactly one of kind {CONFIG_KIND}"
            )
    return parse_scheduler_config(docs[0] if docs else None, str(path))


__all__ = [
    "DEFAULT_PROFILES",
    "ApproximateIndexConfig",
    "ComponentSpec",
    "EngineMetricsConfig",
    "GuardConfig",
    "PairingConfig",
    "PickerConfig",
    "PoolViewConfig",
    "PreciseIndexConfig",
    "ProfileConfig",
    "SchedulerConfig",
    "SchedulerConfigError",
    "SessionsConfig",
    "component",
    "key_settings",
    "load_scheduler_config",
    "parse_scheduler_config",
]
