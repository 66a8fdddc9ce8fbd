"""`pdgate serve | up | demo`: the router, a local cluster, and the demo request."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

DEFAULT_PORT = 8080
DEMO_MODEL = "deepseek_v4"
DEMO_QUESTION = "Where is the capital of China?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdgate", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve the OpenAI API")
    source = serve.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", type=Path, help="directory of YAML objects")
    source.add_argument("--kubernetes", action="store_true", help="watch a cluster")
    scope = serve.add_mutually_exclusive_group()
    scope.add_argument("--namespace", help="watch one namespace")
    scope.add_argument("--all-namespaces", action="store_true", help="watch every namespace")
    serve.add_argument("--kubeconfig", help="kubeconfig path (default: in-cluster, then ~)")
    serve.add_argument("--scheduler-config", type=Path, help="scheduler YAML (hot-reloaded)")
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT)
    serve.add_argument("--log-level", default="info")

    for name, text in (("up", "run a local simulated cluster"), ("demo", "send the example")):
        command = commands.add_parser(name, help=text)
        command.add_argument("--config", type=Path, default=Path("config"))
        command.add_argument("--port", type=int, default=DEFAULT_PORT)

    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "warning").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "serve":
        return _serve(args)
    # SIGTERM must unwind like Ctrl-C so the local cluster stops its child processes.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    if args.command == "up":
        return _up(args)
    return _demo(args)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from router.app import PDGateApp
    from router.state import AppState, RouterConfig

    config = RouterConfig(
        config_dir=args.config,
        kubernetes=args.kubernetes,
        namespace=None if args.all_namespaces else args.namespace,
        kubeconfig=args.kubeconfig,
        scheduler_config=args.scheduler_config,
    )
    app = PDGateApp(AppState(config))
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=30,
    )
    return 0


def _up(args: argparse.Namespace) -> int:
    from router.local_cluster import LocalCluster

    with LocalCluster(args.config, args.port, quiet=False) as cluster:
        print(f"pdgate is serving on {cluster.router_url}/v1 with {len(cluster.pods)} "
              "simulated pods; Ctrl-C stops everything.", flush=True)
        cluster.wait()
    return 0


def _demo(args: argparse.Namespace) -> int:
    try:
        import openai
    except ImportError:
        print("pdgate demo needs the openai SDK: pip install 'pdgate[test]'", file=sys.stderr)
        return 1
    from router.local_cluster import LocalCluster

    print(f"Starting the Mooncake master, simulated pods and the router from {args.config}/ ...")
    with LocalCluster(args.config, args.port) as cluster:
        for spec in cluster.pods:
            endpoint = spec.endpoint
            print(f"  pod {endpoint.pod_name:<28} {endpoint.role:<8} group={endpoint.group} "
                  f"{endpoint.ip}:{endpoint.port}")
        client = openai.OpenAI(base_url=f"{cluster.router_url}/v1", api_key="demo")
        raw = client.chat.completions.with_raw_response.create(
            model=DEMO_MODEL,
            messages=[{"role": "user", "content": DEMO_QUESTION}],
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
                  f"{completion.usage.completion_tokens} completion")
        pods = {spec.endpoint.pod_name: spec.endpoint for spec in cluster.pods}
        request_id = raw.headers.get("x-request-id", "")
        for header, verb in (("x-pdgate-prefill-pod", "wrote"), ("x-pdgate-decode-pod", "read")):
            served_by = pods.get(raw.headers.get(header, ""))
            if served_by is None:
                continue
            record = _sim_record(served_by.base_url, request_id)
            if record is not None:
                print(f"   {served_by.pod_name} {verb} {record['blocks']} "
                      "KV block(s) through the Mooncake Store")
    return 0


def _sim_record(base_url: str, request_id: str) -> dict[str, object] | None:
    """The simulated engine's own record of one request (its `/sim/stats` ring)."""
    import json
    import urllib.request

    with urllib.request.urlopen(f"{base_url}/sim/stats", timeout=5) as response:
        stats = json.loads(response.read())
    for record in stats.get("recent", []):
        if request_id and request_id in str(record.get("request_id", "")):
            return dict(record)
    return None
