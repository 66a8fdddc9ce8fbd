"""ClusterView: snapshots, batching, duplicates, PD grouping and invalid-object reports."""

from __future__ import annotations

import dataclasses

import pytest

import router.view as view_module
from router.resources import (
    ModelRoute,
    ModelServer,
    ObjectMeta,
    PDGroup,
    Pod,
    Rule,
    TargetModel,
)
from router.view import MAX_INVALID_RECORDS, ClusterView, Snapshot, build_snapshot

PD = PDGroup(
    group_key="group", prefill_labels={"role": "prefill"}, decode_labels={"role": "decode"}
)


def route(
    name: str,
    model: str | None = "m",
    lora: tuple[str, ...] = (),
    created: str = "",
    namespace: str = "default",
    server: str = "ms",
) -> ModelRoute:
    return ModelRoute(
        meta=ObjectMeta(name=name, namespace=namespace, creation_timestamp=created),
        model_name=model,
        lora_adapters=lora,
        rules=(Rule(name="r", target_models=(TargetModel(server),)),),
    )


def server(
    name: str = "ms",
    labels: dict[str, str] | None = None,
    pd: PDGroup | None = None,
    namespace: str = "default",
    port: int = 8000,
    protocol: str = "http",
) -> ModelServer:
    return ModelServer(
        meta=ObjectMeta(name=name, namespace=namespace),
        model=None,
        inference_engine="vLLM",
        match_labels={"app": "x"} if labels is None else labels,
        pd_group=pd,
        port=port,
        protocol=protocol,  # type: ignore[arg-type]
    )


def pod(
    name: str,
    labels: dict[str, str] | None = None,
    ip: str | None = "10.0.0.1",
    ready: bool = True,
    namespace: str = "default",
) -> Pod:
    return Pod(
        meta=ObjectMeta(name=name, namespace=namespace, labels={"app": "x", **(labels or {})}),
        ip=ip,
        ready=ready,
    )


# --------------------------------------------------------------------------- mechanics


def test_apply_publishes_snapshot_and_calls_listeners() -> None:
    view = ClusterView()
    seen: list[Snapshot] = []
    view.subscribe(seen.append)
    view.apply(route("r"))
    assert view.generation == 1
    assert view.snapshot.generation == 1
    assert seen == [view.snapshot]
    assert view.snapshot.model_names() == ["m"]


def test_unchanged_apply_does_not_rebuild() -> None:
    view = ClusterView()
    view.apply(route("r"))
    before = view.snapshot
    view.apply(route("r"))
    assert view.snapshot is before and view.generation == 1


def test_delete() -> None:
    view = ClusterView()
    view.apply(route("r"))
    view.delete("ModelRoute", "default", "r")
    assert view.snapshot.routes_by_model == {} and view.generation == 2
    view.delete("ModelRoute", "default", "r")  # absent: no rebuild
    assert view.generation == 2
    with pytest.raises(ValueError):
        view.delete("ConfigMap", "default", "x")


def test_batch_rebuilds_once() -> None:
    view = ClusterView()
    calls: list[int] = []
    view.subscribe(lambda s: calls.append(s.generation))
    with view.batch():
        view.apply(server())
        view.apply(pod("p1"))
        with view.batch():  # nested: still one rebuild at the outermost exit
            view.apply(pod("p2"))
        assert view.snapshot.servers == {}
    assert calls == [1]
    assert len(view.snapshot.servers[("default", "ms")].aggregated) == 2


def test_batch_rolls_back_on_error() -> None:
    view = ClusterView()
    view.apply(pod("p1"))
    with pytest.raises(RuntimeError), view.batch():
        view.apply(server())
        view.delete("Pod", "default", "p1")
        raise RuntimeError("half an edit")
    assert view.generation == 1
    assert set(view.objects("Pod")) == {("default", "p1")}
    assert view.objects("ModelServer") == {}


