"""Typed models of the objects pdgate reads, following Kthena's schema field for field.

ModelRoute and ModelServer belong to `networking.serving.volcano.sh/v1alpha1`; Pods are
plain Kubernetes Pod manifests. Every source (YAML directory, Kubernetes watch) turns a
raw object into one of these with `parse_object`, which raises `InvalidObject` with the
object's name and the reason instead of guessing.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from typing import Any, Literal, NoReturn, cast, get_args

API_GROUP = "networking.serving.volcano.sh"
API_VERSION = f"{API_GROUP}/v1alpha1"

Kind = Literal["ModelRoute", "ModelServer", "Pod"]


class InvalidObject(ValueError):
    """A raw object that breaks the schema. `name` is `namespace/name` when known."""

    def __init__(self, kind: str, name: str, reason: str) -> None:
        super().__init__(f"{kind} {name}: {reason}")
        self.kind = kind
        self.name = name
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ObjectMeta:
    name: str
    namespace: str = "default"
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    creation_timestamp: str = ""  # RFC 3339; "" sorts first (file objects)
    resource_version: str = ""
    uid: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)


@dataclass(frozen=True, slots=True)
class StringMatch:
    """Exactly one of `exact`, `prefix`, `regex` is set."""

    exact: str | None = None
    prefix: str | None = None
    regex: re.Pattern[str] | None = None

    def matches(self, value: str | None) -> bool:
        if value is None:
            return False
        if self.exact is not None:
            return value == self.exact
        if self.prefix is not None:
            return value.startswith(self.prefix)
        if self.regex is not None:
            return self.regex.search(value) is not None
        return False


@dataclass(frozen=True, slots=True)
class ModelMatch:
    headers: dict[str, StringMatch] = field(default_factory=dict)  # keys lower-cased
    uri: StringMatch | None = None
    body_model: str | None = None  # modelMatch.body.model


@dataclass(frozen=True, slots=True)
class TargetModel:
    model_server_name: str
    weight: int = 100  # 0..100


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    target_models: tuple[TargetModel, ...]
    model_match: ModelMatch | None = None  # None matches every request


RateUnit = Literal["second", "minute", "hour", "day", "month"]


@dataclass(frozen=True, slots=True)
class RateLimit:
    input_tokens_per_unit: int | None = None
    output_tokens_per_unit: int | None = None
    unit: RateUnit = "second"
    redis_address: str | None = None  # rateLimit.global.redis.address


@dataclass(frozen=True, slots=True)
class ModelRoute:
    meta: ObjectMeta
    model_name: str | None
    lora_adapters: tuple[str, ...]
    rules: tuple[Rule, ...]
    parent_refs: tuple[dict[str, Any], ...] = ()
    rate_limit: RateLimit | None = None


@dataclass(frozen=True, slots=True)
class PDGroup:
    group_key: str
    prefill_labels: dict[str, str]
    decode_labels: dict[str, str]


InferenceEngine = Literal["vLLM", "SGLang"]
ConnectorType = Literal["http", "nixl", "mooncake", "lmcache"]


@dataclass(frozen=True, slots=True)
class ModelServer:
    meta: ObjectMeta
    model: str | None
    inference_engine: InferenceEngine
    match_labels: dict[str, str]
    pd_group: PDGroup | None
    port: int
    protocol: Literal["http", "https"] = "http"
    timeout_s: float | None = None  # trafficPolicy.timeout
    retry_attempts: int = 0  # trafficPolicy.retry.attempts
    retry_interval_s: float = 0.1  # trafficPolicy.retry.retryInterval, default "100ms"
    kv_connector: ConnectorType = "http"


@dataclass(frozen=True, slots=True)
class Pod:
    meta: ObjectMeta
    ip: str | None
    ready: bool  # Running, condition Ready=True, and no deletionTimestamp


Resource = ModelRoute | ModelServer | Pod


KINDS: tuple[Kind, ...] = ("ModelRoute", "ModelServer", "Pod")
API_VERSIONS: dict[str, str] = {"ModelRoute": API_VERSION, "ModelServer": API_VERSION, "Pod": "v1"}

_DURATION_UNITS: dict[str, float] = {
    "ns": 1e-9,
    "us": 1e-6,
    "\u00b5s": 1e-6,  # micro sign, as Go accepts
    "\u03bcs": 1e-6,  # Greek mu, as Go accepts
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h)")
_DURATION_FULL = re.compile(r"[-+]?(?:(?:\d+\.?\d*|\.\d+)(?:ns|us|\u00b5s|\u03bcs|ms|s|m|h))+")

_MAX_UINT32 = 2**32 - 1
_MAX_INT32 = 2**31 - 1
#: Most retries `trafficPolicy.retry.attempts` may ask for (the CRD's `maximum`). Kthena
#: sets no bound; each retry is a whole new prefill and decode, and past a few retries a
#: request only multiplies the load of a failing cluster (Envoy's default is 1).
MAX_RETRY_ATTEMPTS = 5
_MAX_LORA_ADAPTERS = 10  # +kubebuilder:validation:MaxItems=10
_MAX_RULES = 16  # +kubebuilder:validation:MaxItems=16
_MAX_TARGETS = 16  # +kubebuilder:validation:MaxItems=16
_MAX_MODEL_LEN = 256  # +kubebuilder:validation:MaxLength=256
_RATE_UNITS: tuple[str, ...] = get_args(RateUnit)
_ENGINES: tuple[str, ...] = get_args(InferenceEngine)
_CONNECTORS: tuple[str, ...] = get_args(ConnectorType)
_PROTOCOLS: tuple[str, ...] = ("http", "https")


def parse_duration(text: str) -> float:
    """Parse a Go-style duration ("300s", "150ms", "1m30s", "2h") into seconds.

    Same grammar as Go's `time.ParseDuration` (Kubernetes `metav1.Duration` uses it), so
    a manifest that Kubernetes accepts parses here too. Raises `ValueError` otherwise.
    """
    if not isinstance(text, str):
        raise ValueError(f"duration must be a string, not {type(text).__name__}")
    body = text.strip()
    if body in ("0", "+0", "-0"):
        return 0.0
    if not _DURATION_FULL.fullmatch(body):
        raise ValueError(f"invalid duration {text!r} (want e.g. '300s', '150ms', '1m30s')")
    sign = -1.0 if body.startswith("-") else 1.0
    total = 0.0
    for number, unit in _DURATION_PART.findall(body):
        total += float(number) * _DURATION_UNITS[unit]
    return sign * total


def format_timestamp(value: datetime | date | str) -> str:
    """Normalise a creationTimestamp to RFC 3339 in UTC ("2024-05-01T12:00:00Z").

    YAML turns an unquoted timestamp into a `datetime`, Kubernetes sends a string: both
    end up in one canonical form so that ordering by age does not depend on the source.
    """
    if isinstance(value, str):
        text = value.strip()
        try:
            parsed = datetime.fromisoformat(text.replace("z", "Z"))
        except ValueError:
            raise ValueError(f"invalid RFC 3339 timestamp {value!r}") from None
    elif isinstance(value, datetime):
        parsed = value
    else:
        parsed = datetime(value.year, value.month, value.day)
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    parsed = parsed.astimezone(UTC)
    if parsed.microsecond:
        return parsed.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return parsed.strftime("%Y-%m-%dT%H:%M:%SZ")


def timestamp_key(text: str) -> datetime:
    """A sort key for a normalised creationTimestamp; "" (file objects) sorts first."""
    if not text:
        return datetime.min.replace(tzinfo=UTC)
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        return datetime.min.replace(tzinfo=UTC)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def object_name(raw: object) -> str:
    """`namespace/name` of a raw manifest, as well as it can be told (for error reports)."""
    if isinstance(raw, Mapping):
        meta = raw.get("metadata")
        if isinstance(meta, Mapping):
            name = meta.get("name")
            namespace = meta.get("namespace") or "default"
            if isinstance(name, str) and name:
                return f"{namespace}/{name}"
    return "<unnamed>"


class _Bad(Exception):
    """Internal: a schema violation at `path`, wrapped into `InvalidObject` at the top."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}" if path else reason)


