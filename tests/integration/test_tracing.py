"""OpenTelemetry traces of PD requests, received by a real OTLP/HTTP receiver.

The receiver is built here on `opentelemetry-proto` (the OpenTelemetry Collector is not
installable on this machine): an HTTP server on loopback accepting `POST /v1/traces` with
protobuf `ExportTraceServiceRequest` bodies, as the collector does. The router runs as a
subprocess with `OTEL_EXPORTER_OTLP_ENDPOINT` pointing at it and a short batch delay; the
test sends PD requests with the openai SDK and checks the span tree, the chosen pods on
the schedule span, and that both engines received a `traceparent` naming the router's
prefill/decode spans in the same trace (so vLLM's own `--otlp-traces-endpoint` spans join).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import openai
import pytest

from router.tracing import tracing_enabled, tracing_from_env
from tests.integration.harness import (
    SimCluster,
    SimPodSpec,
    free_port,
    get_json,
    loopback_net,
    pod_manifest,
    write_yaml,
)
from tests.integration.test_faults_kit import server_manifests

trace_service = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2")

pytestmark = pytest.mark.integration

MODEL = "sim-trace-model"
NET = loopback_net()
SPECS = [
    SimPodSpec("t-prefill", f"{NET}.11", "prefill", "g0",
               {"app": "trace", "group": "g0", "role": "prefill"}),
    SimPodSpec("t-decode", f"{NET}.12", "decode", "g0",
               {"app": "trace", "group": "g0", "role": "decode"}),
]
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Receiver:
    """An OTLP/HTTP trace receiver: every span it was sent, as plain dicts."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.services: set[str] = set()
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                ok = self.path == "/v1/traces" and self.headers.get(
                    "content-type") == "application/x-protobuf"
                if ok:
                    request = trace_service.ExportTraceServiceRequest()
                    request.ParseFromString(body)
                    receiver.add(request)
                    payload = trace_service.ExportTraceServiceResponse().SerializeToString()
                else:
                    payload = b""
                self.send_response(200 if ok else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, request: Any) -> None:
        with self.lock:
            for resource_spans in request.resource_spans:
                for attr in resource_spans.resource.attributes:
                    if attr.key == "service.name":
                        self.services.add(attr.value.string_value)
                for scope in resource_spans.scope_spans:
                    for span in scope.spans:
                        self.spans.append({
                            "name": span.name,
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent": span.parent_span_id.hex(),
                            "attributes": {a.key: _value(a.value) for a in span.attributes},
                        })

    def trace(self, trace_id: str, names: set[str], timeout: float = 10.0
              ) -> list[dict[str, Any]]:
        """The spans of one trace once every name in `names` has arrived."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                spans = [s for s in self.spans if s["trace_id"] == trace_id]
            if names <= {s["name"] for s in spans} or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)


def _value(value: Any) -> Any:
    return getattr(value, value.WhichOneof("value")) if value.WhichOneof("value") else None


@pytest.fixture(scope="module")
def traced(mooncake_master: object, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[SimCluster, int, Receiver]]:
    receiver = Receiver()
    receiver.thread.start()
    sim = SimCluster(mooncake_master, tmp_path_factory.mktemp("tracing"))
    port = free_port([spec.ip for spec in SPECS])
    try:
        for spec in SPECS:
            sim.start_pod(spec, port, MODEL, ["--fast"])
        sim.wait_pods(port, SPECS)
        write_yaml(sim.config_dir / "server.yaml",
                   server_manifests("trace", MODEL, app="trace", port=port))
        write_yaml(sim.config_dir / "pods.yaml", [pod_manifest(s) for s in SPECS])
        sim.start_router(env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_SERVICE_NAME": "pdgate-under-test",
            "OTEL_TRACES_SAMPLER": "parentbased_always_on",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
        })
        yield sim, port, receiver
    finally:
        sim.stop()
        receiver.server.shutdown()


def _traceparents(traced: tuple[SimCluster, int, Receiver], pod: str, request_id: str
                  ) -> list[str]:
    ip = next(s.ip for s in SPECS if s.name == pod)
    stats = get_json(f"http://{ip}:{traced[1]}/sim/stats")
    assert isinstance(stats, dict)
    return [t["traceparent"] for t in stats["traceparents"] if t["request_id"] == request_id]


SPAN_NAMES = {"pdgate.request", "route", "schedule", "prefill", "kv_handoff", "decode",
              "relay"}


def _check_tree(spans: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    by_name = {s["name"]: s for s in spans}
    assert set(by_name) == SPAN_NAMES, [s["name"] for s in spans]
    assert len(spans) == len(SPAN_NAMES)  # one attempt: each step once
    root = by_name["pdgate.request"]
    for name in ("route", "schedule", "prefill", "kv_handoff", "decode"):
        assert by_name[name]["parent"] == root["span_id"], name
    assert by_name["relay"]["parent"] == by_name["decode"]["span_id"]
    schedule = by_name["schedule"]["attributes"]
    assert schedule["pdgate.prefill.pod"] == "t-prefill"
    assert schedule["pdgate.decode.pod"] == "t-decode"
    assert isinstance(schedule["pdgate.prefill.cost"], float)
    assert isinstance(schedule["pdgate.decode.cost"], float)
    assert by_name["prefill"]["attributes"]["pdgate.pod"] == "t-prefill"
    assert by_name["decode"]["attributes"]["pdgate.pod"] == "t-decode"
    assert by_name["route"]["attributes"]["pdgate.model_server"] == "default/trace"
    assert root["attributes"]["http.response.status_code"] == 200
    return by_name


async def test_pd_request_continues_the_client_trace(
    traced: tuple[SimCluster, int, Receiver]
) -> None:
    client = openai.AsyncOpenAI(base_url=f"{traced[0].router_url}/v1", api_key="unused",
                                max_retries=0)
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Trace me, please."}],
        max_tokens=5, stream=True,
        extra_headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
    )
    async for _ in raw.parse():
        pass
    request_id = raw.headers["x-request-id"]
    spans = traced[2].trace(CLIENT_TRACE, SPAN_NAMES)
    by_name = _check_tree(spans)
    assert by_name["pdgate.request"]["parent"] == CLIENT_SPAN  # the client's span is parent
    assert by_name["relay"]["attributes"]["pdgate.stream"] is True
    assert "pdgate-under-test" in traced[2].services
    # Each engine got its own span of the router as parent, in the client's trace.
    assert _traceparents(traced, "t-prefill", request_id) == [
        f"00-{CLIENT_TRACE}-{by_name['prefill']['span_id']}-01"]
    assert _traceparents(traced, "t-decode", request_id) == [
        f"00-{CLIENT_TRACE}-{by_name['decode']['span_id']}-01"]


async def test_pd_request_without_a_client_trace_starts_one(
    traced: tuple[SimCluster, int, Receiver]
) -> None:
    client = openai.AsyncOpenAI(base_url=f"{traced[0].router_url}/v1", api_key="unused",
                                max_retries=0)
    raw = await client.completions.with_raw_response.create(
        model=MODEL, prompt="Once upon a time", max_tokens=4)
    request_id = raw.headers["x-request-id"]
    decode_parent = _traceparents(traced, "t-decode", request_id)
    assert len(decode_parent) == 1
    _, trace_id, span_id, flags = decode_parent[0].split("-")
    spans = traced[2].trace(trace_id, SPAN_NAMES)
    by_name = _check_tree(spans)
    assert by_name["pdgate.request"]["parent"] == ""  # a root span
    assert by_name["decode"]["span_id"] == span_id
    assert int(flags, 16) & 1  # sampled (0x02 marks a random trace id, W3C level 2)
    [prefill_parent] = _traceparents(traced, "t-prefill", request_id)
    assert prefill_parent == f"00-{trace_id}-{by_name['prefill']['span_id']}-{flags}"


def test_tracing_is_off_unless_configured() -> None:
    assert tracing_from_env({}) is None
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}
    assert tracing_enabled(endpoint)
    assert not tracing_enabled({**endpoint, "OTEL_SDK_DISABLED": "true"})
    assert not tracing_enabled({**endpoint, "OTEL_TRACES_EXPORTER": "none"})
    assert tracing_enabled({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318"})