def test_replace_all_everywhere_and_in_one_namespace() -> None:
    view = ClusterView()
    view.replace_all("Pod", [pod("a"), pod("b", namespace="other")])
    assert set(view.objects("Pod")) == {("default", "a"), ("other", "b")}
    view.replace_all("Pod", [pod("c", namespace="other")], namespace="other")
    assert set(view.objects("Pod")) == {("default", "a"), ("other", "c")}
    generation = view.generation
    view.replace_all("Pod", [pod("c", namespace="other")], namespace="other")
    assert view.generation == generation  # nothing changed: no rebuild
    view.replace_all("Pod", [])
    assert view.objects("Pod") == {}
    with pytest.raises(ValueError):
        view.replace_all("Pod", [route("r")])


def test_listener_failure_does_not_stop_others() -> None:
    view = ClusterView()
    seen: list[int] = []

    def broken(_: Snapshot) -> None:
        raise RuntimeError("boom")

    view.subscribe(broken)
    view.subscribe(lambda s: seen.append(s.generation))
    view.apply(route("r"))
    assert seen == [1]


def test_report_invalid_is_counted_and_bounded() -> None:
    view = ClusterView()
    for i in range(MAX_INVALID_RECORDS + 10):
        view.report_invalid("ModelServer", f"default/ms{i}", "bad port")
    view.report_invalid("Pod", "default/p", "bad ip")
    assert view.invalid_counts == {"ModelServer": MAX_INVALID_RECORDS + 10, "Pod": 1}
    assert len(view.recent_invalid) == MAX_INVALID_RECORDS
    last = view.recent_invalid[-1]
    assert (last.kind, last.name, last.reason) == ("Pod", "default/p", "bad ip")


# --------------------------------------------------------------------------- routes


def test_duplicate_model_name_resolves_to_oldest() -> None:
    snap = build_snapshot(
        routes=[
            route("new", created="2024-05-02T00:00:00Z"),
            route("old", created="2024-05-01T00:00:00Z"),
            route("older-offset", created="2024-05-01T01:00:00+02:00"),  # 23:00 the day before
        ],
        servers=[],
        pods=[],
    )
    assert snap.routes_by_model["m"].meta.name == "older-offset"


def test_duplicate_tie_breaks_on_namespace_then_name() -> None:
    snap = build_snapshot(
        routes=[route("b"), route("a", namespace="z"), route("a")], servers=[], pods=[]
    )
    winner = snap.routes_by_model["m"]
    assert winner.meta.key == ("default", "a")


def test_file_objects_without_timestamp_count_as_oldest() -> None:
    snap = build_snapshot(
        routes=[route("k8s", created="2020-01-01T00:00:00Z"), route("zfile")],
        servers=[],
        pods=[],
    )
    assert snap.routes_by_model["m"].meta.name == "zfile"


def test_lora_adapters_map_to_route_and_model_name_wins() -> None:
    snap = build_snapshot(
        routes=[
            route("lora-old", model=None, lora=("sql", "base"), created="2024-01-01T00:00:00Z"),
            route("base-new", model="base", created="2024-06-01T00:00:00Z"),
            route("lora-new", model=None, lora=("sql",), created="2024-06-01T00:00:00Z"),
        ],
        servers=[],
        pods=[],
    )
    assert snap.routes_by_model["sql"].meta.name == "lora-old"
    # As in Kthena, a modelName match is looked up before any LoRA adapter match.
    assert snap.routes_by_model["base"].meta.name == "base-new"
    assert snap.model_names() == ["base", "sql"]


def test_losers_of_a_name_are_listed_with_their_winner() -> None:
    snap = build_snapshot(
        routes=[
            route("young", created="2024-06-01T00:00:00Z"),
            route("old", created="2024-01-01T00:00:00Z"),
            route("lora", model=None, lora=("m", "own"), created="2023-01-01T00:00:00Z"),
            route("self", model="s", lora=("s",), created="2024-01-01T00:00:00Z"),
        ],
        servers=[],
        pods=[],
    )
    lost = sorted((s.route.meta.name, s.model, s.winner.meta.name) for s in snap.shadowed)
    # The older LoRA route loses "m" to a modelName (Kthena looks modelNames up first);
    # a route claiming its own modelName as an adapter shadows nothing.
    assert lost == [("lora", "m", "old"), ("young", "m", "old")]
    assert snap.routes_by_model["own"].meta.name == "lora"


