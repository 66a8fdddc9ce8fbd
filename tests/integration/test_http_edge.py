"""The HTTP edge on real processes: what a gateway on a Service faces from raw sockets.

A router process in front of two simulated PD groups, driven through raw TCP sockets (the
attacks need bytes no HTTP client library sends) and curl: request smuggling through
`Upgrade: h2c`, endless headers, slowloris / slow-body / idle connections, a connection
flood, HTTP/1.0 clients, and which endpoints an API key protects.
"""

from __future__ import annotations

import contextlib
import json
import select
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httptools
import openai
import psutil
import pytest

from router.http.config import head_bytes_bound
from router.security.config import DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_HEADERS
from tests.integration.harness import SimCluster, free_port, write_yaml
from tests.integration.test_faults_kit import (
    FaultCluster,
    Router,
    metric_sum,
    pd_specs,
    server_manifests,
    sse_payloads,
    stream_text,
    wait_for,
)

pytestmark = pytest.mark.integration

MODEL = "sim-edge-model"
APP = "edge"


@pytest.fixture(scope="module")
def edge_cluster(
    mooncake_master: object, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FaultCluster]:
    specs = pd_specs(APP)
    port = free_port([s.ip for s in specs])
    cluster = FaultCluster(SimCluster(mooncake_master, tmp_path_factory.mktemp("edge")),
                           port, specs)
    try:
        cluster.start_pods(MODEL, ["--fast"])
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


def chat_body(content: str, model: str = MODEL, **extra: Any) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": content}],
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


# --- item 4: a bounded head ------------------------------------------------------------

HEAD_BOUND = head_bytes_bound(DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_HEADERS)
#: What a test client offers before giving up: far past the bound.
ENDLESS_BYTES = 16 * 1024 * 1024


def stream_headers(port: int, one_value: bool) -> int:
    """Send header bytes until the router cuts the connection; return how many were sent."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        try:
            conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            if one_value:
                conn.sendall(b"X-Endless: ")
            i = 0
            while sent < ENDLESS_BYTES:
                piece = (b"v" * 65536 if one_value
                         else b"".join(b"X-F-%08d: %s\r\n" % (i + k, b"v" * 50)
                                       for k in range(1000)))
                i += 1000
                conn.sendall(piece)
                sent += len(piece)
        except OSError:  # reset or broken pipe: the router closed it
            return sent
    return sent


def test_endless_headers_are_cut_off_and_memory_stays_flat(
    edge_cluster: FaultCluster, router: Router,
) -> None:
    """Three connections stream headers without end: each is closed soon after the head
    bound, and the router's RSS does not grow with what they sent."""
    refused = metric_sum(router.metrics(), "pdgate_connections_refused_total",
                         reason="header_too_large")
    rss_before = router.rss_kib()
    with ThreadPoolExecutor(3) as pool:
        sent = list(pool.map(lambda one: stream_headers(router.port, one), (False, True, False)))
    rss_after = router.rss_kib()
    # The router stopped reading near the bound; what was sent past it sat in socket
    # buffers (a few MiB on loopback) until the reset.
    assert all(s < ENDLESS_BYTES for s in sent), sent
    assert rss_after - rss_before < 8 * 1024, (rss_before, rss_after)
    wait_for(lambda: metric_sum(router.metrics(), "pdgate_connections_refused_total",
                                reason="header_too_large") == refused + 3)
    # Just past the bound and no end in sight; the router reads it all: a 431 it can answer.
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"v" * HEAD_BOUND
    answers = parse_answers(converse(router.port, [head]))
    assert [a.status for a in answers] == [431]
    assert json.loads(answers[0].body)["error"]["code"] == "request_header_fields_too_large"
    assert answers[0].headers["connection"] == "close"


# --- item 5: timeouts and a connection cap ---------------------------------------------

SHORT_S = 1.0  # the timeouts of the `strict` router


@pytest.fixture(scope="module")
def strict(edge_cluster: FaultCluster) -> Router:
    """A router with 1 s header, body and idle timeouts (metrics on an admin port)."""
    return edge_cluster.start_router(
        ["--header-timeout", str(SHORT_S), "--body-timeout", str(SHORT_S),
         "--idle-timeout", str(SHORT_S)], admin=True, name="strict")


def client_sockets(router: Router) -> int:
    """The router's sockets on its API port (accepted client connections)."""
    connections = psutil.Process(router.pid()).net_connections(kind="tcp4")
    return sum(  # a connection on the port, not the listener
        1 for c in connections if c.laddr.port == router.port and c.status != psutil.CONN_LISTEN
    )


@dataclass
class Held:
    conn: socket.socket
    opened: float
    received: bytes = b""
    closed_after: float | None = None


