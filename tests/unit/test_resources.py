"""Parsing of Kthena's ModelRoute and ModelServer, and of Pods: every field, every error."""

from __future__ import annotations

import copy
import datetime as dt
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from router.resources import (
    API_VERSION,
    InvalidObject,
    ModelRoute,
    ModelServer,
    Pod,
    RateLimit,
    format_timestamp,
    parse_duration,
    parse_object,
)
from tests.fixtures import KTHENA_PD_EXAMPLE

FIXTURE = KTHENA_PD_EXAMPLE
CONFIG_EXAMPLE = Path(__file__).resolve().parents[2] / "config" / "kthena-pd-example.yaml"


# --------------------------------------------------------------------------- durations


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("300s", 300.0),
        ("150ms", 0.15),
        ("1m30s", 90.0),
        ("2h", 7200.0),
        ("1.5s", 1.5),
        ("500us", 0.0005),
        ("500\u00b5s", 0.0005),
        ("500\u03bcs", 0.0005),
        ("10ns", 1e-8),
        ("1h2m3.5s", 3723.5),
        (".5s", 0.5),
        ("0", 0.0),
        ("0s", 0.0),
        ("-1m", -60.0),
        ("+2s", 2.0),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "1", "1.5", "s", "1d", "1 s", "--1s", "1s2", "ms", "1S"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


@given(
    h=st.integers(0, 1000),
    m=st.integers(0, 59),
    s=st.integers(0, 59),
    ms=st.integers(0, 999),
)
def test_parse_duration_sums_parts(h: int, m: int, s: int, ms: int) -> None:
    text = f"{h}h{m}m{s}s{ms}ms"
    assert parse_duration(text) == pytest.approx(h * 3600 + m * 60 + s + ms / 1000)


# --------------------------------------------------------------------------- builders


def route_raw() -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "ModelRoute",
        "metadata": {
            "name": "r1",
            "namespace": "team",
            "labels": {"app": "x"},
            "annotations": {"note": "y"},
            "creationTimestamp": "2024-05-01T12:00:00Z",
            "resourceVersion": "42",
            "uid": "abc",
        },
        "spec": {
            "modelName": "llama",
            "loraAdapters": ["sql-lora", "chat-lora"],
            "parentRefs": [{"name": "gw", "kind": "Gateway"}],
            "rules": [
                {
                    "name": "canary",
                    "modelMatch": {
                        "headers": {"X-User": {"exact": "alice"}, "X-Tier": {"prefix": "gold"}},
                        "uri": {"regex": "^/v1/(chat/)?completions$"},
                        "body": {"model": "llama"},
                    },
                    "targetModels": [
                        {"modelServerName": "ms-a", "weight": 30},
                        {"modelServerName": "ms-b"},
                    ],
                },
                {"targetModels": [{"modelServerName": "ms-a"}]},
            ],
            "rateLimit": {
                "inputTokensPerUnit": 1000,
                "outputTokensPerUnit": 500,
                "unit": "minute",
                "global": {"redis": {"address": "redis:6379"}},
            },
        },
    }


def server_raw() -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "ModelServer",
        "metadata": {"name": "ms", "namespace": "team"},
        "spec": {
            "model": "deepseek",
            "inferenceEngine": "SGLang",
            "workloadSelector": {
                "matchLabels": {"app": "ds"},
                "pdGroup": {
                    "groupKey": "group",
                    "prefillLabels": {"role": "prefill"},
                    "decodeLabels": {"role": "decode"},
                },
            },
            "workloadPort": {"port": 8443, "protocol": "https"},
            "trafficPolicy": {"timeout": "1m30s", "retry": {"attempts": 2, "retryInterval": "2s"}},
            "kvConnector": {"type": "nixl"},
        },
    }


def pod_raw() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "team", "labels": {"app": "ds"}},
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.5",
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": "True"},
            ],
        },
    }


# --------------------------------------------------------------------------- ModelRoute


