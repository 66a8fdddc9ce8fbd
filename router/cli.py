"""`pdgate serve | up | demo`: the router, a local cluster, and the demo request."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from router import gc_tuning

if TYPE_CHECKING:
    from router.http.config import EdgeConfig
    from router.local_cluster import LocalCluster
    from router.resilience.config import ResilienceConfig
    from router.security.config import SecurityConfig
    from router.sync.config import SyncConfig

DEFAULT_PORT = 8080
DEMO_MODEL = "deepseek_v4"
DEMO_QUESTION = "Where is the capital of China?"
#: A system prompt long enough for a few full 16-token KV blocks, so the demo shows the
#: blocks prefill wrote to the Mooncake Store and decode read back.
DEMO_SYSTEM = ("You are a geography assistant in a prefill/decode disaggregated cluster: "
               "prefill computed this prompt's KV cache and decode read it from the store.")
DEMO_TIMEOUT_S = 60.0
#: What stops `up` and `demo` in order (SIGHUP: the terminal was closed).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdgate", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve the OpenAI API")
    source = serve.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", type=Path, help="directory of YAML objects")
    source.add_argument("--kubernetes", action="store_true", help="watch a cluster")
    scope = serve.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace", help="watch one namespace (default: the pod's, else the kubeconfig's)"
    )
    scope.add_argument("--all-namespaces", action="store_true", help="watch every namespace")
    serve.add_argument("--kubeconfig", help="kubeconfig path (default: in-cluster, then ~)")
    serve.add_argument("--scheduler-config", type=Path, help="scheduler YAML (hot-reloaded)")
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT)
    serve.add_argument("--log-level", default="info")
    serve.add_argument("--gc-threshold", type=int, default=gc_tuning.DEFAULT_YOUNG_THRESHOLD,
                       help="the garbage collector's young-generation threshold while "
                            "serving, with what start-up built frozen (router/gc_tuning.py); "
                            "0: CPython's defaults")
    serve.add_argument("--busy-poll", type=float, default=0.0, metavar="MS",
                       help="keep the event loop polling instead of sleeping while requests "
                            "are in flight and for MS milliseconds after (router/busy_poll.py):"
                            " less latency at low load on VMs, for up to one core while "
                            "serving; 0 (default): off")
    _add_reliability_flags(serve)
    _add_connection_flags(serve)
    _add_scale_flags(serve)

    for name, text in (("up", "run a local simulated cluster"), ("demo", "send the example")):
        command = commands.add_parser(name, help=text)
        command.add_argument("--config", type=Path, default=Path("config"))
        command.add_argument("--port", type=int, default=DEFAULT_PORT)
        command.add_argument("--log-dir", type=Path,
                             help="children's logs (default: a temporary directory, "
                                  "removed after a clean stop)")
        command.add_argument("--drain-grace", type=float,
                             help="the router's drain grace on stop, seconds (default: "
                                  "serve's)")

    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "warning").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "serve":
        return _serve(args)
    return _local(args)


def _add_reliability_flags(serve: argparse.ArgumentParser) -> None:
    """Flags of `router.resilience` and `router.security` (defaults in their configs)."""
    from router.resilience.config import ResilienceConfig
    from router.security.config import SecurityConfig

    r, s = ResilienceConfig(), SecurityConfig()
    group = serve.add_argument_group("reliability")
    add = group.add_argument
    add("--outlier-failures", type=int, default=r.consecutive_failures,
        help="failures in a row that eject a pod (0: no passive ejection)")
    add("--outlier-base-ejection", type=float, default=r.base_ejection_s,
        help="first ejection, seconds (doubles while the pod keeps failing)")
    add("--outlier-max-ejection", type=float, default=r.max_ejection_s,
        help="longest ejection, seconds")
    add("--health-check-interval", type=float, default=r.health_interval_s,
        help="seconds between active health checks of every pod (0: off)")
    add("--health-check-timeout", type=float, default=r.health_timeout_s)
    add("--health-check-path", default=r.health_path)
    add("--unhealthy-threshold", type=int, default=r.unhealthy_threshold,
        help="failed health checks in a row that eject a pod")
    add("--max-inflight", type=int, default=r.max_inflight,
        help="requests in flight at once (default: --inflight-per-pod x the aggregated and "
             "decode pods; 0: unbounded, no adaptive limit either)")
    add("--inflight-per-pod", type=int, default=r.inflight_per_pod,
        help="what one engine runs at once, to size the default bound (vLLM's max_num_seqs)")
    add("--loop-lag-target", type=float, default=r.loop_lag_target_s * 1e3,
        help="ms of event-loop lag above which the adaptive limit sheds load (0: off)")
    add("--min-inflight", type=int, default=r.min_inflight,
        help="the adaptive limit's floor")
    add("--max-inflight-per-model", type=int, default=r.max_inflight_per_model,
        help="requests in flight at once per model (0: unbounded)")
    add("--max-queue", type=int, default=r.max_queue,
        help="requests waiting for admission beyond those bounds (then 503)")
    add("--queue-timeout", type=float, default=r.queue_timeout_s,
        help="seconds a request may wait for admission")
    add("--retry-budget-percent", type=float, default=r.retry_budget_percent,
        help="retries in flight may reach this %% of the requests in flight (Envoy's budget)")
    add("--retry-min-concurrency", type=int, default=r.retry_min_concurrency,
        help="retries allowed in flight whatever the budget says")
    add("--drain-grace", type=float, default=r.drain_grace_s,
        help="seconds requests in flight get to finish after SIGTERM")
    add("--drain-delay", type=float, default=r.drain_delay_s,
        help="seconds /readyz reports false before the drain wait starts")
    group = serve.add_argument_group("security")
    add = group.add_argument
    add("--api-keys", type=Path,
        help="file of client API keys (one a line) or a directory of them (a mounted Secret)")
    add("--api-keys-reload", type=float, default=s.api_keys_reload_s,
        help="seconds between checks of the API key files for changes")
    add("--admin-port", type=int, help="serve /metrics, /healthz and /readyz on this port")
    add("--max-body-bytes", type=int, default=s.max_body_bytes)
    add("--max-header-bytes", type=int, default=s.max_header_bytes)
    add("--max-headers", type=int, default=s.max_headers)


def _add_connection_flags(serve: argparse.ArgumentParser) -> None:
    """Flags of `router.http` (the HTTP edge; defaults and their reasons in its config)."""
    from router.http.config import EdgeConfig

    e = EdgeConfig()
    group = serve.add_argument_group("client connections")
    add = group.add_argument
    add("--header-timeout", type=float, default=e.header_timeout_s,
        help="seconds a client gets to send a request's head (then 408, closed)")
    add("--body-timeout", type=float, default=e.body_timeout_s,
        help="seconds a client gets to send a whole request body (then 408, closed)")
    add("--idle-timeout", type=float, default=e.idle_timeout_s,
        help="seconds an idle keep-alive connection stays open")
    add("--max-connections", type=int, default=e.max_connections,
        help="open client connections per listener (beyond: 503, closed)")


def _add_scale_flags(serve: argparse.ArgumentParser) -> None:
    """Flags of `router.sync`: workers on this host, peer replicas (README "Running more
    than one")."""
    from router.sync.config import DEFAULT_HEARTBEAT_S, DEFAULT_PLACE_TIMEOUT_S, DEFAULT_TTL_S

    group = serve.add_argument_group("running more than one")
    add = group.add_argument
    add("--workers", default="1",
        help="router processes on this port (SO_REUSEPORT), sharing load and cache state; "
             "'auto': the CPUs this container may use (default 1)")
    add("--sync-port", type=int,
        help="TCP port on which this replica shares its state with its peers")
    add("--peers", default="",
        help="peer replicas, host:port[,host:port...] (their --sync-port)")
    add("--peer-service",
        help="headless Service whose EndpointSlices list the peer replicas (Kubernetes)")
    add("--sync-ttl", type=float, default=DEFAULT_TTL_S,
        help="seconds of silence after which a peer is lost and its in-flight counts expire")
    add("--sync-heartbeat", type=float, default=DEFAULT_HEARTBEAT_S,
        help="seconds between heartbeats to the peers")
    add("--sync-place-timeout", type=float, default=DEFAULT_PLACE_TIMEOUT_S,
        help="seconds a new prompt waits for the leader process to place it before this "
             "one does (0: every process places its own new prompts)")


def _sync_config(args: argparse.Namespace, namespace: str | None) -> SyncConfig | None:
    """This process's place among workers and replicas; None when it is on its own."""
    import os

    from router.sync.config import SyncConfig
    from router.sync.peers import parse_peers
    from router.sync.workers import new_host_id, worker_place

    place = worker_place()
    host_id, index, count = place if place is not None else (new_host_id(), 0, 1)
    config = SyncConfig(
        host_id=host_id, worker=index, workers=count, sync_port=args.sync_port,
        peers=parse_peers(args.peers), peer_service=args.peer_service, namespace=namespace,
        kubeconfig=args.kubeconfig, own_address=os.environ.get("POD_IP"),
        heartbeat_s=args.sync_heartbeat, ttl_s=args.sync_ttl,
        place_timeout_s=args.sync_place_timeout,
    )
    config.validate()
    return config if config.enabled else None


def _edge_config(args: argparse.Namespace, security: SecurityConfig) -> EdgeConfig:
    from router.http.config import EdgeConfig, head_bytes_bound

    return EdgeConfig(
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        idle_timeout_s=args.idle_timeout,
        max_connections=args.max_connections,
        max_head_bytes=head_bytes_bound(security.max_header_bytes, security.max_headers),
        max_body_bytes=security.max_body_bytes,
    )


def _reliability_configs(
    args: argparse.Namespace,
) -> tuple[ResilienceConfig, SecurityConfig]:
    from router.resilience.config import ResilienceConfig
    from router.security.config import SecurityConfig

    resilience = ResilienceConfig(
        consecutive_failures=args.outlier_failures,
        base_ejection_s=args.outlier_base_ejection,
        max_ejection_s=args.outlier_max_ejection,
        health_interval_s=args.health_check_interval,
        health_timeout_s=args.health_check_timeout,
        health_path=args.health_check_path,
        unhealthy_threshold=args.unhealthy_threshold,
        max_inflight=args.max_inflight,
        inflight_per_pod=args.inflight_per_pod,
        loop_lag_target_s=args.loop_lag_target / 1e3,
        min_inflight=args.min_inflight,
        max_inflight_per_model=args.max_inflight_per_model,
        max_queue=args.max_queue,
        queue_timeout_s=args.queue_timeout,
        retry_budget_percent=args.retry_budget_percent,
        retry_min_concurrency=args.retry_min_concurrency,
        drain_grace_s=args.drain_grace,
        drain_delay_s=args.drain_delay,
    )
    security = SecurityConfig(
        api_keys=args.api_keys,
        api_keys_reload_s=args.api_keys_reload,
        admin_port=args.admin_port,
        max_body_bytes=args.max_body_bytes,
        max_header_bytes=args.max_header_bytes,
        max_headers=args.max_headers,
    )
    return resilience, security


def _log_build() -> None:
    """Say whether the scheduling hot path runs compiled (setup.py); warn of a stale build."""
    from router.build import stale_modules, summary

    log = logging.getLogger("pdgate.build")
    log.info("scheduling hot path: %s", summary())
    stale = stale_modules()
    if stale:
        log.warning("compiled modules older than their source (run `make setup`): %s",
                    ", ".join(stale))


def _serve(args: argparse.Namespace) -> int:
    from router.app import PDGateApp
    from router.http import FD_RESERVE, Edge, ensure_fd_limit
    from router.resilience.runner import DrainingRunner
    from router.state import AppState, RouterConfig
    from router.sync.workers import (
        Supervisor,
        exit_with_supervisor,
        parse_workers,
        reuseport_socket,
        worker_place,
    )
    from router.tokenization.offload import single_threaded_library
    from router.upstream import MAX_CONNECTIONS as UPSTREAM_MAX_CONNECTIONS

    try:
        resilience, security = _reliability_configs(args)
        edge = _edge_config(args, security)
        workers = parse_workers(args.workers)
        if args.busy_poll < 0:
            raise ValueError("--busy-poll must not be negative")
    except ValueError as exc:
        print(f"pdgate serve: {exc}", file=sys.stderr)
        return 2
    if workers > 1 and worker_place() is None:
        return Supervisor(args.argv, workers).run()
    if worker_place() is not None:
        exit_with_supervisor()
    _log_build()
    namespace = None if args.all_namespaces else args.namespace
    if (args.kubernetes or args.peer_service) and namespace is None and not args.all_namespaces:
        from router.sources.kube_api import default_namespace

        namespace = default_namespace(args.kubeconfig)  # as kubectl: the pod's or context's
    try:
        sync = _sync_config(args, namespace)
    except ValueError as exc:
        print(f"pdgate serve: {exc}", file=sys.stderr)
        return 2
    config = RouterConfig(
        config_dir=args.config,
        kubernetes=args.kubernetes,
        namespace=namespace,
        kubeconfig=args.kubeconfig,
        scheduler_config=args.scheduler_config,
        resilience=resilience,
        security=security,
        sync=sync,
        busy_poll_s=args.busy_poll / 1e3,
    )
    single_threaded_library()  # before any tokenizer is loaded
    try:
        state = AppState(config)
    except OSError as exc:  # e.g. the API key file cannot be read
        print(f"pdgate serve: {exc}", file=sys.stderr)
        return 2
    app = PDGateApp(state)
    listeners = 1 if args.admin_port is None else 2
    ensure_fd_limit(edge.max_connections * listeners + UPSTREAM_MAX_CONNECTIONS + FD_RESERVE)
    shared = sync is not None and sync.workers > 1
    sockets = (
        reuseport_socket(args.host, args.port) if shared else None,
        reuseport_socket(args.host, args.admin_port)
        if shared and args.admin_port is not None else None,
    )
    runner = DrainingRunner(
        app,
        app.ops,
        host=args.host,
        port=args.port,
        admin_port=args.admin_port,
        log_level=args.log_level,
        drain=state.resilience.drain,
        config=config.resilience,
        edge=Edge(edge, state.registry, app.early_shed),
        sockets=sockets,
    )
    gc_tuning.tune(args.gc_threshold)  # all of the above lives as long as the process
    return runner.run()


def _local(args: argparse.Namespace) -> int:
    """`up` and `demo`: own a local cluster; 0 after a clean stop, 1 if a child failed.

    SIGTERM, SIGINT and SIGHUP (a closed terminal) all stop the cluster in order; a
    second one cuts the router's drain short, a third kills every child.
    """
    if args.command == "demo":
        try:
            import openai  # noqa: F401
        except ImportError:
            print("pdgate demo needs the openai SDK: pip install 'pdgate[test]'",
                  file=sys.stderr)
            return 1
        print(f"Starting the Mooncake master, simulated pods and the router from "
              f"{args.config}/ ...", flush=True)
    from engine_sim.mooncake_master import MooncakeMasterError
    from router.local_cluster import ChildFailed, Interrupted, LocalCluster, UnsupportedConfig

    cluster = LocalCluster(args.config, args.port, args.log_dir, args.drain_grace)
    for signum in STOP_SIGNALS:
        signal.signal(signum, cluster.request_stop)
    failure: str | None = None
    try:
        with cluster:
            try:
                if args.command == "up":
                    _up(cluster)
                else:
                    _demo(cluster)
            except ChildFailed as exc:
                # Say it at once: stopping the rest may take the router's drain.
                print(f"pdgate {args.command}: {exc}\nStopping the rest of the cluster.",
                      file=sys.stderr, flush=True)
                return 1
    except ChildFailed as exc:
        failure = str(exc)
    except MooncakeMasterError as exc:
        failure = f"the Mooncake master failed to start: {exc}"
    except UnsupportedConfig as exc:
        failure = str(exc)
    except Interrupted:
        print("Stopped while starting.", flush=True)
    if failure is not None:
        print(f"pdgate {args.command}: {failure}", file=sys.stderr, flush=True)
        return 1
    if args.command == "up":
        print("Stopped.", flush=True)
    cluster.remove_logs()
    return 0


def _up(cluster: LocalCluster) -> None:
    print(f"pdgate is serving on {cluster.router_url}/v1 with {len(cluster.pods)} "
          f"simulated pods; logs in {cluster.log_dir}; Ctrl-C stops everything.", flush=True)
    cluster.watch()
    print(f"Stopping: the router drains first (up to {cluster.drain_grace_s:g} s; a second "
          "Ctrl-C cuts it short), then the pods and the Mooncake master.", flush=True)


def _demo(cluster: LocalCluster) -> None:
    import openai

    for spec in cluster.pods:
        endpoint = spec.endpoint
        print(f"  pod {endpoint.pod_name:<28} {endpoint.role:<8} group={endpoint.group} "
              f"{endpoint.ip}:{endpoint.port}")
    client = openai.OpenAI(base_url=f"{cluster.router_url}/v1", api_key="demo",
                           timeout=DEMO_TIMEOUT_S)
    raw = client.chat.completions.with_raw_response.create(
        model=DEMO_MODEL,
        messages=[{"role": "system", "content": DEMO_SYSTEM},
                  {"role": "user", "content": DEMO_QUESTION}],
        stream=False,
    )
    completion = raw.parse()
    print(f"\nQ: {DEMO_QUESTION}")
    print(f"A: {completion.choices[0].message.content}")
    print(f"   prefill pod: {raw.headers.get('x-pdgate-prefill-pod')}")
    print(f"   decode pod:  {raw.headers.get('x-pdgate-decode-pod')}")
    print(f"   request id:  {raw.headers.get('x-request-id')}")
    if completion.usage is not None:
        print(f"   tokens: {completion.usage.prompt_tokens} prompt, "
              f"{completion.usage.completion_tokens} completion "
              "(the engines' real DeepSeek tokenizer)")
    first = cluster.pods[0].endpoint if cluster.pods else None
    tokenized = None if first is None else _tokenize(
        first.base_url, [{"role": "system", "content": DEMO_SYSTEM},
                         {"role": "user", "content": DEMO_QUESTION}]
    )
    if tokenized is not None:
        strs = tokenized.get("token_strs") or []
        print(f"   the prompt as the engine tokenizes it ({tokenized.get('count')} tokens): "
              + " ".join(str(s) for s in strs))
    pods = {spec.endpoint.pod_name: spec.endpoint for spec in cluster.pods}
    request_id = raw.headers.get("x-request-id", "")
    for header, verb in (("x-pdgate-prefill-pod", "wrote"), ("x-pdgate-decode-pod", "read")):
        label = raw.headers.get(header, "")
        name, _, rank = label.partition("/dp")  # a data-parallel pod's rank: "<pod>/dp<r>"
        served_by = pods.get(name)
        if served_by is None:
            continue
        record = _sim_record(served_by.base_url + (f"/sim/stats?rank={rank}" if rank else
                                                   "/sim/stats"), request_id)
        if record is not None:
            print(f"   {label} {verb} {record['blocks']} KV block(s) through the Mooncake Store")


def _tokenize(base_url: str, messages: list[dict[str, str]]) -> dict[str, Any] | None:
    """An engine's vLLM `/tokenize` answer for a chat (None if it cannot be had)."""
    import json
    import urllib.request

    body = json.dumps({"messages": messages, "return_token_strs": True}).encode()
    request = urllib.request.Request(
        f"{base_url}/tokenize", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            answer = json.loads(response.read())
    except (OSError, ValueError):
        return None
    return answer if isinstance(answer, dict) else None


def _sim_record(stats_url: str, request_id: str) -> dict[str, object] | None:
    """The simulated engine's own record of one request (its `/sim/stats` ring)."""
    import json
    import urllib.request

    with urllib.request.urlopen(stats_url, timeout=5) as response:
        stats = json.loads(response.read())
    for record in stats.get("recent", []):
        if request_id and request_id in str(record.get("request_id", "")):
            return dict(record)
    return None