# --------------------------------------------------------------------------- servers


def test_aggregated_server_selects_ready_pods_in_namespace() -> None:
    snap = build_snapshot(
        routes=[],
        servers=[server(port=9000, protocol="https")],
        pods=[
            pod("b", ip="10.0.0.2"),
            pod("a", ip="10.0.0.1"),
            pod("not-ready", ready=False),
            pod("no-ip", ip=None),
            pod("other-ns", namespace="other"),
            Pod(meta=ObjectMeta(name="other-app", labels={"app": "y"}), ip="10.0.0.9", ready=True),
        ],
    )
    sp = snap.servers[("default", "ms")]
    assert not sp.is_pd and sp.groups == ()
    assert [e.pod_name for e in sp.aggregated] == ["a", "b"]
    first = sp.aggregated[0]
    assert (first.role, first.group, first.port, first.scheme) == ("both", None, 9000, "https")
    assert first.base_url == "https://10.0.0.1:9000"
    assert first.key == "default/a"


def test_ipv6_base_url() -> None:
    snap = build_snapshot(routes=[], servers=[server()], pods=[pod("a", ip="fd00::1")])
    assert snap.servers[("default", "ms")].aggregated[0].base_url == "http://[fd00::1]:8000"


def test_empty_match_labels_select_whole_namespace() -> None:
    snap = build_snapshot(
        routes=[], servers=[server(labels={})], pods=[pod("a"), pod("b", namespace="o")]
    )
    assert [e.pod_name for e in snap.servers[("default", "ms")].aggregated] == ["a"]


def test_pd_groups_and_ambiguous_pods() -> None:
    pods = [
        pod("g1-p", {"group": "g1", "role": "prefill"}, ip="10.0.1.1"),
        pod("g1-d", {"group": "g1", "role": "decode"}, ip="10.0.1.2"),
        pod("g1-d2", {"group": "g1", "role": "decode"}, ip="10.0.1.3"),
        pod("g0-p", {"group": "g0", "role": "prefill"}, ip="10.0.0.1"),
        pod("g0-d", {"group": "g0", "role": "decode"}, ip="10.0.0.2"),
        pod("g2-p-only", {"group": "g2", "role": "prefill"}),  # group without decode
        pod("no-role", {"group": "g1"}),  # matches neither role
        pod("no-group", {"role": "decode"}),  # lacks the group key
        pod("empty-group", {"group": "", "role": "decode"}),
    ]
    snap = build_snapshot(routes=[], servers=[server(pd=PD)], pods=pods)
    sp = snap.servers[("default", "ms")]
    assert sp.is_pd and sp.aggregated == ()
    assert [g.group for g in sp.groups] == ["g0", "g1"]  # g2 has no decode pod
    g1 = sp.groups[1]
    assert [e.pod_name for e in g1.prefill] == ["g1-p"]
    assert [e.pod_name for e in g1.decode] == ["g1-d", "g1-d2"]
    assert {e.role for e in g1.prefill} == {"prefill"}
    assert {e.role for e in g1.decode} == {"decode"}
    assert {e.group for e in (*g1.prefill, *g1.decode)} == {"g1"}
    assert snap.ambiguous_pod_keys == (
        "default/empty-group", "default/no-group", "default/no-role",
    )
    assert snap.ambiguous_pods == 3


def _with_annotations(ms: ModelServer, **annotations: str) -> ModelServer:
    return dataclasses.replace(
        ms, meta=dataclasses.replace(ms.meta, annotations=annotations)
    )