def test_model_route_every_field() -> None:
    route = parse_object(route_raw())
    assert isinstance(route, ModelRoute)
    meta = route.meta
    assert meta.key == ("team", "r1")
    assert meta.labels == {"app": "x"}
    assert meta.annotations == {"note": "y"}
    assert meta.creation_timestamp == "2024-05-01T12:00:00Z"
    assert meta.resource_version == "42"
    assert meta.uid == "abc"
    assert route.model_name == "llama"
    assert route.lora_adapters == ("sql-lora", "chat-lora")
    assert route.parent_refs == ({"name": "gw", "kind": "Gateway"},)
    first, second = route.rules
    assert first.name == "canary"
    assert [(t.model_server_name, t.weight) for t in first.target_models] == [
        ("ms-a", 30),
        ("ms-b", 100),
    ]
    match = first.model_match
    assert match is not None
    assert set(match.headers) == {"x-user", "x-tier"}  # lower-cased
    assert match.headers["x-user"].exact == "alice"
    assert match.headers["x-tier"].prefix == "gold"
    assert match.uri is not None and isinstance(match.uri.regex, re.Pattern)
    assert match.uri.matches("/v1/chat/completions")
    assert match.body_model == "llama"
    assert second.name == "" and second.model_match is None
    assert route.rate_limit == RateLimit(
        input_tokens_per_unit=1000,
        output_tokens_per_unit=500,
        unit="minute",
        redis_address="redis:6379",
    )


def test_model_route_defaults() -> None:
    raw = route_raw()
    raw["metadata"] = {"name": "r"}
    raw["spec"] = {"loraAdapters": ["a"], "rules": [{"targetModels": [{"modelServerName": "m"}]}],
                   "rateLimit": {"inputTokensPerUnit": 5}}
    route = parse_object(raw)
    assert isinstance(route, ModelRoute)
    assert route.meta.namespace == "default"
    assert route.meta.creation_timestamp == ""
    assert route.model_name is None
    assert route.parent_refs == ()
    assert route.rate_limit == RateLimit(input_tokens_per_unit=5, unit="second")


def test_empty_model_match_matches_everything() -> None:
    raw = route_raw()
    raw["spec"]["rules"][0]["modelMatch"] = {}
    route = parse_object(raw)
    assert isinstance(route, ModelRoute)
    match = route.rules[0].model_match
    assert match is not None
    assert (match.headers, match.uri, match.body_model) == ({}, None, None)


# --------------------------------------------------------------------------- ModelServer


def test_model_server_every_field() -> None:
    server = parse_object(server_raw())
    assert isinstance(server, ModelServer)
    assert server.meta.key == ("team", "ms")
    assert server.model == "deepseek"
    assert server.inference_engine == "SGLang"
    assert server.match_labels == {"app": "ds"}
    assert server.pd_group is not None
    assert server.pd_group.group_key == "group"
    assert server.pd_group.prefill_labels == {"role": "prefill"}
    assert server.pd_group.decode_labels == {"role": "decode"}
    assert server.port == 8443
    assert server.protocol == "https"
    assert server.timeout_s == pytest.approx(90.0)
    assert server.retry_attempts == 2
    assert server.retry_interval_s == pytest.approx(2.0)
    assert server.kv_connector == "nixl"


def test_model_server_defaults() -> None:
    raw = server_raw()
    raw["spec"] = {
        "inferenceEngine": "vLLM",
        "workloadSelector": {"matchLabels": {"app": "x"}},
        "workloadPort": {"port": 8000},
        "trafficPolicy": {"retry": {"attempts": 1}},
        "kvConnector": {},
    }
    server = parse_object(raw)
    assert isinstance(server, ModelServer)
    assert server.model is None
    assert server.pd_group is None
    assert server.protocol == "http"
    assert server.timeout_s is None
    assert server.retry_attempts == 1
    assert server.retry_interval_s == pytest.approx(0.1)  # kubebuilder default "100ms"
    assert server.kv_connector == "http"


@pytest.mark.parametrize("connector", ["http", "nixl", "mooncake", "lmcache"])
def test_every_connector_type(connector: str) -> None:
    raw = server_raw()
    raw["spec"]["kvConnector"]["type"] = connector
    server = parse_object(raw)
    assert isinstance(server, ModelServer) and server.kv_connector == connector