def hold(port: int, count: int, first: bytes, drip: bytes, limit_s: float = 15.0) -> list[Held]:
    """Open `count` connections, send `first` on each, then `drip` every 0.25 s on each
    until the router closes it; return what each received and when it was closed."""
    held = []
    for _ in range(count):
        conn = socket.create_connection(("127.0.0.1", port), timeout=5)
        if first:
            conn.sendall(first)
        held.append(Held(conn, time.monotonic()))
    deadline = time.monotonic() + limit_s
    try:
        while any(h.closed_after is None for h in held) and time.monotonic() < deadline:
            open_now = [h for h in held if h.closed_after is None]
            readable, _, _ = select.select([h.conn for h in open_now], [], [], 0.25)
            for h in open_now:
                if h.conn in readable:
                    try:
                        chunk = h.conn.recv(65536)
                    except ConnectionResetError:
                        chunk = b""
                    h.received += chunk
                    if not chunk:
                        h.closed_after = time.monotonic() - h.opened
                        continue
                if drip:
                    with contextlib.suppress(OSError):
                        h.conn.sendall(drip)
    finally:
        for h in held:
            h.conn.close()
    return held


def test_slowloris_silent_and_slow_body_connections_are_closed(strict: Router) -> None:
    assert client_sockets(strict) == 0
    with socket.create_connection(("127.0.0.1", strict.port)):
        wait_for(lambda: client_sockets(strict) == 1)  # the count sees an accepted socket
    refused = {reason: metric_sum(strict.metrics(), "pdgate_connections_refused_total",
                                  reason=reason)
               for reason in ("header_timeout", "body_timeout")}
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
    slowloris = hold(strict.port, 20, head + b"X-A: ", b"a")
    for h in slowloris:
        assert h.closed_after is not None and h.closed_after >= SHORT_S * 0.9
        assert h.received.startswith(b"HTTP/1.1 408 "), h.received[:200]
    silent = hold(strict.port, 20, b"", b"")
    for h in silent:
        assert h.closed_after is not None and h.received == b""
    slow_body = hold(strict.port, 20, post_head(strict.port, 1000), b"x")
    for h in slow_body:
        assert h.closed_after is not None and h.closed_after >= SHORT_S * 0.9
        answer = parse_answers(h.received)[0]
        assert answer.status == 408, h.received[:200]
        assert json.loads(answer.body)["error"]["code"] == "request_timeout"
    wait_for(lambda: client_sockets(strict) == 0)  # every fd it took is given back
    text = strict.metrics()
    assert metric_sum(text, "pdgate_connections_refused_total",
                      reason="header_timeout") == refused["header_timeout"] + 40
    assert metric_sum(text, "pdgate_connections_refused_total",
                      reason="body_timeout") == refused["body_timeout"] + 20


def test_a_body_declared_past_the_limit_is_refused_from_the_head(router: Router) -> None:
    refused = metric_sum(router.metrics(), "pdgate_connections_refused_total",
                         reason="body_too_large")
    too_large = 8 * 1024 * 1024 + 1  # --max-body-bytes' default, plus one
    for extra in ((), ("Expect: 100-continue",)):
        started = time.monotonic()
        # Only the head and two bytes are sent: the answer must not wait for the rest.
        received = converse(router.port, [post_head(router.port, too_large, *extra) + b"{}"],
                            limit_s=10.0)
        assert time.monotonic() - started < 5.0  # not the 60 s body timeout
        assert not received.startswith(b"HTTP/1.1 100"), received[:200]  # no invitation
        (answer,) = parse_answers(received)
        assert answer.status == 413, received[:200]
        assert json.loads(answer.body)["error"]["code"] == "request_too_large"
    assert metric_sum(router.metrics(), "pdgate_connections_refused_total",
                      reason="body_too_large") == refused + 2


def test_malformed_requests_get_an_openai_400_after_the_valid_ones_ahead(
    router: Router,
) -> None:
    body = chat_body("first, then garbage")
    valid = post_head(router.port, len(body)) + body
    for garbage in (b"GARBAGE\r\n\r\n", b"POST /v1/chat/completions HTTP/1.1\r\n"
                    b"Content-Length: 5\r\nContent-Length: 6\r\n\r\n"):
        answers = parse_answers(converse(router.port, [valid + garbage], limit_s=10.0))
        assert [a.status for a in answers] == [200, 400]  # the valid one is not cancelled
        assert json.loads(answers[0].body)["choices"]
        error = json.loads(answers[1].body)["error"]
        assert error["code"] == "invalid_http_request" and error["message"]
        assert answers[1].headers["connection"] == "close"
    (alone,) = parse_answers(converse(router.port, [b"FOO / HTTP/1.1\r\nHost: x\r\n\r\n"]))
    assert alone.status == 400 and alone.headers["content-type"] == "application/json"


def test_idle_keep_alive_connection_is_closed_after_a_complete_request(
    strict: Router,
) -> None:
    body = chat_body("keep me")
    (h,) = hold(strict.port, 1, post_head(strict.port, len(body)) + body, b"")
    assert h.closed_after is not None and h.closed_after >= SHORT_S
    answers = parse_answers(h.received)
    assert [a.status for a in answers] == [200]  # answered, kept alive, then closed idle
    assert "connection" not in answers[0].headers