def test_data_parallel_ranks_are_targets_of_their_own() -> None:
    """vLLM `--data-parallel-size 2` behind one API server: two targets a pod, one
    address, each pinned by its rank; with external load balancing each rank has a port."""
    pods = [pod("p", {"group": "g", "role": "prefill"}, ip="10.0.1.1"),
            pod("d", {"group": "g", "role": "decode"}, ip="10.0.1.2")]
    internal = _with_annotations(server(pd=PD), **{"pdgate.io/data-parallel-size": "2"})
    group = build_snapshot([], [internal], pods).servers[("default", "ms")].groups[0]
    assert [(e.key, e.port, e.dp_rank, e.rank_pin) for e in group.prefill] == [
        ("default/p/dp0", 8000, 0, "0"), ("default/p/dp1", 8000, 1, "1"),
    ]
    assert [e.label for e in group.decode] == ["d/dp0", "d/dp1"]
    assert build_snapshot([], [internal], pods).servers[("default", "ms")].data_parallel.size == 2
    assert {e.base_url for e in group.decode} == {"http://10.0.1.2:8000"}

    external = _with_annotations(server(), **{"pdgate.io/data-parallel-size": "3",
                                               "pdgate.io/data-parallel-lb": "External"})
    ranks = build_snapshot([], [external], [pod("a")]).servers[("default", "ms")].aggregated
    assert [(e.key, e.port, e.rank_pin) for e in ranks] == [
        ("default/a/dp0", 8000, None), ("default/a/dp1", 8001, None),
        ("default/a/dp2", 8002, None),
    ]


def _lws_pod(name: str, worker: int | None = None, start: str | None = None) -> Pod:
    """A pod of a LeaderWorkerSet group (its worker index label) or with its first rank
    annotated."""
    made = pod(name, {} if worker is None else
               {"leaderworkerset.sigs.k8s.io/worker-index": str(worker)},
               ip=f"10.0.2.{10 if worker is None else worker}")
    if start is None:
        return made
    return dataclasses.replace(made, meta=dataclasses.replace(
        made.meta, annotations={"pdgate.io/data-parallel-start-rank": start}))


def test_hybrid_data_parallel_pods_run_their_own_ranks_pinned_by_local_index() -> None:
    """llm-d's wide-EP layout: DP 4 over two pods of 2 (`--data-parallel-hybrid-lb
    --data-parallel-size-local 2 --data-parallel-start-rank worker-index x 2`). Each pod's
    targets are its global ranks (events ports, metric series, labels), each pinned by
    its LOCAL index, as vLLM's hybrid API server reads the header."""
    ms = _with_annotations(server(), **{"pdgate.io/data-parallel-size": "4",
                                        "pdgate.io/data-parallel-size-local": "2",
                                        "pdgate.io/data-parallel-lb": "hybrid"})
    pods = [_lws_pod("leader", 0), _lws_pod("worker", 1)]
    targets = build_snapshot([], [ms], pods).servers[("default", "ms")].aggregated
    assert [(e.key, e.base_url, e.dp_rank, e.rank_pin) for e in targets] == [
        ("default/leader/dp0", "http://10.0.2.0:8000", 0, "0"),
        ("default/leader/dp1", "http://10.0.2.0:8000", 1, "1"),
        ("default/worker/dp2", "http://10.0.2.1:8000", 2, "0"),
        ("default/worker/dp3", "http://10.0.2.1:8000", 3, "1"),
    ]


def test_external_ranks_across_pods_take_ports_by_local_index() -> None:
    """llm-d's per-rank servers (`--data-parallel-rank START+i --port 8200+i`): a pod's
    rank r listens on the port + (r - its first rank), unpinned; the annotation beats
    the LeaderWorkerSet label."""
    ms = _with_annotations(server(port=8200), **{"pdgate.io/data-parallel-size": "4",
                                                 "pdgate.io/data-parallel-size-local": "2",
                                                 "pdgate.io/data-parallel-lb": "external"})
    targets = build_snapshot([], [ms], [_lws_pod("w", 0, start="2")]).servers[
        ("default", "ms")].aggregated
    assert [(e.key, e.port, e.dp_rank, e.rank_pin, e.local_index) for e in targets] == [
        ("default/w/dp2", 8200, 2, None, 0), ("default/w/dp3", 8201, 3, None, 1),
    ]


