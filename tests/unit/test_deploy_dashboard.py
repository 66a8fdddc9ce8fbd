"""The Grafana dashboard queries only the router's metrics, has the panels operators need,
and ships unchanged in the chart's ConfigMap.

`queried_metrics()` is the hook for the live check (every queried metric present on a
running router's /metrics).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "pdgate-dashboard.json"

#: The router's metric families as exposed (counters with _total), and the histograms.
METRICS = {
    "pdgate_requests_total",
    "pdgate_request_duration_seconds",
    "pdgate_ttft_seconds",
    "pdgate_ttft_phase_seconds",
    "pdgate_inter_token_latency_seconds",
    "pdgate_output_tokens_per_second",
    "pdgate_phase_duration_seconds",
    "pdgate_retries_total",
    "pdgate_inflight_requests",
    "pdgate_upstream_errors_total",
    "pdgate_client_errors_total",
    "pdgate_prefix_cache_hits_total",
    "pdgate_prefix_cache_queries_total",
    "pdgate_admission_inflight",
    "pdgate_admission_limit",
    "pdgate_admission_queue",
    "pdgate_admission_rejected_total",
}
HISTOGRAMS = {
    "pdgate_request_duration_seconds",
    "pdgate_ttft_seconds",
    "pdgate_ttft_phase_seconds",
    "pdgate_inter_token_latency_seconds",
    "pdgate_output_tokens_per_second",
    "pdgate_phase_duration_seconds",
}
_SERIES = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(?=[{\[])")
_PDGATE = re.compile(r"\bpdgate_[a-z0-9_]+\b")


def load_dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def dashboard_queries(dashboard: dict[str, Any] | None = None) -> list[str]:
    """Every PromQL expression: panel targets and query variables."""
    dashboard = dashboard or load_dashboard()
    queries = []
    for panel in dashboard["panels"]:
        queries.extend(t["expr"] for t in panel.get("targets", []))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            queries.append(query["query"] if isinstance(query, dict) else query)
    return queries


def queried_metrics(dashboard: dict[str, Any] | None = None) -> set[str]:
    """Metric names as the router exposes them (`_bucket`/`_sum`/`_count` -> the family)."""
    names = set()
    for query in dashboard_queries(dashboard):
        for name in _PDGATE.findall(query):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            names.add(base if base in HISTOGRAMS else name)
    return names


def test_queries_use_only_router_metrics() -> None:
    queries = dashboard_queries()
    assert queries
    for query in queries:
        assert _PDGATE.search(query), query
        for series in _SERIES.findall(query):  # every series selector is ours
            assert series.startswith("pdgate_"), f"{series} in {query}"
    assert queried_metrics() == METRICS


def test_histograms_are_read_through_buckets_or_as_means() -> None:
    """A histogram is read as quantiles of its buckets, or as a mean (`_sum` / `_count`)."""
    for query in dashboard_queries():
        for name in HISTOGRAMS:
            if re.search(rf"\b{name}_bucket\b", query):
                assert "histogram_quantile" in query, query
            elif re.search(rf"\b{name}_sum\b", query):
                assert "_count" in query, query
            else:
                assert not re.search(rf"\b{name}\b", query), query


def test_model_variable_and_per_model_panels_leave_unknown_models_out() -> None:
    """Requests for no known model carry `model=""`: not in the dropdown, nor under "All"."""
    dashboard = load_dashboard()
    (model,) = [v for v in dashboard["templating"]["list"] if v["name"] == "model"]
    assert 'model!=""' in model["query"]["query"]
    assert model["allValue"] == ".+"  # "All" must not match the empty label
    queries = dashboard_queries(dashboard)
    assert any('model=""' in q for q in queries)  # shown apart, in a panel of their own


def test_panels_cover_what_operators_ask() -> None:
    dashboard = load_dashboard()
    assert dashboard["uid"] and dashboard["title"] == "pdgate"
    titles = {p["title"] for p in dashboard["panels"] if p["type"] != "row"}
    assert titles == {
        "Request rate", "Error rate", "Time to first token", "Where time to first token goes",
        "Inter-token latency", "Output tokens per second per request", "End-to-end latency",
        "Prefill / decode phase time", "In-flight requests per pod and role", "Retries",
        "Upstream errors", "Client errors refused by engines", "Requests for no known model",
        "Prefix-cache hit rate", "Admitted requests and the bound",
        "Requests refused by admission",
    }
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}"


def _dashboard_configmaps(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == "ConfigMap" and "pdgate-dashboard.json" in d["data"]]


def test_chart_and_manifest_embed_the_same_dashboard() -> None:
    text = DASHBOARD.read_text()
    manifest = list(yaml.safe_load_all((REPO / "deploy/manifests/monitoring.yaml").read_text()))
    configmaps = _dashboard_configmaps(manifest)
    pytest.importorskip("helm_python", reason="helm-python-sdk renders the chart")
    import helm_python as helm

    helm.disable_logging()
    with helm.Chart.load(REPO / "deploy/helm/pdgate") as chart:
        rendered = chart.render(values={}, name="pdgate", namespace="pdgate")
    configmaps += _dashboard_configmaps(
        [d for k, v in rendered.items() if k.endswith(".yaml")
         for d in yaml.safe_load_all(v) if d]
    )
    assert len(configmaps) == 2
    for configmap in configmaps:
        assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert configmap["data"]["pdgate-dashboard.json"] == text.rstrip("\n")
