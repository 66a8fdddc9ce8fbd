"""The HTTP edge on real processes: what a gateway on a Service faces from raw sockets.

A router process in front of two simulated PD groups, driven through raw TCP sockets (the
attacks need bytes no HTTP client library sends) and curl: request smuggling through
`Upgrade: h2c`, endless headers, slowloris / slow-body / idle connections, a connection
flood, HTTP/1.0 clients, and which endpoints an API key protects.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httptools
import pytest

from tests.integration.harness import SimCluster, free_port
from tests.integration.test_faults_kit import (
    FaultCluster,
    Router,
    pd_specs,
    server_manifests,
)

pytestmark = pytest.mark.integration

MODEL = "sim-edge-model"
APP = "edge"


@pytest.fixture(scope="module")
def edge_cluster(
    mooncake_master: object, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FaultCluster]:
    specs = pd_specs(APP, 161)
    port = free_port([s.ip for s in specs])
    cluster = FaultCluster(SimCluster(mooncake_master, tmp_path_factory.mktemp("edge")),
                           port, specs)
    try:
        cluster.start_pods(MODEL, ["--fast"])
        from tests.integration.harness import write_yaml

        write_yaml(cluster.sim.config_dir / "routes.yaml",
                   server_manifests("edge", MODEL, app=APP, port=port))
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def router(edge_cluster: FaultCluster) -> Router:
    """A router with default edge settings (the module's cluster stops it)."""
    return edge_cluster.start_router(name="default")


# --- raw HTTP ----------------------------------------------------------------------------


@dataclass
class Answer:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


class _Collector:
    """httptools callbacks that collect every response on a connection."""

    def __init__(self) -> None:
        self.answers: list[Answer] = []
        self.parser: httptools.HttpResponseParser | None = None

    def on_message_begin(self) -> None:
        self.answers.append(Answer())

    def on_header(self, name: bytes, value: bytes) -> None:
        self.answers[-1].headers[name.decode().lower()] = value.decode()

    def on_headers_complete(self) -> None:
        assert self.parser is not None
        self.answers[-1].status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.answers[-1].body += body


def parse_answers(raw: bytes) -> list[Answer]:
    """Every complete HTTP/1.1 response in `raw` (framed by Content-Length or chunks)."""
    collector = _Collector()
    collector.parser = httptools.HttpResponseParser(collector)
    collector.parser.feed_data(raw)
    return collector.answers


def converse(port: int, parts: list[bytes], pause_s: float = 0.3,
             limit_s: float = 20.0) -> bytes:
    """Send `parts` with a pause between them, then read until the router closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=limit_s) as conn:
        for i, part in enumerate(parts):
            if i:
                time.sleep(pause_s)
            conn.sendall(part)
        received = b""
        while chunk := conn.recv(65536):
            received += chunk
    return received


def chat_body(content: str, **extra: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}],
                       "max_tokens": 4, **extra}).encode()


def post_head(port: int, body_len: int, *extra: str, version: str = "1.1") -> bytes:
    lines = [f"POST /v1/chat/completions HTTP/{version}", f"Host: 127.0.0.1:{port}",
             "Content-Type: application/json", f"Content-Length: {body_len}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


CLOSE_PROBE = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
H2C = ("Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c",
       "HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA")


def engine_requests(cluster: FaultCluster) -> dict[str, int]:
    """Requests the pods served, by kind, summed over every pod."""
    total: dict[str, int] = {}
    for name in cluster.pods:
        with urllib.request.urlopen(f"{cluster.pod_url(name)}/sim/stats", timeout=5) as r:
            stats = json.loads(r.read())
        for kind, count in stats["requests"].items():
            total[kind] = total.get(kind, 0) + count
    return total


def engine_request_ids(cluster: FaultCluster) -> set[str]:
    ids: set[str] = set()
    for name in cluster.pods:
        with urllib.request.urlopen(f"{cluster.pod_url(name)}/sim/stats", timeout=5) as r:
            ids.update(str(record["request_id"]) for record in json.loads(r.read())["recent"])
    return ids


# --- item 3: one request is one request --------------------------------------------------


def test_h2c_upgrade_body_sent_late_is_not_a_second_request(
    edge_cluster: FaultCluster, router: Router,
) -> None:
    """The body of an `Upgrade: h2c` POST is that POST's body, never a request of its own."""
    inner_body = chat_body("smuggled")
    smuggled = (post_head(router.port, len(inner_body), "X-Request-Id: smuggled-0001")
                + inner_body)
    before = engine_requests(edge_cluster)
    raw = converse(router.port, [post_head(router.port, len(smuggled), *H2C), smuggled,
                                 CLOSE_PROBE])
    answers = parse_answers(raw)
    # One answer for the POST (its body is not JSON: 400), one for the closing probe.
    assert [a.status for a in answers] == [400, 200], raw[:600]
    assert json.loads(answers[0].body)["error"]["type"] == "invalid_request_error"
    assert engine_requests(edge_cluster) == before
    assert not any("smuggled" in rid for rid in engine_request_ids(edge_cluster))


@pytest.mark.parametrize("pause_s", [0.0, 0.3], ids=["one-packet", "body-later"])
def test_h2c_upgrade_is_ignored_and_the_body_served(
    edge_cluster: FaultCluster, router: Router, pause_s: float,
) -> None:
    """curl --http2 / Java clients: the upgrade is ignored, the POST answered in HTTP/1.1."""
    body = chat_body("upgrade me")
    before = engine_requests(edge_cluster)
    head = post_head(router.port, len(body), *H2C)
    parts = [head, body, CLOSE_PROBE] if pause_s else [head + body, CLOSE_PROBE]
    raw = converse(router.port, parts, pause_s=pause_s)
    answers = parse_answers(raw)
    assert raw.startswith(b"HTTP/1.1 200 ")
    assert [a.status for a in answers] == [200, 200], raw[:600]
    completion = json.loads(answers[0].body)
    assert completion["object"] == "chat.completion"
    assert completion["choices"][0]["message"]["content"]
    after = engine_requests(edge_cluster)
    assert after["prefill"] - before["prefill"] == 1
    assert after["decode"] - before["decode"] == 1


def test_h2c_upgrade_with_a_chunked_body_and_other_upgrades(
    edge_cluster: FaultCluster, router: Router,
) -> None:
    """A chunked body after an upgrade head is read as chunks; CONNECT is refused; a
    WebSocket upgrade is an ordinary GET (the router upgrades to nothing)."""
    body = chat_body("chunked upgrade")
    head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            "\r\nTransfer-Encoding: chunked\r\n" + "\r\n".join(H2C) + "\r\n\r\n").encode()
    chunks = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (10, body[:10], len(body) - 10, body[10:])
    before = engine_requests(edge_cluster)
    answers = parse_answers(converse(router.port, [head, chunks, CLOSE_PROBE]))
    assert [a.status for a in answers] == [200, 200]
    assert json.loads(answers[0].body)["object"] == "chat.completion"
    assert engine_requests(edge_cluster)["decode"] - before["decode"] == 1
    raw = converse(router.port, [b"CONNECT 10.0.0.1:443 HTTP/1.1\r\nHost: 10.0.0.1:443\r\n\r\n"])
    assert raw.startswith(b"HTTP/1.1 400 ")
    ws = (b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
          b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
    answers = parse_answers(converse(router.port, [ws, CLOSE_PROBE]))
    assert [a.status for a in answers] == [200, 200]
    assert json.loads(answers[0].body) == {"status": "ok"}


def test_curl_http2_gets_an_http11_answer(edge_cluster: FaultCluster, router: Router) -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    before = engine_requests(edge_cluster)
    done = subprocess.run(
        [curl, "-sS", "--http2", "-i", "-H", "content-type: application/json",
         "--data-binary", chat_body("curl").decode(), f"{router.url}/v1/chat/completions"],
        capture_output=True, timeout=30, check=False,
    )
    assert done.returncode == 0, done.stderr
    head, _, body = done.stdout.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), done.stdout[:400]
    assert json.loads(body)["object"] == "chat.completion"
    after = engine_requests(edge_cluster)
    assert after["decode"] - before["decode"] == 1