def test_connections_beyond_the_cap_get_503_and_are_counted(
    edge_cluster: FaultCluster,
) -> None:
    capped = edge_cluster.start_router(["--max-connections", "8"], admin=True, name="capped")
    try:
        def open_gauge() -> float:
            return metric_sum(capped.metrics(), "pdgate_connections_open", listener="api")

        conns = [socket.create_connection(("127.0.0.1", capped.port), timeout=5)
                 for _ in range(8)]
        wait_for(lambda: open_gauge() == 8)
        try:
            for _ in range(3):
                raw = converse(capped.port, [])
                answer = parse_answers(raw)[0]
                assert answer.status == 503 and answer.headers["retry-after"] == "1"
                assert json.loads(answer.body)["error"]["code"] == "too_many_connections"
            assert metric_sum(capped.metrics(), "pdgate_connections_refused_total",
                              listener="api", reason="max_connections") == 3
            # The admin port has its own cap: probes still get through.
            with urllib.request.urlopen(f"{capped.ops_url}/readyz", timeout=5) as r:
                assert r.status == 200
        finally:
            for conn in conns:
                conn.close()
        wait_for(lambda: open_gauge() == 0)
        client = openai.OpenAI(base_url=f"{capped.url}/v1", api_key="x", max_retries=0)
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "room again"}], max_tokens=4)
        assert answer.choices[0].message.content
    finally:
        capped.process.stop()


# --- item 6: HTTP/1.0 ------------------------------------------------------------------


def test_http10_clients_get_close_delimited_answers(
    edge_cluster: FaultCluster, router: Router,
) -> None:
    for stream in (False, True):
        body = chat_body("one oh", stream=stream)
        raw = converse(router.port, [post_head(router.port, len(body), version="1.0") + body])
        head, _, content = raw.partition(b"\r\n\r\n")
        lines = head.decode().lower().split("\r\n")
        assert lines[0].startswith("http/1.1 200")
        assert "transfer-encoding: chunked" not in lines, head
        assert "connection: close" in lines
        if stream:
            payloads = sse_payloads(content)
            assert payloads[-1] == "[DONE]" and stream_text(payloads)
        else:
            assert json.loads(content)["choices"][0]["message"]["content"]
    body = chat_body("who", model="no-such-model")
    raw = converse(router.port, [post_head(router.port, len(body), version="1.0") + body])
    head, _, content = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 404 ") and b"chunked" not in head.lower()
    assert json.loads(content)["error"]["code"] == "model_not_found"


# --- item 13: what the API key protects -------------------------------------------------

KEY = "edge-key-0001"
PROTECTED = ("/metrics", "/docs", "/redoc", "/openapi.json")


def get(url: str, key: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(
        url, headers={"authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def test_docs_and_metrics_need_the_key_and_probes_do_not(edge_cluster: FaultCluster) -> None:
    keys = edge_cluster.sim.workdir / "edge-keys"
    keys.write_text(KEY + "\n")
    keyed = edge_cluster.start_router(["--api-keys", str(keys)], name="keyed")
    try:
        for path in PROTECTED:
            for key in (None, "wrong-key"):
                status, body = get(keyed.url + path, key)
                assert status == 401, (path, key)
                assert json.loads(body)["error"]["code"] == "invalid_api_key"
            status, body = get(keyed.url + path, KEY)
            assert status == 200, path
        assert b"/v1/chat/completions" in get(keyed.url + "/openapi.json", KEY)[1]
        assert b"pdgate_connections_open" in get(keyed.url + "/metrics", KEY)[1]
        for path in ("/healthz", "/readyz"):
            assert get(keyed.url + path)[0] == 200
        # What a client built on the openai SDK sees.
        wrong = openai.OpenAI(base_url=keyed.url, api_key="wrong-key", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.get("/openapi.json", cast_to=object)
        right = openai.OpenAI(base_url=keyed.url, api_key=KEY, max_retries=0)
        document = right.get("/openapi.json", cast_to=object)
        assert isinstance(document, dict) and "/v1/completions" in document["paths"]
    finally:
        keyed.process.stop()


def test_with_an_admin_port_docs_and_metrics_live_there(edge_cluster: FaultCluster) -> None:
    keys = edge_cluster.sim.workdir / "edge-keys-admin"
    keys.write_text(KEY + "\n")
    split = edge_cluster.start_router(["--api-keys", str(keys)], admin=True, name="split")
    try:
        for path in (*PROTECTED, "/healthz", "/readyz"):
            assert get(split.url + path, KEY)[0] == 404, path
            assert get(split.ops_url + path)[0] == 200, path
        document = json.loads(get(split.ops_url + "/openapi.json")[1])
        assert {"/v1/chat/completions", "/v1/models"} <= set(document["paths"])
        assert b"/openapi.json" in get(split.ops_url + "/docs")[1]
        assert get(split.url + "/v1/models", KEY)[0] == 200
    finally:
        split.process.stop()
