"""Builders for the raw objects the fake API server stores (ModelRoute, ModelServer, Pod).

Defaults follow Kthena's PD example (tests/fixtures/kthena-pd-example.yaml): pods
labelled `modelserving.volcano.sh/name=<server>`, `.../group-name=<group>` and
`.../role=prefill|decode`, serving on port 7100.
"""

from __future__ import annotations

from typing import Any

API_VERSION = "networking.serving.volcano.sh/v1alpha1"
NAME_LABEL = "modelserving.volcano.sh/name"
GROUP_LABEL = "modelserving.volcano.sh/group-name"
ROLE_LABEL = "modelserving.volcano.sh/role"


def model_route(
    name: str,
    model_name: str | None,
    targets: list[str] | None = None,
    *,
    namespace: str = "default",
    weights: list[int] | None = None,
    created: str | None = None,
) -> dict[str, Any]:
    servers = targets or [name]
    target_models = [
        {"modelServerName": server, **({"weight": weights[i]} if weights else {})}
        for i, server in enumerate(servers)
    ]
    spec: dict[str, Any] = {"rules": [{"name": "default", "targetModels": target_models}]}
    if model_name is not None:
        spec["modelName"] = model_name
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if created:
        meta["creationTimestamp"] = created
    return {"apiVersion": API_VERSION, "kind": "ModelRoute", "metadata": meta, "spec": spec}


def model_server(
    name: str,
    *,
    model: str = "deepseek_v4",
    namespace: str = "default",
    pd: bool = True,
    match_labels: dict[str, str] | None = None,
    port: int = 7100,
    engine: str = "vLLM",
) -> dict[str, Any]:
    selector: dict[str, Any] = {"matchLabels": match_labels or {NAME_LABEL: name}}
    if pd:
        selector["pdGroup"] = {
            "groupKey": GROUP_LABEL,
            "prefillLabels": {ROLE_LABEL: "prefill"},
            "decodeLabels": {ROLE_LABEL: "decode"},
        }
    return {
        "apiVersion": API_VERSION,
        "kind": "ModelServer",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": model,
            "inferenceEngine": engine,
            "workloadSelector": selector,
            "workloadPort": {"port": port, "protocol": "http"},
            "kvConnector": {"type": "mooncake"},
        },
    }


def pod(
    name: str,
    server: str,
    *,
    role: str | None = "prefill",
    group: str = "g0",
    ip: str = "10.0.0.1",
    namespace: str = "default",
    ready: bool = True,
    extra_labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    labels = {NAME_LABEL: server, GROUP_LABEL: group}
    if role is not None:
        labels[ROLE_LABEL] = role
    labels.update(extra_labels or {})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {"containers": [{"name": "engine", "image": "vllm/vllm-openai"}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def pd_pods(server: str, groups: int, *, namespace: str = "default") -> list[dict[str, Any]]:
    """One prefill and one decode pod per group, with distinct IPs."""
    pods = []
    for g in range(groups):
        for r, role in enumerate(("prefill", "decode")):
            pods.append(
                pod(
                    f"{server}-g{g}-{role}",
                    server,
                    role=role,
                    group=f"g{g}",
                    ip=f"10.{g // 250}.{g % 250}.{r + 1}",
                    namespace=namespace,
                )
            )
    return pods