@pytest.mark.parametrize("start", [None, "x", "-1", "3"])
def test_a_pod_whose_first_rank_is_unknown_or_too_high_is_left_out(start: str | None) -> None:
    ms = _with_annotations(server(), **{"pdgate.io/data-parallel-size": "4",
                                        "pdgate.io/data-parallel-size-local": "2",
                                        "pdgate.io/data-parallel-lb": "hybrid"})
    pods = [_lws_pod("known", 0), _lws_pod("unknown", None, start=start)]
    snap = build_snapshot([], [ms], pods)
    assert [e.key for e in snap.servers[("default", "ms")].aggregated] == [
        "default/known/dp0", "default/known/dp1"]
    assert snap.unranked_pod_keys == ("default/unknown",)


def test_an_unranked_pod_is_warned_about_once_not_at_every_rebuild(
    caplog: pytest.LogCaptureFixture,
) -> None:
    view = ClusterView()
    view.apply(_with_annotations(server(), **{"pdgate.io/data-parallel-size": "4",
                                              "pdgate.io/data-parallel-size-local": "2",
                                              "pdgate.io/data-parallel-lb": "hybrid"}))
    view.apply(_lws_pod("unknown", None))
    for name in ("a", "b", "c"):  # three more rebuilds
        view.apply(_lws_pod(name, 0))
    assert caplog.text.count("pod default/unknown: its first data-parallel rank") == 1
    assert view.snapshot.unranked_pod_keys == ("default/unknown",)


def test_internal_balancing_over_nodes_is_the_head_pods_alone() -> None:
    """`--data-parallel-size-local 2` without hybrid: one API server, on the head node,
    serves all 4 ranks (pinned by the rank); the other node runs headless."""
    ms = _with_annotations(server(), **{"pdgate.io/data-parallel-size": "4",
                                        "pdgate.io/data-parallel-size-local": "2"})
    targets = build_snapshot([], [ms], [_lws_pod("head", 0), _lws_pod("headless", 1)]).servers[
        ("default", "ms")].aggregated
    assert [(e.key, e.rank_pin) for e in targets] == [
        (f"default/head/dp{r}", str(r)) for r in range(4)]


def _grouped(made: Pod, key: str) -> Pod:
    labels = {**made.meta.labels, "leaderworkerset.sigs.k8s.io/group-key": key}
    return dataclasses.replace(made, meta=dataclasses.replace(made.meta, labels=labels))


def test_internal_balancing_over_nodes_finds_each_ranks_engine_on_its_own_pod() -> None:
    """Over nodes, the head's API server serves ranks 2 and 3, but their engine cores (and
    KV event publishers) run on the headless pod of the same LeaderWorkerSet group: each
    head target names the pod its engine runs on, and two groups do not mix."""
    ms = _with_annotations(server(), **{"pdgate.io/data-parallel-size": "4",
                                        "pdgate.io/data-parallel-size-local": "2"})
    pods = [_grouped(_lws_pod("head-a", 0), "a"), _grouped(_lws_pod("headless-a", 1), "a"),
            _grouped(dataclasses.replace(_lws_pod("head-b", 0), ip="10.0.3.0"), "b"),
            _grouped(dataclasses.replace(_lws_pod("headless-b", 1), ip="10.0.3.1"), "b")]
    targets = build_snapshot([], [ms], pods).servers[("default", "ms")].aggregated
    assert [(e.key, e.ip, e.engine_host) for e in targets] == [
        ("default/head-a/dp0", "10.0.2.0", "10.0.2.0"),
        ("default/head-a/dp1", "10.0.2.0", "10.0.2.0"),
        ("default/head-a/dp2", "10.0.2.0", "10.0.2.1"),
        ("default/head-a/dp3", "10.0.2.0", "10.0.2.1"),
        ("default/head-b/dp0", "10.0.3.0", "10.0.3.0"),
        ("default/head-b/dp1", "10.0.3.0", "10.0.3.0"),
        ("default/head-b/dp2", "10.0.3.0", "10.0.3.1"),
        ("default/head-b/dp3", "10.0.3.0", "10.0.3.1"),
    ]


