"""Typed models of the objects pdgate reads, following Kthena's schema field for field.

ModelRoute and ModelServer belong to `networking.serving.volcano.sh/v1alpha1`; Pods are
plain Kubernetes Pod manifests. Every source (YAML directory, Kubernetes watch) turns a
raw object into one of these with `parse_object`, which raises `InvalidObject` with the
object's name and the reason instead of guessing.

INTERFACE CONTRACT (helpers implement the parsing below; the dataclasses are fixed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

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


def parse_duration(text: str) -> float:
    """Parse a Go-style duration ("300s", "150ms", "1m30s", "2h") into seconds."""
    raise NotImplementedError


def parse_object(raw: dict[str, Any]) -> Resource:
    """Turn one raw manifest into a typed resource, or raise `InvalidObject`."""
    raise NotImplementedError
