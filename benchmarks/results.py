"""One record per measured run, and the raw JSON they are written to."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.cluster import PrefixCounters
from benchmarks.specs import RequestResult
from benchmarks.stats import Summary, summarize


@dataclass(slots=True)
class RunRecord:
    """What one run of one workload through one router measured."""

    phase: str  # overhead-latency | overhead-throughput | sweep | scheduling
    mode: str  # pd | agg
    router: str  # display name, e.g. "vllm-router (cache_aware)"
    kind: str  # direct | pdgate | vllm-router | sglang-router
    policy: str | None
    workload: str
    round: int = 0
    concurrency: int | None = None
    offered_rate: float | None = None
    reference_rate: float | None = None  # overload: pdgate's closed-loop maximum
    wall: float = 0.0
    router_cpu_s: float | None = None
    client_cpu_s: float | None = None
    prefix: PrefixCounters | None = None
    results: list[RequestResult] = field(default_factory=list)
    # Streaming: the probe client's streams beside the load (`benchmarks.probe`).
    probe: list[RequestResult] = field(default_factory=list)
    _summary: Summary | None = None

    @property
    def summary(self) -> Summary:
        if self._summary is None:
            self._summary = summarize(self.results, self.wall)
        return self._summary

    @property
    def cpu_per_1k(self) -> float | None:
        """Router CPU seconds per 1,000 successful requests."""
        ok = self.summary.ok
        if self.router_cpu_s is None or ok == 0:
            return None
        return self.router_cpu_s / ok * 1000.0

    @property
    def hit_rate(self) -> float | None:
        return None if self.prefix is None else self.prefix.hit_rate

    def header(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "mode": self.mode,
            "router": self.router,
            "kind": self.kind,
            "policy": self.policy,
            "workload": self.workload,
            "round": self.round,
            "concurrency": self.concurrency,
            "offered_rate": self.offered_rate,
            "reference_rate": self.reference_rate,
            "wall": self.wall,
            "router_cpu_s": self.router_cpu_s,
            "client_cpu_s": self.client_cpu_s,
            "cpu_per_1k": self.cpu_per_1k,
            "prefix_queries": None if self.prefix is None else self.prefix.queries,
            "prefix_hits": None if self.prefix is None else self.prefix.hits,
            "hit_rate": self.hit_rate,
            "summary": self.summary.to_json(),
        }

    def to_json(self) -> dict[str, Any]:
        return {**self.header(), "results": [r.to_json() for r in self.results],
                "probe": [r.to_json() for r in self.probe]}


@dataclass(slots=True)
class RouterResources:
    """Peak memory of one router process over its whole life in one phase."""

    router: str
    mode: str
    phase: str
    peak_rss_bytes: int
    idle_cpu_pct: float | None = None  # % of one core with no traffic (background work)


def write_raw(path: Path, meta: dict[str, Any], runs: list[RunRecord],
              resources: list[RouterResources]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "meta": meta,
        "resources": [
            {"router": r.router, "mode": r.mode, "phase": r.phase,
             "peak_rss_bytes": r.peak_rss_bytes, "idle_cpu_pct": r.idle_cpu_pct}
            for r in resources
        ],
        "runs": [run.to_json() for run in runs],
    }
    path.write_text(json.dumps(payload, separators=(",", ":")))


def read_raw(path: Path) -> tuple[dict[str, Any], list[RunRecord], list[RouterResources]]:
    """What `write_raw` wrote, to re-render reports without re-running."""
    payload = json.loads(path.read_text())
    runs = []
    for raw in payload["runs"]:
        prefix = None
        if raw.get("prefix_queries") is not None:
            prefix = PrefixCounters(raw["prefix_queries"], raw["prefix_hits"])
        runs.append(RunRecord(
            phase=raw["phase"], mode=raw["mode"], router=raw["router"], kind=raw["kind"],
            policy=raw["policy"], workload=raw["workload"], round=raw["round"],
            concurrency=raw["concurrency"], offered_rate=raw["offered_rate"],
            reference_rate=raw.get("reference_rate"),
            wall=raw["wall"], router_cpu_s=raw["router_cpu_s"],
            client_cpu_s=raw["client_cpu_s"], prefix=prefix,
            results=[RequestResult.from_json(r) for r in raw["results"]],
            probe=[RequestResult.from_json(r) for r in raw.get("probe", ())],
        ))  # fmt: skip
    resources = [
        RouterResources(r["router"], r["mode"], r["phase"], r["peak_rss_bytes"],
                        r.get("idle_cpu_pct"))
        for r in payload["resources"]
    ]
    return payload["meta"], runs, resources
