"""Data-parallel pods: how many vLLM engine ranks a pod runs, which, and how each is reached.

vLLM's `--data-parallel-size N` runs N engine cores (ranks), each with its own GPUs, batch
and prefix cache. The router scores each rank as a target of its own (`router.view`), so
it must know, for every pod of a ModelServer, the ranks it runs and how a request reaches
one of them. vLLM has three ways to serve them, and this module reads which one from the
ModelServer's annotations (and, across nodes, each pod's first rank from the pod):

- `internal` (the default): one API server for all N ranks on one pod; a request names
  its rank with `X-data-parallel-rank: r` (vLLM's `DPLBAsyncMPClient`; without the
  header vLLM's balancer picks by queue length).
- `hybrid` (`--data-parallel-hybrid-lb`, how llm-d's wide-EP guide serves DeepSeek over a
  LeaderWorkerSet): each pod (node) runs `L` of the N ranks, global ranks `s..s+L-1`
  (`--data-parallel-size-local L --data-parallel-start-rank s`), behind an API server of
  its own that serves only those; the header names a LOCAL index 0..L-1 (vLLM indexes
  its local engines with it and, with `local_engines_only`, range-checks it against L).
- `external` (`--data-parallel-external-lb`, or per-rank `--data-parallel-rank R`
  servers): every rank has an API server of its own, here on the ModelServer's port +
  the rank's local index; no header.

Whatever the mode, rank r keeps its GLOBAL rank for the rest: its KV events come on the
events (and replay) port + r, and its `/metrics` series carry `engine="r"`. (Its
KV-connector engine id ends `_dp<local rank>`, and upstream vLLM's Mooncake bootstrap
server lists it under its index among its API server's engines: the router reads both
from the engines, it never spells them.)

vLLM's internal load balancing over several nodes (`--data-parallel-size-local L` without
hybrid) has one API server, on the head node (first rank 0), for all N ranks; the other
nodes run `--headless`. The head pod is then N targets and the others none; but a
headless node's ranks run their engine cores, and so their KV event publishers, on their
own pod: rank r's events come from the pod whose ranks include r, on the ports + r
(`Endpoint.engine_ip`; the view pairs a head with its headless pods within one
deployment: the same role, PD group and LeaderWorkerSet group). Only the headless pods
the ModelServer selects and that are Ready are seen.

Annotations on the ModelServer: `pdgate.io/data-parallel-size` (N, default 1),
`pdgate.io/data-parallel-lb` (`internal`, `hybrid` or `external`),
`pdgate.io/data-parallel-size-local` (L, default N: the ranks each pod runs). A pod's
first rank, when L < N: the pod's `pdgate.io/data-parallel-start-rank` annotation, else
its LeaderWorkerSet `leaderworkerset.sigs.k8s.io/worker-index` label times L (the llm-d
guide's `START_RANK`); a pod with neither is left out (its ranks' events ports and metric
series cannot be known), warned about once by the view.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final, Literal

from router.resources import ModelServer, Pod

log = logging.getLogger("pdgate.view")

DP_SIZE_ANNOTATION: Final = "pdgate.io/data-parallel-size"
DP_LB_ANNOTATION: Final = "pdgate.io/data-parallel-lb"
DP_SIZE_LOCAL_ANNOTATION: Final = "pdgate.io/data-parallel-size-local"
#: On a pod: the global rank of its first engine.
DP_START_RANK_ANNOTATION: Final = "pdgate.io/data-parallel-start-rank"
#: LeaderWorkerSet's label on each pod of a group: 0 for the leader, 1.. for workers.
LWS_WORKER_INDEX_LABEL: Final = "leaderworkerset.sigs.k8s.io/worker-index"
#: LeaderWorkerSet's label shared by every pod of one group (a leader and its workers).
LWS_GROUP_KEY_LABEL: Final = "leaderworkerset.sigs.k8s.io/group-key"
#: The most data-parallel ranks one ModelServer may declare (a pod is up to that many
#: targets).
MAX_DATA_PARALLEL_SIZE: Final = 256

LBMode = Literal["internal", "hybrid", "external"]
_MODES: Final[tuple[LBMode, ...]] = ("internal", "hybrid", "external")


@dataclass(frozen=True, slots=True)
class DataParallel:
    """A ModelServer's data parallelism (see the module docstring): `size` ranks in all,
    `local` of them on each pod (0: all), reached as `mode` says."""

    size: int = 1
    mode: LBMode = "internal"
    local: int = 0

    @property
    def external(self) -> bool:
        """Each rank has an API server of its own (no rank header)."""
        return self.mode == "external"

    @property
    def local_size(self) -> int:
        """The ranks each pod runs."""
        return self.local or self.size

    @property
    def headless_nodes(self) -> bool:
        """Internal load balancing over several nodes: the head pod's API server serves
        every rank, the other pods run theirs headless."""
        return self.mode == "internal" and self.local_size < self.size

    def engine_ranks(self, pod: Pod) -> range:
        """The global ranks whose engine cores run on `pod` (its own `start..start+L-1`,
        served or not); empty when its first rank cannot be known."""
        ranks = self.pod_ranks(pod)
        if ranks is None:
            return range(0)
        start = ranks[0]
        return range(start, start + self.local_size)

    def pod_ranks(self, pod: Pod) -> tuple[int, range] | None:
        """The pod's first global rank and the global ranks its API server serves: its own
        `start..start+L-1`, or, with internal load balancing over several nodes, all N on
        the head pod (start 0) and none on the others (vLLM runs them `--headless`).
        None when the first rank cannot be known or is out of range: the pod is then
        left out (`Snapshot.unranked_pod_keys`)."""
        local = self.local_size
        if local == self.size:
            return 0, range(self.size)
        labels, notes = pod.meta.labels, pod.meta.annotations
        raw = notes.get(DP_START_RANK_ANNOTATION)
        scale = 1
        if raw is None and (raw := labels.get(LWS_WORKER_INDEX_LABEL)) is not None:
            scale = local
        start = _int(raw)
        if start is None or start < 0 or start * scale + local > self.size:
            return None
        start *= scale
        if self.mode == "internal":
            return start, range(self.size) if start == 0 else range(0)
        return start, range(start, start + local)

    def rank_pin(self, rank: int, start: int) -> str | None:
        """The `X-data-parallel-rank` value that reaches global rank `rank` on a pod whose
        first rank is `start`: the rank itself (internal), its local index (hybrid), none
        (external: the address alone does)."""
        if self.mode == "internal":
            return str(rank)
        if self.mode == "hybrid":
            return str(rank - start)
        return None


def data_parallel(server: ModelServer) -> DataParallel:
    """A ModelServer's data parallelism from its annotations; a bad value is warned about
    and read as its default."""
    annotations = server.meta.annotations
    raw = annotations.get(DP_SIZE_ANNOTATION)
    if raw is None:
        return DataParallel()
    key = server.meta.key
    if server.inference_engine.lower() != "vllm":
        log.warning("ModelServer %s: %s is read for vLLM engines only (their rank header, "
                    "ports and metrics); one rank a pod assumed", key, DP_SIZE_ANNOTATION)
        return DataParallel()
    size = _int(raw)
    if size is None or not 1 <= size <= MAX_DATA_PARALLEL_SIZE:
        log.warning("ModelServer %s: %s=%r is not 1..%d; one rank a pod assumed",
                    key, DP_SIZE_ANNOTATION, raw, MAX_DATA_PARALLEL_SIZE)
        return DataParallel()
    mode_raw = annotations.get(DP_LB_ANNOTATION, "internal").strip().lower()
    mode: LBMode = "internal"
    for known in _MODES:
        if mode_raw == known:
            mode = known
    if mode_raw != mode:
        log.warning("ModelServer %s: %s=%r is not internal, hybrid or external; internal "
                    "assumed", key, DP_LB_ANNOTATION, mode_raw)
    local_raw = annotations.get(DP_SIZE_LOCAL_ANNOTATION)
    local = size if local_raw is None else _int(local_raw)
    if local is None or not 1 <= local <= size:
        log.warning("ModelServer %s: %s=%r is not 1..%d; every rank on each pod assumed",
                    key, DP_SIZE_LOCAL_ANNOTATION, local_raw, size)
        local = size
    return DataParallel(size, mode, 0 if local == size else local)


def _int(raw: str | None) -> int | None:
    if raw is None:
        return None
    try:
        return int(raw.strip())
    except ValueError:
        return None