def test_kthena_fixture_parses() -> None:
    docs = [d for d in yaml.safe_load_all(FIXTURE.read_text()) if d]
    route, server = (parse_object(d) for d in docs)
    assert isinstance(route, ModelRoute) and isinstance(server, ModelServer)
    assert route.model_name == "deepseek_v4"
    assert route.rules[0].target_models[0].model_server_name == "deepseekv4-pd"
    assert server.kv_connector == "mooncake"
    assert server.port == 7100
    assert server.timeout_s == 300.0
    assert server.retry_attempts == 3
    assert server.retry_interval_s == pytest.approx(0.15)
    assert server.pd_group is not None
    assert server.pd_group.group_key == "modelserving.volcano.sh/group-name"
    assert CONFIG_EXAMPLE.read_bytes() == FIXTURE.read_bytes()


# --------------------------------------------------------------------------- Pod


def test_ready_pod() -> None:
    pod = parse_object(pod_raw())
    assert isinstance(pod, Pod)
    assert pod.ready and pod.ip == "10.0.0.5"
    assert pod.meta.labels == {"app": "ds"}


def _not_running(raw: dict[str, Any]) -> None:
    raw["status"]["phase"] = "Pending"


def _not_ready(raw: dict[str, Any]) -> None:
    raw["status"]["conditions"][1]["status"] = "False"


def _no_ready_condition(raw: dict[str, Any]) -> None:
    del raw["status"]["conditions"][1]


def _deleting(raw: dict[str, Any]) -> None:
    raw["metadata"]["deletionTimestamp"] = "2024-05-01T12:00:00Z"


def _no_status(raw: dict[str, Any]) -> None:
    del raw["status"]


@pytest.mark.parametrize(
    "mutate", [_not_running, _not_ready, _no_ready_condition, _deleting, _no_status]
)
def test_pod_not_ready(mutate: Callable[[dict[str, Any]], None]) -> None:
    raw = pod_raw()
    mutate(raw)
    pod = parse_object(raw)
    assert isinstance(pod, Pod) and not pod.ready


def test_pod_without_ip() -> None:
    raw = pod_raw()
    del raw["status"]["podIP"]
    pod = parse_object(raw)
    assert isinstance(pod, Pod) and pod.ip is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (dt.datetime(2024, 5, 1, 12, 0, tzinfo=dt.UTC), "2024-05-01T12:00:00Z"),
        (dt.datetime(2024, 5, 1, 12, 0), "2024-05-01T12:00:00Z"),  # naive: UTC
        (
            dt.datetime(2024, 5, 1, 14, 0, tzinfo=dt.timezone(dt.timedelta(hours=2))),
            "2024-05-01T12:00:00Z",
        ),
        ("2024-05-01T14:00:00+02:00", "2024-05-01T12:00:00Z"),
        ("2024-05-01T12:00:00.250Z", "2024-05-01T12:00:00.250000Z"),
        (dt.date(2024, 5, 1), "2024-05-01T00:00:00Z"),
    ],
)
def test_format_timestamp(value: Any, expected: str) -> None:
    assert format_timestamp(value) == expected


def test_creation_timestamp_from_yaml_datetime() -> None:
    text = """
apiVersion: v1
kind: Pod
metadata:
  name: p
  creationTimestamp: 2024-05-01T12:00:00Z
"""
    raw = yaml.safe_load(text)
    assert isinstance(raw["metadata"]["creationTimestamp"], dt.datetime)
    pod = parse_object(raw)
    assert pod.meta.creation_timestamp == "2024-05-01T12:00:00Z"


# --------------------------------------------------------------------------- errors

Mutation = Callable[[dict[str, Any]], object]