def test_a_headless_rank_no_single_ready_pod_runs_has_no_engine_host() -> None:
    """The headless pod not ready: the head still serves ranks 2 and 3 (vLLM's API server
    answers for them), but where their engines run is unknown; two pods claiming the same
    ranks (no group key to tell their deployments apart) are not guessed between."""
    ms = _with_annotations(server(), **{"pdgate.io/data-parallel-size": "4",
                                        "pdgate.io/data-parallel-size-local": "2"})
    alone = build_snapshot([], [ms], [_lws_pod("head", 0)]).servers[("default", "ms")]
    assert [e.engine_host for e in alone.aggregated] == ["10.0.2.0", "10.0.2.0", None, None]
    twins = [_lws_pod("head", 0), _lws_pod("w1", 1),
             dataclasses.replace(_lws_pod("w2", 1), ip="10.0.2.9")]
    both = build_snapshot([], [ms], twins).servers[("default", "ms")]
    assert [e.engine_host for e in both.aggregated] == ["10.0.2.0", "10.0.2.0", None, None]
    # Two heads: each one's own ranks still run on it.
    heads = [_lws_pod("head", 0), dataclasses.replace(_lws_pod("head2", 0), ip="10.0.2.8")]
    hosts = build_snapshot([], [ms], heads).servers[("default", "ms")]
    assert [e.engine_host for e in hosts.aggregated] == [
        "10.0.2.0", "10.0.2.0", None, None, "10.0.2.8", "10.0.2.8", None, None]


def test_headless_prefill_and_decode_pods_pair_within_their_role_and_group() -> None:
    """PD over nodes: a prefill head's ranks 2 and 3 run on the headless PREFILL pod of
    its group, never on a decode pod sharing the LeaderWorkerSet group key, nor on the
    other group's."""
    pd = PDGroup(group_key="g", prefill_labels={"r": "p"}, decode_labels={"r": "d"})
    ms = _with_annotations(server(pd=pd), **{"pdgate.io/data-parallel-size": "4",
                                             "pdgate.io/data-parallel-size-local": "2"})

    def node(name: str, worker: int, role: str, group: str, ip: str) -> Pod:
        made = _grouped(dataclasses.replace(_lws_pod(name, worker), ip=ip), "k")
        labels = {**made.meta.labels, "g": group, "r": role}
        return dataclasses.replace(made, meta=dataclasses.replace(made.meta, labels=labels))

    pods = [node("p-head", 0, "p", "g0", "10.0.4.0"), node("p-w", 1, "p", "g0", "10.0.4.1"),
            node("d-head", 0, "d", "g0", "10.0.4.2"), node("d-w", 1, "d", "g0", "10.0.4.3"),
            node("p1-head", 0, "p", "g1", "10.0.4.4"), node("d1-head", 0, "d", "g1", "10.0.4.5"),
            node("d1-w", 1, "d", "g1", "10.0.4.6")]
    groups = build_snapshot([], [ms], pods).servers[("default", "ms")].groups
    hosts = {e.key: e.engine_host for g in groups for e in (*g.prefill, *g.decode)}
    assert [hosts[f"default/p-head/dp{r}"] for r in range(4)] == [
        "10.0.4.0", "10.0.4.0", "10.0.4.1", "10.0.4.1"]
    assert [hosts[f"default/d-head/dp{r}"] for r in range(4)] == [
        "10.0.4.2", "10.0.4.2", "10.0.4.3", "10.0.4.3"]
    assert [hosts[f"default/p1-head/dp{r}"] for r in range(4)] == [
        "10.0.4.4", "10.0.4.4", None, None]  # g1 has no headless prefill pod


@pytest.mark.parametrize("notes", [
    {"pdgate.io/data-parallel-size-local": "5", "pdgate.io/data-parallel-lb": "hybrid"},
    {"pdgate.io/data-parallel-size-local": "0", "pdgate.io/data-parallel-lb": "hybrid"},
])
def test_a_local_size_out_of_range_means_every_rank_on_each_pod(
    notes: dict[str, str],
) -> None:
    ms = _with_annotations(server(), **{"pdgate.io/data-parallel-size": "4", **notes})
    targets = build_snapshot([], [ms], [pod("a")]).servers[("default", "ms")].aggregated
    assert [e.dp_rank for e in targets] == [0, 1, 2, 3]