def _fail(path: str, reason: str) -> NoReturn:
    raise _Bad(path, reason)


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _map(value: object, path: str, *, required: bool = False) -> Mapping[str, Any]:
    if value is None:
        if required:
            _fail(path, "is required")
        return {}
    if not isinstance(value, Mapping):
        _fail(path, f"must be an object, not {_type_name(value)}")
    for key in value:
        if not isinstance(key, str):
            _fail(path, f"has a non-string key {key!r}")
    return value


def _list(value: object, path: str, *, required: bool = False) -> list[Any]:
    if value is None:
        if required:
            _fail(path, "is required")
        return []
    if not isinstance(value, list):
        _fail(path, f"must be a list, not {_type_name(value)}")
    return value


def _str(value: object, path: str) -> str:
    if not isinstance(value, str):
        _fail(path, f"must be a string, not {_type_name(value)}")
    return value


def _opt_str(value: object, path: str) -> str | None:
    return None if value is None else _str(value, path)


def _required_str(value: object, path: str) -> str:
    if value is None or value == "":
        _fail(path, "is required")
    return _str(value, path)


def _int(value: object, path: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(path, f"must be an integer, not {_type_name(value)}")
    if not lo <= value <= hi:
        _fail(path, f"must be between {lo} and {hi}, got {value}")
    return value


def _enum(value: object, path: str, allowed: tuple[str, ...]) -> str:
    text = _str(value, path)
    if text not in allowed:
        _fail(path, f"must be one of {', '.join(allowed)}, got {text!r}")
    return text


def _labels(value: object, path: str) -> dict[str, str]:
    mapping = _map(value, path)
    out: dict[str, str] = {}
    for key, item in mapping.items():
        out[key] = _str(item, f"{path}.{key}")
    return out


def _duration(value: object, path: str) -> float:
    text = _str(value, path)
    try:
        return parse_duration(text)
    except ValueError as exc:
        _fail(path, str(exc))


def _meta(raw: Mapping[str, Any]) -> ObjectMeta:
    meta = _map(raw.get("metadata"), "metadata", required=True)
    name = _required_str(meta.get("name"), "metadata.name")
    namespace = meta.get("namespace")
    namespace = "default" if namespace in (None, "") else _str(namespace, "metadata.namespace")
    created = meta.get("creationTimestamp")
    creation = ""
    if created not in (None, ""):
        if not isinstance(created, str | datetime | date):
            _fail("metadata.creationTimestamp", f"must be a timestamp, not {_type_name(created)}")
        try:
            creation = format_timestamp(created)
        except ValueError as exc:
            _fail("metadata.creationTimestamp", str(exc))
    version = meta.get("resourceVersion")
    uid = meta.get("uid")
    return ObjectMeta(
        name=name,
        namespace=namespace,
        labels=_labels(meta.get("labels"), "metadata.labels"),
        annotations=_labels(meta.get("annotations"), "metadata.annotations"),
        creation_timestamp=creation,
        resource_version="" if version is None else str(version),
        uid="" if uid is None else str(uid),
    )


def _string_match(value: object, path: str) -> StringMatch:
    spec = _map(value, path, required=True)
    present = [key for key in ("exact", "prefix", "regex") if spec.get(key) is not None]
    if len(present) != 1:
        _fail(path, "must set exactly one of exact, prefix, regex")
    key = present[0]
    text = _str(spec[key], f"{path}.{key}")
    if key == "exact":
        return StringMatch(exact=text)
    if key == "prefix":
        return StringMatch(prefix=text)
    try:
        return StringMatch(regex=re.compile(text))
    except re.error as exc:
        _fail(f"{path}.regex", f"invalid regular expression {text!r}: {exc}")


def _model_match(value: object, path: str) -> ModelMatch | None:
    if value is None:
        return None
    spec = _map(value, path)
    headers = {
        key.lower(): _string_match(item, f"{path}.headers.{key}")
        for key, item in _map(spec.get("headers"), f"{path}.headers").items()
    }
    uri = spec.get("uri")
    body = _map(spec.get("body"), f"{path}.body")
    return ModelMatch(
        headers=headers,
        uri=None if uri is None else _string_match(uri, f"{path}.uri"),
        body_model=_opt_str(body.get("model"), f"{path}.body.model"),
    )


def _target(value: object, path: str) -> TargetModel:
    spec = _map(value, path, required=True)
    name = _required_str(spec.get("modelServerName"), f"{path}.modelServerName")
    weight = spec.get("weight")
    return TargetModel(
        model_server_name=name,
        weight=100 if weight is None else _int(weight, f"{path}.weight", 0, 100),
    )


def _rule(value: object, path: str) -> Rule:
    spec = _map(value, path, required=True)
    targets = _list(spec.get("targetModels"), f"{path}.targetModels", required=True)
    if not 1 <= len(targets) <= _MAX_TARGETS:
        _fail(f"{path}.targetModels", f"must have 1 to {_MAX_TARGETS} items, got {len(targets)}")
    name = spec.get("name")
    return Rule(
        name="" if name is None else _str(name, f"{path}.name"),
        target_models=tuple(_target(t, f"{path}.targetModels[{i}]") for i, t in enumerate(targets)),
        model_match=_model_match(spec.get("modelMatch"), f"{path}.modelMatch"),
    )


def _rate_limit(value: object, path: str) -> RateLimit | None:
    if value is None:
        return None
    spec = _map(value, path)
    tokens_in = spec.get("inputTokensPerUnit")
    tokens_out = spec.get("outputTokensPerUnit")
    unit = spec.get("unit")
    redis = _map(spec.get("global"), f"{path}.global").get("redis")
    address = None
    if redis is not None:
        redis_spec = _map(redis, f"{path}.global.redis")
        address = _required_str(redis_spec.get("address"), f"{path}.global.redis.address")
    return RateLimit(
        input_tokens_per_unit=None
        if tokens_in is None
        else _int(tokens_in, f"{path}.inputTokensPerUnit", 1, _MAX_UINT32),
        output_tokens_per_unit=None
        if tokens_out is None
        else _int(tokens_out, f"{path}.outputTokensPerUnit", 1, _MAX_UINT32),
        unit=cast(RateUnit, "second" if unit is None else _enum(unit, f"{path}.unit", _RATE_UNITS)),
        redis_address=address,
    )


def _model_route(raw: Mapping[str, Any], meta: ObjectMeta) -> ModelRoute:
    spec = _map(raw.get("spec"), "spec", required=True)
    model_name = spec.get("modelName")
    model_name = None if model_name in (None, "") else _str(model_name, "spec.modelName")
    adapters = _list(spec.get("loraAdapters"), "spec.loraAdapters")
    if len(adapters) > _MAX_LORA_ADAPTERS:
        _fail("spec.loraAdapters", f"must have at most {_MAX_LORA_ADAPTERS} items")
    lora = tuple(_str(a, f"spec.loraAdapters[{i}]") for i, a in enumerate(adapters))
    if model_name is None and not lora:
        _fail("spec", "modelName and loraAdapters cannot both be empty")
    rules = _list(spec.get("rules"), "spec.rules", required=True)
    if not 1 <= len(rules) <= _MAX_RULES:
        _fail("spec.rules", f"must have 1 to {_MAX_RULES} items, got {len(rules)}")
    parents = _list(spec.get("parentRefs"), "spec.parentRefs")
    parent_refs = []
    for i, ref in enumerate(parents):
        ref_map = _map(ref, f"spec.parentRefs[{i}]", required=True)
        _required_str(ref_map.get("name"), f"spec.parentRefs[{i}].name")
        parent_refs.append(dict(ref_map))
    return ModelRoute(
        meta=meta,
        model_name=model_name,
        lora_adapters=lora,
        rules=tuple(_rule(r, f"spec.rules[{i}]") for i, r in enumerate(rules)),
        parent_refs=tuple(parent_refs),
        rate_limit=_rate_limit(spec.get("rateLimit"), "spec.rateLimit"),
    )


def _pd_group(value: object, path: str) -> PDGroup | None:
    if value is None:
        return None
    spec = _map(value, path)
    prefill = _labels(spec.get("prefillLabels"), f"{path}.prefillLabels")
    decode = _labels(spec.get("decodeLabels"), f"{path}.decodeLabels")
    # Kthena never matches a pod against an empty label set, so an empty one is a mistake.
    if not prefill:
        _fail(f"{path}.prefillLabels", "is required")
    if not decode:
        _fail(f"{path}.decodeLabels", "is required")
    return PDGroup(
        group_key=_required_str(spec.get("groupKey"), f"{path}.groupKey"),
        prefill_labels=prefill,
        decode_labels=decode,
    )


def _model_server(raw: Mapping[str, Any], meta: ObjectMeta) -> ModelServer:
    spec = _map(raw.get("spec"), "spec", required=True)
    model = spec.get("model")
    model = None if model in (None, "") else _str(model, "spec.model")
    if model is not None and len(model) > _MAX_MODEL_LEN:
        _fail("spec.model", f"must be at most {_MAX_MODEL_LEN} characters")
    engine = spec.get("inferenceEngine")
    if engine is None:
        _fail("spec.inferenceEngine", "is required")
    selector = _map(spec.get("workloadSelector"), "spec.workloadSelector", required=True)
    port_spec = _map(spec.get("workloadPort"), "spec.workloadPort", required=True)
    port = port_spec.get("port")
    if port is None:
        _fail("spec.workloadPort.port", "is required")
    protocol = port_spec.get("protocol")
    policy = _map(spec.get("trafficPolicy"), "spec.trafficPolicy")
    timeout = policy.get("timeout")
    timeout_s = None
    if timeout is not None:
        timeout_s = _duration(timeout, "spec.trafficPolicy.timeout")
        if timeout_s <= 0:
            _fail("spec.trafficPolicy.timeout", f"must be positive, got {timeout!r}")
    retry = _map(policy.get("retry"), "spec.trafficPolicy.retry")
    attempts = retry.get("attempts")
    interval = retry.get("retryInterval")
    interval_s = 0.1
    if interval is not None:
        interval_s = _duration(interval, "spec.trafficPolicy.retry.retryInterval")
        if interval_s < 0:
            _fail("spec.trafficPolicy.retry.retryInterval", f"must not be negative: {interval!r}")
    connector = _map(spec.get("kvConnector"), "spec.kvConnector").get("type")
    return ModelServer(
        meta=meta,
        model=model,
        inference_engine=cast(
            InferenceEngine, _enum(engine, "spec.inferenceEngine", _ENGINES)
        ),
        match_labels=_labels(selector.get("matchLabels"), "spec.workloadSelector.matchLabels"),
        pd_group=_pd_group(selector.get("pdGroup"), "spec.workloadSelector.pdGroup"),
        port=_int(port, "spec.workloadPort.port", 1, 65535),
        protocol=cast(
            Literal["http", "https"],
            "http" if protocol in (None, "") else _enum(
                protocol, "spec.workloadPort.protocol", _PROTOCOLS
            ),
        ),
        timeout_s=timeout_s,
        retry_attempts=0
        if attempts is None
        else _int(attempts, "spec.trafficPolicy.retry.attempts", 0, MAX_RETRY_ATTEMPTS),
        retry_interval_s=interval_s,
        kv_connector=cast(
            ConnectorType,
            "http" if connector in (None, "") else _enum(
                connector, "spec.kvConnector.type", _CONNECTORS
            ),
        ),
    )


def _pod(raw: Mapping[str, Any], meta: ObjectMeta) -> Pod:
    status = _map(raw.get("status"), "status")
    deleting = _map(raw.get("metadata"), "metadata").get("deletionTimestamp") is not None
    ready = False
    if status.get("phase") == "Running" and not deleting:
        for i, cond in enumerate(_list(status.get("conditions"), "status.conditions")):
            cond_map = _map(cond, f"status.conditions[{i}]")
            if cond_map.get("type") == "Ready" and cond_map.get("status") == "True":
                ready = True
                break
    ip = status.get("podIP")
    if ip in (None, ""):
        return Pod(meta=meta, ip=None, ready=ready)
    text = _str(ip, "status.podIP")
    try:
        # The API server only ever writes an address here; anything else is a file cut
        # mid-write or a typo, and would be dialled as a host name.
        ipaddress.ip_address(text)
    except ValueError:
        _fail("status.podIP", f"not an IP address: {text!r}")
    return Pod(meta=meta, ip=text, ready=ready)


def parse_object(raw: dict[str, Any]) -> Resource:
    """Turn one raw manifest into a typed resource, or raise `InvalidObject`.

    Fields follow Kthena's networking v1alpha1 Go types and their kubebuilder markers
    (defaults, enums, bounds), so a manifest behaves here as it would under Kthena.
    Unknown fields are ignored, as the API server prunes them.
    """
    name = object_name(raw)
    if not isinstance(raw, Mapping):
        raise InvalidObject("?", name, f"must be an object, not {_type_name(raw)}")
    kind = raw.get("kind")
    if not isinstance(kind, str) or kind not in API_VERSIONS:
        raise InvalidObject(str(kind), name, f"unsupported kind {kind!r}")
    try:
        api_version = raw.get("apiVersion")
        if api_version != API_VERSIONS[kind]:
            _fail("apiVersion", f"must be {API_VERSIONS[kind]!r}, got {api_version!r}")
        meta = _meta(raw)
        if kind == "ModelRoute":
            return _model_route(raw, meta)
        if kind == "ModelServer":
            return _model_server(raw, meta)
        return _pod(raw, meta)
    except _Bad as exc:
        raise InvalidObject(kind, name, str(exc)) from None


def kind_of(obj: Resource) -> Kind:
    """The manifest kind of a typed resource."""
    if isinstance(obj, ModelRoute):
        return "ModelRoute"
    if isinstance(obj, ModelServer):
        return "ModelServer"
    return "Pod"