def _set(path: str, value: Any) -> Mutation:
    """Set a dotted path (list indices as numbers) in a raw manifest."""

    def mutate(raw: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = raw
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        if value is _DELETE:
            del node[int(last) if last.isdigit() else last]
        else:
            node[int(last) if last.isdigit() else last] = value

    return mutate


_DELETE = object()

ROUTE_ERRORS: list[tuple[str, Mutation, str]] = [
    ("api version", _set("apiVersion", "networking.matrixinfer.ai/v1alpha1"), "apiVersion"),
    ("no metadata", _set("metadata", _DELETE), "metadata: is required"),
    ("no name", _set("metadata.name", _DELETE), "metadata.name: is required"),
    ("label type", _set("metadata.labels.app", 3), "metadata.labels.app: must be a string"),
    ("bad timestamp", _set("metadata.creationTimestamp", "yesterday"), "creationTimestamp"),
    ("no spec", _set("spec", _DELETE), "spec: is required"),
    ("spec type", _set("spec", []), "spec: must be an object"),
    ("no model and no lora", lambda r: (r["spec"].pop("modelName"), r["spec"].pop("loraAdapters")),
     "cannot both be empty"),
    ("too many adapters", _set("spec.loraAdapters", [f"a{i}" for i in range(11)]),
     "at most 10"),
    ("adapter type", _set("spec.loraAdapters", [1]), "spec.loraAdapters[0]: must be a string"),
    ("no rules", _set("spec.rules", _DELETE), "spec.rules: is required"),
    ("empty rules", _set("spec.rules", []), "spec.rules: must have 1 to 16"),
    ("too many rules", _set("spec.rules", [{"targetModels": [{"modelServerName": "m"}]}] * 17),
     "spec.rules: must have 1 to 16"),
    ("no targets", _set("spec.rules.1.targetModels", _DELETE),
     "spec.rules[1].targetModels: is required"),
    ("empty targets", _set("spec.rules.1.targetModels", []), "must have 1 to 16"),
    ("too many targets", _set("spec.rules.1.targetModels", [{"modelServerName": "m"}] * 17),
     "must have 1 to 16"),
    ("no server name", _set("spec.rules.0.targetModels.0.modelServerName", _DELETE),
     "spec.rules[0].targetModels[0].modelServerName: is required"),
    ("weight high", _set("spec.rules.0.targetModels.0.weight", 101), "between 0 and 100"),
    ("weight low", _set("spec.rules.0.targetModels.0.weight", -1), "between 0 and 100"),
    ("weight type", _set("spec.rules.0.targetModels.0.weight", "50"), "must be an integer"),
    ("weight bool", _set("spec.rules.0.targetModels.0.weight", True), "must be an integer"),
    ("two matchers", _set("spec.rules.0.modelMatch.uri", {"exact": "/a", "prefix": "/"}),
     "exactly one of exact, prefix, regex"),
    ("no matcher", _set("spec.rules.0.modelMatch.headers.X-User", {}),
     "modelMatch.headers.X-User: must set exactly one"),
    ("bad regex", _set("spec.rules.0.modelMatch.uri", {"regex": "(unclosed"}),
     "invalid regular expression"),
    ("matcher type", _set("spec.rules.0.modelMatch.uri", {"exact": 5}), "uri.exact: must be a"),
    ("body model type", _set("spec.rules.0.modelMatch.body.model", ["x"]), "body.model"),
    ("parent ref name", _set("spec.parentRefs", [{"kind": "Gateway"}]),
     "spec.parentRefs[0].name: is required"),
    ("rate unit", _set("spec.rateLimit.unit", "week"), "second, minute, hour, day, month"),
    ("rate input zero", _set("spec.rateLimit.inputTokensPerUnit", 0), "between 1 and"),
    ("rate output zero", _set("spec.rateLimit.outputTokensPerUnit", 0), "between 1 and"),
    ("redis address", _set("spec.rateLimit.global.redis", {}), "redis.address: is required"),
]


@pytest.mark.parametrize(
    ("case", "mutate", "reason"), ROUTE_ERRORS, ids=[c[0] for c in ROUTE_ERRORS]
)
def test_model_route_errors(case: str, mutate: Mutation, reason: str) -> None:
    raw = copy.deepcopy(route_raw())
    mutate(raw)
    with pytest.raises(InvalidObject) as info:
        parse_object(raw)
    assert info.value.kind == "ModelRoute"
    assert reason in info.value.reason
    if case not in ("no metadata", "no name"):
        assert info.value.name == "team/r1"


SERVER_ERRORS: list[tuple[str, Mutation, str]] = [
    ("api version", _set("apiVersion", "v1"), "apiVersion"),
    ("no engine", _set("spec.inferenceEngine", _DELETE), "spec.inferenceEngine: is required"),
    ("bad engine", _set("spec.inferenceEngine", "vllm"), "must be one of vLLM, SGLang"),
    ("long model", _set("spec.model", "m" * 257), "at most 256"),
    ("no selector", _set("spec.workloadSelector", _DELETE), "workloadSelector: is required"),
    ("match label type", _set("spec.workloadSelector.matchLabels", {"app": 1}),
     "matchLabels.app: must be a string"),
    ("no group key", _set("spec.workloadSelector.pdGroup.groupKey", _DELETE),
     "pdGroup.groupKey: is required"),
    ("no prefill labels", _set("spec.workloadSelector.pdGroup.prefillLabels", _DELETE),
     "pdGroup.prefillLabels: is required"),
    ("no decode labels", _set("spec.workloadSelector.pdGroup.decodeLabels", {}),
     "pdGroup.decodeLabels: is required"),
    ("no port block", _set("spec.workloadPort", _DELETE), "spec.workloadPort: is required"),
    ("no port", _set("spec.workloadPort.port", _DELETE), "workloadPort.port: is required"),
    ("port zero", _set("spec.workloadPort.port", 0), "between 1 and 65535"),
    ("port high", _set("spec.workloadPort.port", 65536), "between 1 and 65535"),
    ("port type", _set("spec.workloadPort.port", "7100"), "must be an integer"),
    ("protocol", _set("spec.workloadPort.protocol", "grpc"), "must be one of http, https"),
    ("timeout syntax", _set("spec.trafficPolicy.timeout", "5 minutes"), "invalid duration"),
    ("timeout type", _set("spec.trafficPolicy.timeout", 300), "must be a string"),
    ("timeout zero", _set("spec.trafficPolicy.timeout", "0s"), "must be positive"),
    ("attempts negative", _set("spec.trafficPolicy.retry.attempts", -1), "between 0 and"),
    ("attempts type", _set("spec.trafficPolicy.retry.attempts", 1.5), "must be an integer"),
    ("interval syntax", _set("spec.trafficPolicy.retry.retryInterval", "1x"), "invalid duration"),
    ("interval negative", _set("spec.trafficPolicy.retry.retryInterval", "-1s"),
     "must not be negative"),
    ("connector", _set("spec.kvConnector.type", "rdma"),
     "must be one of http, nixl, mooncake, lmcache"),
]


@pytest.mark.parametrize(
    ("case", "mutate", "reason"), SERVER_ERRORS, ids=[c[0] for c in SERVER_ERRORS]
)
def test_model_server_errors(case: str, mutate: Mutation, reason: str) -> None:
    raw = copy.deepcopy(server_raw())
    mutate(raw)
    with pytest.raises(InvalidObject) as info:
        parse_object(raw)
    assert (info.value.kind, info.value.name) == ("ModelServer", "team/ms")
    assert reason in info.value.reason
    assert "ModelServer team/ms" in str(info.value)


POD_ERRORS: list[tuple[str, Mutation, str]] = [
    ("api version", _set("apiVersion", "apps/v1"), "apiVersion"),
    ("ip type", _set("status.podIP", 10), "status.podIP: must be a string"),
    ("ip cut short", _set("status.podIP", "10.0."), "status.podIP: not an IP address"),
    ("ip host name", _set("status.podIP", "pod.local"), "status.podIP: not an IP address"),
    ("status type", _set("status", "Running"), "status: must be an object"),
]


@pytest.mark.parametrize(("case", "mutate", "reason"), POD_ERRORS, ids=[c[0] for c in POD_ERRORS])
def test_pod_errors(case: str, mutate: Mutation, reason: str) -> None:
    raw = copy.deepcopy(pod_raw())
    mutate(raw)
    with pytest.raises(InvalidObject) as info:
        parse_object(raw)
    assert info.value.kind == "Pod" and reason in info.value.reason


def test_unknown_kind_and_non_object() -> None:
    with pytest.raises(InvalidObject, match="unsupported kind"):
        parse_object({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}})
    with pytest.raises(InvalidObject, match="must be an object"):
        parse_object(["not", "a", "dict"])  # type: ignore[arg-type]