def test_data_parallel_size_is_read_for_vllm_servers_only() -> None:
    """SGLang pins a rank otherwise (and labels its metrics otherwise): one target a pod."""
    sglang = dataclasses.replace(server(), inference_engine="SGLang")
    ms = _with_annotations(sglang, **{"pdgate.io/data-parallel-size": "2"})
    targets = build_snapshot([], [ms], [pod("a")]).servers[("default", "ms")].aggregated
    assert [(e.key, e.dp_rank) for e in targets] == [("default/a", None)]


@pytest.mark.parametrize("size", ["1", "0", "-2", "many", "257"])
def test_one_rank_a_pod_unless_the_size_is_a_number_above_one(size: str) -> None:
    ms = _with_annotations(server(), **{"pdgate.io/data-parallel-size": size})
    targets = build_snapshot([], [ms], [pod("a")]).servers[("default", "ms")].aggregated
    assert [(e.key, e.dp_rank, e.rank_pin) for e in targets] == [("default/a", None, None)]


def test_pod_matching_both_roles_is_left_out() -> None:
    pd = PDGroup(group_key="group", prefill_labels={"role": "prefill"},
                 decode_labels={"tier": "decode"})
    pods = [
        pod("both", {"group": "g", "role": "prefill", "tier": "decode"}),
        pod("p", {"group": "g", "role": "prefill"}),
        pod("d", {"group": "g", "tier": "decode"}),
    ]
    snap = build_snapshot(routes=[], servers=[server(pd=pd)], pods=pods)
    (group,) = snap.servers[("default", "ms")].groups
    assert [e.pod_name for e in group.prefill] == ["p"]
    assert [e.pod_name for e in group.decode] == ["d"]
    assert snap.ambiguous_pods == 1 and snap.ambiguous_pod_keys == ("default/both",)


def test_ambiguous_pod_counted_once_across_servers() -> None:
    snap = build_snapshot(
        routes=[], servers=[server("a", pd=PD), server("b", pd=PD)], pods=[pod("x")]
    )
    assert snap.ambiguous_pods == 1


def test_view_reacts_to_pod_changes() -> None:
    view = ClusterView()
    view.apply(server(pd=PD))
    view.apply(pod("p", {"group": "g", "role": "prefill"}))
    assert view.snapshot.servers[("default", "ms")].groups == ()
    view.apply(pod("d", {"group": "g", "role": "decode"}))
    assert len(view.snapshot.servers[("default", "ms")].groups) == 1
    view.apply(pod("d", {"group": "g", "role": "decode"}, ready=False))
    assert view.snapshot.servers[("default", "ms")].groups == ()


def test_snapshot_build_scales_to_many_pods(monkeypatch: pytest.MonkeyPatch) -> None:
    servers = [server(f"ms{i}", labels={"app": f"a{i}"}, pd=PD) for i in range(50)]
    pods = [
        Pod(
            meta=ObjectMeta(
                name=f"p{i}",
                labels={"app": f"a{i % 50}", "group": f"g{i % 7}",
                        "role": "prefill" if (i // 50) % 2 else "decode"},
            ),
            ip=f"10.0.{i // 250}.{i % 250}",
            ready=True,
        )
        for i in range(2000)
    ]
    checked = 0
    has_labels = view_module._has_labels

    def counting(labels: dict[str, str], required: dict[str, str]) -> bool:
        nonlocal checked
        checked += 1
        return has_labels(labels, required)

    monkeypatch.setattr(view_module, "_has_labels", counting)
    snap = build_snapshot(routes=[], servers=servers, pods=pods)
    assert sum(len(g.prefill) + len(g.decode)
               for s in snap.servers.values() for g in s.groups) == 2000
    # Each server's selector reads only the pods carrying its label (40 each), then each
    # selected pod's role is read (prefill? decode?): three label checks a pod in all,
    # where matching every pod against every server would be 50 x 2,000 checks.
    assert 0 < checked <= 3 * len(pods)
