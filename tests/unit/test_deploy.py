"""deploy/: the Helm chart renders (with Helm's own renderer), and what it renders, like
the plain manifests in deploy/manifests/, is what Kubernetes needs: well-formed objects,
selectors that select, RBAC that grants exactly what the router calls, a Deployment whose
args the CLI accepts and whose shutdown budget covers the router's drain (`drain.seconds`,
passed as `--drain-grace`).
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CHART = DEPLOY / "helm" / "pdgate"
DRAIN_S = 30

CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")

#: Chart values worth rendering: defaults, namespaced, and everything switched on.
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "namespaced": {"scope": {"clusterWide": False, "namespace": "models"}},
    "everything": {
        "replicas": 3,
        "image": {"repository": "registry.example.com/pdgate", "tag": "1.2.3"},
        "router": {
            "schedulerConfig": {"weights": {"prefix": 2}},
            "extraArgs": ["--host", "0.0.0.0"],
            "env": [{"name": "EXTRA", "value": "1"}],
        },
        "metrics": {"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True}},
        "grafanaDashboard": {"namespace": "monitoring"},
        "drain": {"seconds": 45, "preStopSleepSeconds": 10},
    },
    "single": {"replicas": 1, "rbac": {"create": False},
               "serviceAccount": {"create": False, "name": "existing"}},
    "autoscaled": {"autoscaling": {"enabled": True, "targetInflightPerPod": 32},
                   "scaleOut": {"workers": "auto", "podAntiAffinity": "hard"}},
}


def _render_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deploy_render", DEPLOY / "render.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def render() -> ModuleType:
    pytest.importorskip("helm_python", reason="helm-python-sdk renders the chart")
    return _render_module()


@pytest.fixture(scope="module")
def rendered(render: ModuleType) -> dict[str, list[dict[str, Any]]]:
    return {name: render.render(values) for name, values in VALUE_SETS.items()}


def plain_manifest_docs() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in sorted((DEPLOY / "manifests").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path.name, doc


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = by_kind(docs, kind)
    return doc


def assert_well_formed(doc: dict[str, Any]) -> None:
    where = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    assert isinstance(doc.get("apiVersion"), str) and doc["apiVersion"], where
    assert isinstance(doc.get("kind"), str) and doc["kind"], where
    meta = doc["metadata"]
    assert DNS_SUBDOMAIN.match(meta["name"]), where
    if doc["kind"] in CLUSTER_SCOPED:
        assert "namespace" not in meta, f"{where}: cluster-scoped with a namespace"
    else:
        assert DNS_LABEL.match(meta.get("namespace", "")), f"{where}: needs a namespace"
    for key, value in (meta.get("labels") or {}).items():
        assert isinstance(value, str) and LABEL_VALUE.match(value), f"{where}: label {key}"


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def check_release(docs: list[dict[str, Any]], values: dict[str, Any]) -> None:
    """Everything one rendered release must satisfy to apply and run."""
    for doc in docs:
        assert_well_formed(doc)
    deploy = one(docs, "Deployment")
    pod = deploy["spec"]["template"]
    pod_labels = pod["metadata"]["labels"]
    assert selects(deploy["spec"]["selector"]["matchLabels"], pod_labels)
    spec = pod["spec"]
    (container,) = spec["containers"]
    assert DNS_LABEL.match(container["name"]) and container["image"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    sync_port = values.get("scaleOut", {}).get("syncPort", 8090)
    assert ports == {"http": 8080, "sync": sync_port}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["args"][:2] == ["serve", "--kubernetes"]
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"][
        "memory"
    ]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert isinstance(spec["securityContext"]["runAsUser"], int)
    assert spec["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    mounts = {m["name"] for m in container["volumeMounts"]}
    assert mounts <= {v["name"] for v in spec["volumes"]}
    assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    drain = values.get("drain", {}).get("seconds", DRAIN_S)
    args = container["args"]
    assert float(args[args.index("--drain-grace") + 1]) == drain, "the router drains as long"
    assert spec["terminationGracePeriodSeconds"] > pre_stop + drain, "and is not killed first"

    services = {d["metadata"]["name"]: d for d in by_kind(docs, "Service")}
    name = deploy["metadata"]["name"]
    assert set(services) == {name, f"{name}-peers"}
    service = services[name]
    assert selects(service["spec"]["selector"], pod_labels)
    (port,) = service["spec"]["ports"]
    assert (port["port"], port["targetPort"]) == (80, "http")
    check_peers(services[f"{name}-peers"], container, pod_labels)

    account = spec["serviceAccountName"]
    if values.get("serviceAccount", {}).get("create", True):
        assert one(docs, "ServiceAccount")["metadata"]["name"] == account
    if values.get("rbac", {}).get("create", True):
        check_rbac(docs, account, deploy["metadata"]["namespace"])
    for pdb in by_kind(docs, "PodDisruptionBudget"):
        assert selects(pdb["spec"]["selector"]["matchLabels"], pod_labels)
    for monitor in by_kind(docs, "PodMonitor"):
        assert selects(monitor["spec"]["selector"]["matchLabels"], pod_labels)
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        assert (endpoint["port"], endpoint["path"], endpoint["honorLabels"]) == (
            "http", "/metrics", True
        )
    for monitor in by_kind(docs, "ServiceMonitor"):
        assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
        assert monitor["spec"]["endpoints"][0]["port"] == "http"


def check_peers(
    peers: dict[str, Any], container: dict[str, Any], pod_labels: dict[str, str]
) -> None:
    """Replicas find each other: a headless Service on the sync port, named in the args."""
    assert peers["spec"]["clusterIP"] == "None"
    assert selects(peers["spec"]["selector"], pod_labels)
    (port,) = peers["spec"]["ports"]
    assert (port["name"], port["targetPort"]) == ("sync", "sync")
    args = container["args"]
    assert args[args.index("--peer-service") + 1] == peers["metadata"]["name"]
    assert int(args[args.index("--sync-port") + 1]) == port["port"]
    assert "POD_IP" in {e["name"] for e in container["env"]}


def _peer_rbac(docs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    def peers(d: dict[str, Any]) -> bool:
        return bool(d["metadata"]["name"].endswith("-peers"))

    return ([d for d in by_kind(docs, "Role") if peers(d)],
            [d for d in by_kind(docs, "RoleBinding") if peers(d)])


def check_rbac(docs: list[dict[str, Any]], account: str, namespace: str) -> None:
    (peer_role,), (peer_binding,) = _peer_rbac(docs)
    assert peer_role["metadata"]["namespace"] == namespace
    assert peer_role["rules"] == [{"apiGroups": ["discovery.k8s.io"],
                                   "resources": ["endpointslices"], "verbs": ["list"]}]
    assert peer_binding["roleRef"]["name"] == peer_role["metadata"]["name"]
    assert peer_binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": namespace}
    ]
    docs = [d for d in docs if d not in (peer_role, peer_binding)]
    roles = by_kind(docs, "ClusterRole") + by_kind(docs, "Role")
    bindings = by_kind(docs, "ClusterRoleBinding") + by_kind(docs, "RoleBinding")
    assert len(roles) == 1 and len(bindings) == 1
    role, binding = roles[0], bindings[0]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io", "kind": role["kind"],
        "name": role["metadata"]["name"],
    }
    if role["kind"] == "Role":
        assert binding["metadata"]["namespace"] == role["metadata"]["namespace"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": namespace}
    ]
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    needed = {
        *(("networking.serving.volcano.sh", r, v) for r in ("modelroutes", "modelservers")
          for v in ("get", "list", "watch")),
        *(("", "pods", v) for v in ("get", "list", "watch")),
        ("", "events", "create"),
    }
    assert granted == needed, "least privilege: exactly what the router calls"


@pytest.mark.parametrize("name", VALUE_SETS)
def test_chart_renders_a_valid_release(
    name: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    check_release(rendered[name], VALUE_SETS[name])


def test_scope_switches_rbac_and_args(rendered: dict[str, list[dict[str, Any]]]) -> None:
    cluster, namespaced = rendered["defaults"], rendered["namespaced"]
    args = one(cluster, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" in args and by_kind(cluster, "ClusterRole")
    args = one(namespaced, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--namespace") + 1] == "models"
    (role,) = [r for r in by_kind(namespaced, "Role") if r not in _peer_rbac(namespaced)[0]]
    assert role["metadata"]["namespace"] == "models"
    assert not by_kind(namespaced, "ClusterRole")


def test_more_than_one_replica_out_of_the_box(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Defaults: 2 replicas, a PDB, soft anti-affinity; autoscaled: an HPA owns replicas."""
    defaults = rendered["defaults"]
    deploy = one(defaults, "Deployment")
    assert deploy["spec"]["replicas"] == 2 and one(defaults, "PodDisruptionBudget")
    anti = deploy["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    (term,) = anti["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert not by_kind(defaults, "HorizontalPodAutoscaler")

    scaled = rendered["autoscaled"]
    deploy = one(scaled, "Deployment")
    assert "replicas" not in deploy["spec"]  # the HPA's to set
    hpa = one(scaled, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deploy["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "pdgate_admission_inflight"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "32"}
    pod = deploy["spec"]["template"]["spec"]
    assert pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--workers") + 1] == "auto"
    assert one(scaled, "PodDisruptionBudget")


def test_hpa_scales_on_a_metric_of_router_pods(
    render: ModuleType, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    """A Pods metric is looked up by the `pod` label of its series, so it must name router
    pods. `pdgate_inflight_requests{pod}` names engine pods (the monitors' honorLabels keep
    that label), a PD request counting on two; `pdgate_admission_inflight`, the requests
    one router process admitted, has no labels, so the scrape gives it the router pod's.
    Without targetInflightPerPod the HPA scales on CPU."""
    from prometheus_client import CollectorRegistry

    from router.resilience.admission import Admission
    from router.resilience.config import ResilienceConfig

    (metric,) = one(rendered["autoscaled"], "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    registry = CollectorRegistry()
    Admission(ResilienceConfig(), registry)
    samples = {m.name: m.samples for m in registry.collect()}
    assert [s.labels for s in samples.get(name, [])] == [{}], (
        f"{name}: not the router's per-process gauge without labels"
    )

    cpu = render.render({"autoscaling": {"enabled": True}})
    (metric,) = one(cpu, "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert metric == {"type": "Resource", "resource": {
        "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}}}


def test_optional_pieces(rendered: dict[str, list[dict[str, Any]]]) -> None:
    everything = rendered["everything"]
    deploy = one(everything, "Deployment")
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "registry.example.com/pdgate:1.2.3"
    assert container["args"][-2:] == ["--host", "0.0.0.0"]
    config = next(d for d in by_kind(everything, "ConfigMap") if "scheduler.yaml" in d["data"])
    assert yaml.safe_load(config["data"]["scheduler.yaml"]) == {"weights": {"prefix": 2}}
    assert container["args"][container["args"].index("--scheduler-config") + 1] == (
        "/etc/pdgate/scheduler.yaml"
    )
    assert deploy["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 60
    assert by_kind(everything, "PodMonitor") and by_kind(everything, "ServiceMonitor")
    single = rendered["single"]
    assert not by_kind(single, "PodDisruptionBudget") and not by_kind(single, "ServiceAccount")
    assert not by_kind(single, "ClusterRole")
    assert one(single, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == (
        "existing"
    )


def test_deployment_args_parse_with_the_cli(
    rendered: dict[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from router import cli

    seen: list[Any] = []
    monkeypatch.setattr(cli, "_serve", lambda args: seen.append(args) or 0)
    for name in ("defaults", "namespaced", "everything"):
        container = one(rendered[name], "Deployment")["spec"]["template"]["spec"]["containers"][0]
        assert cli.main(list(container["args"])) == 0
    assert [a.all_namespaces for a in seen] == [True, False, True]
    assert seen[1].namespace == "models" and seen[0].kubernetes
    assert [a.drain_grace for a in seen] == [DRAIN_S, DRAIN_S, 45]


def test_drain_seconds_is_the_routers_drain_grace(render: ModuleType) -> None:
    """drain.seconds sets the router's own drain, not only how long Kubernetes waits: a
    120 s drain that Kubernetes waited for while the router cut requests at its default
    30 s was the bug."""
    docs = render.render({"drain": {"seconds": 120}})
    check_release(docs, {"drain": {"seconds": 120}})
    spec = one(docs, "Deployment")["spec"]["template"]["spec"]
    args = spec["containers"][0]["args"]
    assert args[args.index("--drain-grace") + 1] == "120"
    assert spec["terminationGracePeriodSeconds"] == 5 + 120 + 5  # preStop + drain + margin


def test_chart_lints_clean_and_checks_its_values(render: ModuleType) -> None:
    import helm_python as helm

    report = helm.lint(str(CHART), strict=True)
    assert not report["errors"]
    assert [m for m in report["messages"] if m["severity"] >= 2] == []
    with helm.Chart.load(CHART) as chart:
        assert [c["name"] for c in chart.crds] == [
            "crds/networking.serving.volcano.sh_modelroutes.yaml",
            "crds/networking.serving.volcano.sh_modelservers.yaml",
        ]
        for bad in ({"replicas": "two"}, {"scope": {"clusterwide": True}},
                    {"router": {"port": 0}}):
            with pytest.raises(helm.HelmValuesError):
                chart.validate_schema(bad)


def test_chart_crds_are_the_deploy_crds() -> None:
    for path in (CHART / "crds").glob("*.yaml"):
        assert path.read_bytes() == (DEPLOY / "crds" / path.name).read_bytes()


def test_plain_manifests_are_valid_and_current(render: ModuleType) -> None:
    docs: dict[str, list[dict[str, Any]]] = {}
    for name, doc in plain_manifest_docs():
        docs.setdefault(name, []).append(doc)
    assert sorted(docs) == ["monitoring.yaml", "pdgate-namespaced.yaml", "pdgate.yaml"]
    for name in ("pdgate.yaml", "pdgate-namespaced.yaml"):
        release = [d for d in docs[name] if d["kind"] != "Namespace"]
        check_release(release, {})
        assert one(docs[name], "Namespace")["metadata"]["name"] == "pdgate"
        for doc in docs[name]:
            assert "helm.sh/chart" not in doc["metadata"].get("labels", {})
    for doc in docs["monitoring.yaml"]:
        assert_well_formed(doc)
    current = render.plain_manifests()
    for name, text in current.items():
        assert (DEPLOY / "manifests" / name).read_text() == text, (
            f"deploy/manifests/{name} is stale: run .venv/bin/python deploy/render.py"
        )


def test_plain_manifests_parse_without_helm() -> None:
    """The part that needs no helm-python-sdk: every object is well formed."""
    count = 0
    for _, doc in plain_manifest_docs():
        assert_well_formed(doc)
        count += 1
    assert count >= 10
