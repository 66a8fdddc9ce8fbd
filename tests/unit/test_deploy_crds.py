"""The CRDs in deploy/crds/: structural, and their schemas accept Kthena's objects and
ours while refusing what breaks an enum or a bound, as pdgate's parser does.

The openAPIV3Schema is turned into a JSON Schema the way the API server reads it: the
`x-kubernetes-*` extensions drop out, `format: int32` becomes a range, and, like
`kubectl apply` (server-side field validation is Strict by default), unknown fields are
errors.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from router.resources import MAX_RETRY_ATTEMPTS, InvalidObject, parse_object
from tests.fixtures import KTHENA_PD_EXAMPLE

REPO = Path(__file__).resolve().parents[2]
CRDS = sorted((REPO / "deploy" / "crds").glob("*.yaml"))
FIXTURE = KTHENA_PD_EXAMPLE
JUNCTORS = ("allOf", "anyOf", "oneOf", "not")
INT32 = (-(2**31), 2**31 - 1)


def load_crds() -> dict[str, dict[str, Any]]:
    """kind -> CRD."""
    crds = {}
    for path in CRDS:
        crd = yaml.safe_load(path.read_text())
        crds[crd["spec"]["names"]["kind"]] = crd
    return crds


def open_api_schema(kind: str) -> dict[str, Any]:
    (version,) = load_crds()[kind]["spec"]["versions"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def to_json_schema(node: Any, strict: bool = True) -> Any:
    """An OpenAPI v3 structural schema as a JSON Schema (see the module docstring)."""
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key == "nullable":
            continue
        if key == "properties":
            out[key] = {name: to_json_schema(sub, strict) for name, sub in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = to_json_schema(value, strict)
        elif key in JUNCTORS:
            # Junctor branches only add checks on fields the outer schema declares.
            out[key] = (
                [to_json_schema(v, strict=False) for v in value]
                if isinstance(value, list) else to_json_schema(value, strict=False)
            )
        else:
            out[key] = value
    if node.get("nullable"):
        out["type"] = [node["type"], "null"]
    if node.get("format") == "int32":
        out.setdefault("minimum", INT32[0])
        out.setdefault("maximum", INT32[1])
    if (
        strict
        and "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def validator(kind: str) -> jsonschema.protocols.Validator:
    schema = to_json_schema(open_api_schema(kind))
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft4Validator)
    cls.check_schema(schema)
    return cls(schema)


def crd_objects() -> list[tuple[str, dict[str, Any]]]:
    """Every ModelRoute/ModelServer in the Kthena fixture and in config/."""
    paths = [FIXTURE, *sorted((REPO / "config").glob("**/*.yaml"))]
    found = []
    for path in paths:
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") in ("ModelRoute", "ModelServer"):
                found.append((f"{path.name}:{doc['metadata']['name']}", doc))
    return found


def assert_structural(node: dict[str, Any], path: str = "", in_junctor: bool = False) -> None:
    """Kubernetes' rules for apiextensions.k8s.io/v1 schemas, the ones that bite."""
    if in_junctor:
        for banned in ("type", "description", "default", "additionalProperties", "nullable"):
            assert banned not in node, f"{path}: {banned} inside a junctor"
    elif not node.get("x-kubernetes-int-or-string") and not node.get(
        "x-kubernetes-preserve-unknown-fields"
    ):
        assert "type" in node, f"{path}: every node needs a type"
    assert not ("properties" in node and "additionalProperties" in node), path
    if "default" in node:  # the API server refuses a default its own schema rejects
        plain = {k: v for k, v in node.items() if k != "default"}
        jsonschema.validate(node["default"], to_json_schema(plain))
    for name, sub in node.get("properties", {}).items():
        assert_structural(sub, f"{path}.{name}", in_junctor)
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            assert_structural(node[key], f"{path}.{key}", in_junctor)
    for key in JUNCTORS:
        branches = node.get(key)
        for i, sub in enumerate(branches if isinstance(branches, list) else [branches] * bool(
            branches
        )):
            assert_structural(sub, f"{path}.{key}[{i}]", True)


@pytest.mark.parametrize("path", CRDS, ids=lambda p: p.name)
def test_crd_is_well_formed(path: Path) -> None:
    crd = yaml.safe_load(path.read_text())
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    assert crd["kind"] == "CustomResourceDefinition"
    spec = crd["spec"]
    assert spec["group"] == "networking.serving.volcano.sh"
    assert crd["metadata"]["name"] == f"{spec['names']['plural']}.{spec['group']}"
    assert spec["scope"] == "Namespaced"
    assert spec["names"]["listKind"] == spec["names"]["kind"] + "List"
    versions = spec["versions"]
    assert [v["name"] for v in versions] == ["v1alpha1"]
    assert sum(v["storage"] for v in versions) == 1 and all(v["served"] for v in versions)
    schema = versions[0]["schema"]["openAPIV3Schema"]
    assert schema["type"] == "object"
    assert_structural(schema)


def test_both_crds_present() -> None:
    assert sorted(load_crds()) == ["ModelRoute", "ModelServer"]


def test_field_names_enums_bounds_and_defaults_match_kthena() -> None:
    route = open_api_schema("ModelRoute")["properties"]["spec"]["properties"]
    assert set(route) == {"modelName", "loraAdapters", "parentRefs", "rules", "rateLimit"}
    rule = route["rules"]["items"]["properties"]
    assert set(rule) == {"name", "modelMatch", "targetModels"}
    assert set(rule["modelMatch"]["properties"]) == {"headers", "uri", "body"}
    assert set(rule["modelMatch"]["properties"]["uri"]["properties"]) == {
        "exact", "prefix", "regex"
    }
    weight = rule["targetModels"]["items"]["properties"]["weight"]
    assert (weight["minimum"], weight["maximum"], weight["default"]) == (0, 100, 100)
    rate = route["rateLimit"]["properties"]
    assert rate["unit"]["enum"] == ["second", "minute", "hour", "day", "month"]
    assert rate["unit"]["default"] == "second"
    assert set(rate["global"]["properties"]["redis"]["properties"]) == {"address"}
    assert route["loraAdapters"]["maxItems"] == 10
    assert route["rules"]["maxItems"] == 16

    server = open_api_schema("ModelServer")["properties"]["spec"]["properties"]
    assert set(server) == {
        "model", "inferenceEngine", "workloadSelector", "workloadPort", "trafficPolicy",
        "kvConnector",
    }
    assert server["inferenceEngine"]["enum"] == ["vLLM", "SGLang"]
    assert set(server["workloadSelector"]["properties"]["pdGroup"]["properties"]) == {
        "groupKey", "prefillLabels", "decodeLabels"
    }
    port = server["workloadPort"]["properties"]
    assert (port["port"]["minimum"], port["port"]["maximum"]) == (1, 65535)
    assert port["protocol"]["enum"] == ["http", "https"] and port["protocol"]["default"] == "http"
    retry = server["trafficPolicy"]["properties"]["retry"]["properties"]
    assert retry["retryInterval"]["default"] == "100ms"
    assert (retry["attempts"]["minimum"], retry["attempts"]["maximum"]) == (
        0, MAX_RETRY_ATTEMPTS
    )
    connector = server["kvConnector"]["properties"]["type"]
    assert sorted(connector["enum"]) == ["http", "lmcache", "mooncake", "nixl"]
    assert connector["default"] == "http"


def test_schemas_accept_every_example_object() -> None:
    objects = crd_objects()
    assert {doc["kind"] for _, doc in objects} == {"ModelRoute", "ModelServer"}
    for name, doc in objects:
        errors = [e.message for e in validator(doc["kind"]).iter_errors(doc)]
        assert not errors, f"{name}: {errors}"
        parse_object(copy.deepcopy(doc))  # and pdgate takes them too


def _example(kind: str) -> dict[str, Any]:
    return copy.deepcopy(next(doc for _, doc in crd_objects() if doc["kind"] == kind))


def _set(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """Set a dotted path ("spec.rules.0.name"), creating mappings on the way."""
    *parents, last = path.split(".")
    node: Any = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    if isinstance(node, list):
        node[int(last)] = value
    elif value is _DELETE:
        node.pop(last, None)
    else:
        node[last] = value
    return doc


_DELETE = object()

REJECTED = [
    ("ModelRoute", "spec.rules.0.targetModels.0.weight", 101),
    ("ModelRoute", "spec.rules.0.targetModels.0.weight", -1),
    ("ModelRoute", "spec.rules.0.targetModels", []),
    ("ModelRoute", "spec.rules", []),
    ("ModelRoute", "spec.modelName", _DELETE),  # no modelName and no loraAdapters
    ("ModelRoute", "spec.loraAdapters", [f"a{i}" for i in range(11)]),
    ("ModelRoute", "spec.rateLimit", {"unit": "week"}),
    ("ModelRoute", "spec.rateLimit", {"inputTokensPerUnit": 0}),
    ("ModelRoute", "spec.rateLimit", {"global": {"redis": {}}}),
    ("ModelRoute", "spec.rules.0.modelMatch", {"uri": {"prefix": "/v1", "exact": "/v1"}}),
    ("ModelRoute", "spec.rules.0.modelMatch", {"headers": {"x-user": {}}}),
    ("ModelServer", "spec.inferenceEngine", "TensorRT"),
    ("ModelServer", "spec.inferenceEngine", _DELETE),
    ("ModelServer", "spec.kvConnector.type", "grpc"),
    ("ModelServer", "spec.workloadPort.protocol", "grpc"),
    ("ModelServer", "spec.workloadPort.port", 0),
    ("ModelServer", "spec.workloadPort.port", 65536),
    ("ModelServer", "spec.workloadPort", _DELETE),
    ("ModelServer", "spec.model", "m" * 257),
    ("ModelServer", "spec.trafficPolicy.timeout", "five minutes"),
    ("ModelServer", "spec.trafficPolicy.retry.retryInterval", "100"),
    ("ModelServer", "spec.trafficPolicy.retry.attempts", 6),
    ("ModelServer", "spec.trafficPolicy.retry.attempts", 1_000_000),
    ("ModelServer", "spec.trafficPolicy.retry.attempts", -1),
    ("ModelServer", "spec.workloadSelector.pdGroup.prefillLabels", {}),
    ("ModelServer", "spec.workloadSelector.pdGroup.groupKey", _DELETE),
]


@pytest.mark.parametrize(
    ("kind", "path", "value"), REJECTED, ids=[f"{k}:{p}={v!r:.20}" for k, p, v in REJECTED]
)
def test_schemas_reject_broken_enums_and_bounds(kind: str, path: str, value: Any) -> None:
    doc = _set(_example(kind), path, value)
    assert list(validator(kind).iter_errors(doc)), f"{kind} {path}={value!r} was accepted"
    # The parser agrees: nothing the CRD refuses would have been served anyway.
    with pytest.raises(InvalidObject):
        parse_object(doc)


def test_unknown_fields_are_refused_like_kubectl_strict_validation() -> None:
    doc = _set(_example("ModelServer"), "spec.workloadPort.prot", "http")
    assert list(validator("ModelServer").iter_errors(doc))
