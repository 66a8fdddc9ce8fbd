"""Security on real processes: API keys, admin port, header hygiene, leaks, limits, rate limits.

Pods: two simulated PD groups, plus a fake engine (an in-test aiohttp server) that echoes
the headers it received, answers with hop-by-hop and internal headers, and fails in leaky
ways on request. Token rate limits run locally and in a real `redis-server` shared by two
routers.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from tests.integration.harness import SimCluster, free_port, loopback_net, pod_manifest, write_yaml
from tests.integration.harness import SimPodSpec as PodSpec
from tests.integration.test_faults_kit import (
    FaultCluster,
    Router,
    assert_no_leak,
    metric_sum,
    pd_specs,
    server_manifests,
    sse_payloads,
    stream_text,
    wait_for,
)

pytestmark = pytest.mark.integration

MODEL = "sim-secure-model"
FAKE = "fake-model"
FAKE_AUTH = "fake-auth-model"
KEYS = ("key-one-1111", "key-two-2222")
FAKE_IP = f"{loopback_net()}.19"


# --- redis ----------------------------------------------------------------------------


class RedisServer:
    """A throwaway `redis-server` on a free loopback port (no persistence)."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed")
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def command(self, *args: str) -> bytes:
        """One command in RESP; returns the raw reply."""
        payload = f"*{len(args)}\r\n" + "".join(f"${len(a)}\r\n{a}\r\n" for a in args)
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as conn:
            conn.sendall(payload.encode())
            return conn.recv(65536)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


# --- a fake engine ------------------------------------------------------------------


class FakeEngine:
    """Answers by the first message's content; remembers the headers it was sent."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []
        self.port = free_port([FAKE_IP])
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, FAKE_IP, self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.seen.append({k.lower(): v for k, v in request.headers.items()})
        body = await request.json()
        what = body["messages"][0]["content"]
        if what == "leak-500":
            return web.json_response({"error": {
                "message": "Traceback (most recent call last): boom at 10.9.8.7:8000",
                "type": "InternalServerError", "code": 500}}, status=500)
        if what == "leak-400":
            return web.json_response({"object": "error", "message":
                                      "bad prompt, see http://10.9.8.7:8000/debug for more",
                                      "type": "BadRequestError", "code": 400}, status=400)
        if what == "truncate":
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            chunk = {"id": "x", "object": "chat.completion.chunk", "choices": [
                {"index": 0, "delta": {"content": "half"}, "finish_reason": None}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await response.write_eof()  # a clean end, but no [DONE]
            return response
        return web.json_response(
            {"id": "x", "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "fine"},
                 "finish_reason": "stop"}],
             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}},
            headers={"Connection": "keep-alive", "Keep-Alive": "timeout=5",
                     "Proxy-Authenticate": "Basic", "X-Internal-Secret": "s3cr3t",
                     "Set-Cookie": "session=internal", "Server": "internal-engine/1.0"},
        )


@pytest.fixture(scope="module")
async def fake_engine() -> AsyncIterator[FakeEngine]:
    engine = FakeEngine()
    await engine.start()
    yield engine
    await engine.stop()


# --- the cluster --------------------------------------------------------------------


def write_keys(directory: Path, keys: dict[str, str]) -> None:
    """Lay keys out as kubelet mounts a Secret: files are symlinks into `..data`."""
    version = directory / f"..{time.time_ns()}"
    version.mkdir()
    for name, key in keys.items():
        (version / name).write_text(key + "\n")
    tmp = directory / "..data_tmp"
    tmp.symlink_to(version.name)
    tmp.replace(directory / "..data")
    for name in keys:
        link = directory / name
        if not link.is_symlink():
            link.symlink_to(Path("..data") / name)
    for entry in directory.iterdir():
        if entry.is_symlink() and entry.name not in keys and not entry.name.startswith(".."):
            entry.unlink()


def route_docs(port: int, fake_port: int, redis: RedisServer,
               input_limit: int | None = 30) -> list[dict[str, Any]]:
    docs = [
        *server_manifests("secure", MODEL, app="secure", port=port),
        *server_manifests("fake", FAKE, app="fake", port=fake_port, pd=False,
                          retry_attempts=0),
        *server_manifests("fake-auth", FAKE_AUTH, app="fake", port=fake_port, pd=False,
                          retry_attempts=0,
                          annotations={"pdgate.io/forward-authorization": "true"}),
        *server_manifests("limited-out", "limited-out", app="secure", port=port,
                          upstream_model=MODEL,
                          rate_limit={"outputTokensPerUnit": 20, "unit": "minute"}),
        *server_manifests("limited-out-big", "limited-out-big", app="secure", port=port,
                          upstream_model=MODEL,
                          rate_limit={"outputTokensPerUnit": 1_000_000, "unit": "minute"}),
        *server_manifests("limited-global", "limited-global", app="secure", port=port,
                          upstream_model=MODEL, rate_limit={
                              "inputTokensPerUnit": 40, "unit": "hour",
                              "global": {"redis": {"address": redis.address}}}),
    ]
    limited_in = server_manifests(
        "limited-in", "limited-in", app="secure", port=port, upstream_model=MODEL,
        rate_limit=None if input_limit is None else {"inputTokensPerUnit": input_limit,
                                                     "unit": "minute"})
    return docs + limited_in


@pytest.fixture(scope="module")
def secured(
    mooncake_master: object, tmp_path_factory: pytest.TempPathFactory,
    fake_engine: FakeEngine, redis_server: RedisServer,
) -> Iterator[tuple[FaultCluster, Router, Path]]:
    specs = pd_specs("secure")
    port = free_port([s.ip for s in specs])
    cluster = FaultCluster(SimCluster(mooncake_master, tmp_path_factory.mktemp("secure")),
                           port, specs)
    keys = cluster.sim.workdir / "api-keys"
    keys.mkdir()
    write_keys(keys, {"alice": KEYS[0], "bob": KEYS[1]})
    try:
        cluster.start_pods(MODEL, ["--fast"])
        fake_pod = PodSpec(name="fake-0", ip=FAKE_IP, role="both", labels={"app": "fake"})
        write_yaml(cluster.sim.config_dir / "pods.yaml",
                   [pod_manifest(s) for s in [*specs, fake_pod]])
        write_yaml(cluster.sim.config_dir / "routes.yaml",
                   route_docs(port, fake_engine.port, redis_server))
        router = cluster.start_router(
            ["--api-keys", str(keys), "--api-keys-reload", "0.2", "--max-body-bytes", "65536"],
            admin=True,
        )
        wait_for(lambda: metric_sum(router.metrics(), "pdgate_inflight_requests") == 0)
        yield cluster, router, keys
    finally:
        cluster.stop()


def auth(key: str = KEYS[0]) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def chat(content: str, model: str = MODEL, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, **extra}


async def send(url: str, body: bytes | dict[str, Any], headers: dict[str, str] | None = None,
               method: str = "POST", path: str = "/v1/chat/completions"
               ) -> tuple[int, dict[str, str], bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as session, session.request(
        method, url + path, data=data if method == "POST" else None,
        headers={"content-type": "application/json", **(headers or {})},
    ) as response:
        return (response.status, {k.lower(): v for k, v in response.headers.items()},
                await response.read())


def status_of(url: str, body: dict[str, Any], headers: dict[str, str]) -> int:
    """A blocking POST for `wait_for` predicates (never to the in-process fake engine)."""
    request = urllib.request.Request(
        url + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
        headers={"content-type": "application/json", **headers},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


# --- tests ----------------------------------------------------------------------------


async def test_api_keys_from_a_mounted_secret(
    secured: tuple[FaultCluster, Router, Path],
) -> None:
    _, router, keys = secured
    for headers, want in (({}, 401), (auth("wrong-key"), 401), ({"authorization": KEYS[0]}, 401),
                          (auth(KEYS[0]), 200), (auth(KEYS[1]), 200)):
        status, answer_headers, body = await send(router.url, chat("hello"), headers)
        assert status == want, body
        if want == 401:
            error = json.loads(body)["error"]
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
            assert answer_headers["www-authenticate"].startswith("Bearer")
    assert (await send(router.url, b"", method="GET", path="/v1/models"))[0] == 401
    status, _, body = await send(router.url, b"", auth(), method="GET", path="/v1/models")
    assert status == 200 and MODEL in body.decode()
    client = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await client.chat.completions.create(model=MODEL, messages=[
            {"role": "user", "content": "hi"}])
    # Rotate: the Secret now holds a new key and only Bob's old one.
    write_keys(keys, {"bob": KEYS[1], "carol": "key-three-3333"})
    wait_for(lambda: status_of(router.url, chat("x"), auth("key-three-3333")) == 200, timeout=5)
    assert (await send(router.url, chat("x"), auth(KEYS[0])))[0] == 401
    assert (await send(router.url, chat("x"), auth(KEYS[1])))[0] == 200
    write_keys(keys, {"alice": KEYS[0], "bob": KEYS[1]})
    wait_for(lambda: status_of(router.url, chat("x"), auth()) == 200, timeout=5)
    assert metric_sum(router.metrics(), "pdgate_auth_failures_total") >= 4


async def test_metrics_and_health_only_on_the_admin_port(
    secured: tuple[FaultCluster, Router, Path],
) -> None:
    _, router, _ = secured
    for path in ("/metrics", "/healthz", "/readyz"):
        assert (await send(router.url, b"", method="GET", path=path))[0] == 404
        assert (await send(router.ops_url, b"", method="GET", path=path))[0] == 200
    assert (await send(router.ops_url, b"", auth(), method="GET", path="/v1/models"))[0] == 404


async def test_hop_by_hop_headers_and_authorization_stay_at_the_router(
    secured: tuple[FaultCluster, Router, Path], fake_engine: FakeEngine,
) -> None:
    _, router, _ = secured
    client_headers = {
        **auth(), "cookie": "session=client", "proxy-authorization": "Basic abc",
        "te": "trailers", "x-forwarded-for": "1.2.3.4", "upgrade": "websocket",
        "x-request-id": "client-id-42", "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01",
    }
    status, headers, body = await send(router.url, chat("hello", FAKE), client_headers)
    assert status == 200, body
    seen = fake_engine.seen[-1]
    for name in ("authorization", "cookie", "proxy-authorization", "te", "x-forwarded-for",
                 "upgrade"):
        assert name not in seen, name
    assert seen["x-request-id"] == "client-id-42" and "traceparent" in seen
    for name in ("x-internal-secret", "set-cookie", "proxy-authenticate", "keep-alive"):
        assert name not in headers, name
    assert headers.get("server", "") != "internal-engine/1.0"
    assert headers["x-request-id"] == "client-id-42"
    # Forwarded only where the ModelServer asks for it.
    assert (await send(router.url, chat("hello", FAKE_AUTH), auth()))[0] == 200
    assert fake_engine.seen[-1]["authorization"] == f"Bearer {KEYS[0]}"
    # A request id that does not look like one is replaced.
    status, headers, _ = await send(router.url, chat("hello", FAKE),
                                    {**auth(), "x-request-id": "bad id " + "z" * 300})
    assert status == 200 and headers["x-request-id"] != "bad id"
    assert fake_engine.seen[-1]["x-request-id"] == headers["x-request-id"]


async def test_engine_failures_leak_nothing(
    secured: tuple[FaultCluster, Router, Path],
) -> None:
    _, router, _ = secured
    status, _, body = await send(router.url, chat("leak-500", FAKE), auth())
    assert status == 502
    assert_no_leak(body.decode())
    assert "10.9.8.7" not in body.decode() and "Traceback" not in body.decode()
    status, _, body = await send(router.url, chat("leak-400", FAKE), auth())
    assert status == 400
    message = json.loads(body)["error"]["message"]
    assert "10.9.8.7" not in message and "bad prompt" in message
    status, _, body = await send(router.url, chat("truncate", FAKE, stream=True), auth())
    assert status == 200
    payloads = sse_payloads(body)
    assert stream_text(payloads) == "half"
    assert payloads[-1] == "[DONE]" and "error" in payloads[-2]


BAD_INPUTS: list[tuple[str, bytes, dict[str, str], int]] = [
    ("body over the limit", b'{"model":"m","messages":[{"role":"user","content":"'
     + b"x" * 70_000 + b'"}]}', {}, 413),
    ("not UTF-8", b'{"model":"m","messages":[{"role":"user","content":"\xff\xfe"}]}', {}, 400),
    ("lone surrogate", b'{"model":"m","messages":[{"role":"user","content":"\\ud800"}]}', {},
     400),
    ("nested 40", b'{"model":"m","messages":[{"role":"user","content":' + b"[" * 40
     + b"]" * 40 + b"}]}", {}, 400),
    ("nested 5000", b'{"model":"m","x":' + b"[" * 5000 + b"]" * 5000 + b"}", {}, 400),
    ("3000 messages", b'{"model":"m","messages":[' + b",".join([b'{"role":"u"}'] * 3000)
     + b"]}", {}, 400),
    ("max_tokens 0", json.dumps(chat("x", max_tokens=0)).encode(), {}, 400),
    ("max_tokens huge", json.dumps(chat("x", max_tokens=2_000_000)).encode(), {}, 400),
    ("max_tokens string", json.dumps({**chat("x"), "max_tokens": "5"}).encode(), {}, 400),
    ("model too long", json.dumps(chat("x", model="m" * 300)).encode(), {}, 400),
    ("not an object", b"[1, 2, 3]", {}, 400),
    ("many headers", json.dumps(chat("x")).encode(),
     {f"x-filler-{i}": "v" for i in range(150)}, 431),
    ("huge header", json.dumps(chat("x")).encode(), {"x-filler": "v" * 40_000}, 431),
]


@pytest.mark.parametrize(("name", "raw", "headers", "want"), BAD_INPUTS,
                         ids=[b[0] for b in BAD_INPUTS])
async def test_bad_input_is_refused_with_a_4xx(
    secured: tuple[FaultCluster, Router, Path], name: str, raw: bytes,
    headers: dict[str, str], want: int,
) -> None:
    _, router, _ = secured
    try:
        status, _, body = await send(router.url, raw, {**auth(), **headers})
    except aiohttp.ClientError:
        # The HTTP parser may refuse before the app sees it: never a 5xx either way.
        assert want == 431
        return
    assert status == want, body[:300]
    if status != 431 or body:
        assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}


async def test_wrong_method_and_chunked_oversized_body(
    secured: tuple[FaultCluster, Router, Path],
) -> None:
    _, router, _ = secured
    assert (await send(router.url, b"", auth(), method="GET"))[0] == 405

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"model":"m","messages":[{"role":"user","content":"'
        for _ in range(20):
            yield b"y" * 8192
        yield b'"}]}'

    async with aiohttp.ClientSession() as session, session.post(
        f"{router.url}/v1/chat/completions", data=chunks(),
        headers={**auth(), "content-type": "application/json"},
    ) as response:
        assert response.status == 413


async def test_local_output_tokens_are_charged_by_real_usage(
    secured: tuple[FaultCluster, Router, Path],
) -> None:
    _, router, _ = secured
    # 20 output tokens a minute: 16, then 16 more (the bucket still had credit), then refused.
    assert (await send(router.url, chat("a", "limited-out", 16), auth()))[0] == 200
    status, _, body = await send(router.url, chat("b", "limited-out", 16, stream=True), auth())
    assert status == 200
    payloads = sse_payloads(body)
    assert not any(isinstance(p, dict) and p.get("usage") for p in payloads)  # hidden
    assert payloads[-1] == "[DONE]" and len(stream_text(payloads)) > 0
    status, headers, body = await send(router.url, chat("c", "limited-out", 1), auth())
    assert status == 429
    error = json.loads(body)["error"]
    assert error["code"] == "rate_limit_exceeded"
    assert error["message"] == "output token rate limit exceeded"
    assert int(headers["retry-after"]) >= 1
    assert metric_sum(router.metrics(), "pdgate_rate_limited_total", kind="output") >= 1


async def test_usage_chunk_kept_for_a_client_that_asked(
    secured: tuple[FaultCluster, Router, Path],
) -> None:
    _, router, _ = secured
    for asked in (True, False):
        body = chat("d", "limited-out-big", 3, stream=True,
                    stream_options={"include_usage": asked})
        status, _, raw = await send(router.url, body, auth())
        assert status == 200
        payloads = sse_payloads(raw)
        usage = [p["usage"] for p in payloads if isinstance(p, dict) and p.get("usage")]
        assert usage == ([usage[0]] if asked else [])
        if asked:
            assert usage[0]["completion_tokens"] == 3
        assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1


async def test_input_limit_change_and_removal_take_effect_at_once(
    secured: tuple[FaultCluster, Router, Path], fake_engine: FakeEngine,
    redis_server: RedisServer,
) -> None:
    cluster, router, _ = secured
    routes = cluster.sim.config_dir / "routes.yaml"
    prompt = "x" * 40  # ~10 tokens; the limit is 30 a minute
    statuses = [(await send(router.url, chat(prompt, "limited-in"), auth()))[0]
                for _ in range(4)]
    if statuses[0] == 429:  # an earlier test spent some of the budget
        statuses = statuses[1:]
    assert 429 in statuses
    status, _, body = await send(router.url, chat(prompt, "limited-in"), auth())
    assert status == 429 and json.loads(body)["error"]["message"] == \
        "input token rate limit exceeded"
    write_yaml(routes, route_docs(cluster.port, fake_engine.port, redis_server,
                                  input_limit=100_000))
    wait_for(lambda: status_of(router.url, chat(prompt, "limited-in"), auth()) == 200, 3)
    write_yaml(routes, route_docs(cluster.port, fake_engine.port, redis_server,
                                  input_limit=5))
    wait_for(lambda: status_of(router.url, chat(prompt, "limited-in"), auth()) == 429, 3)
    write_yaml(routes, route_docs(cluster.port, fake_engine.port, redis_server,
                                  input_limit=None))
    wait_for(lambda: status_of(router.url, chat(prompt, "limited-in"), auth()) == 200, 3)
    for _ in range(5):
        assert (await send(router.url, chat(prompt, "limited-in"), auth()))[0] == 200
    write_yaml(routes, route_docs(cluster.port, fake_engine.port, redis_server))


async def test_global_limit_is_shared_by_replicas_through_redis(
    secured: tuple[FaultCluster, Router, Path], redis_server: RedisServer,
) -> None:
    cluster, first, keys = secured
    second = cluster.start_router(["--api-keys", str(keys)], name="replica")
    try:
        prompt = "y" * 40  # ~10 tokens; 40 an hour across every replica
        statuses = []
        for i in range(6):
            router = (first, second)[i % 2]
            statuses.append((await send(router.url, chat(prompt, "limited-global"), auth()))[0])
        assert statuses == [200, 200, 200, 200, 429, 429]
        assert b"pdgate:ratelimit:default/limited-global-route:in" in redis_server.command(
            "KEYS", "pdgate:ratelimit:*")
        # Redis gone: the limit cannot be checked, so requests go through (and are counted).
        redis_server.stop()
        try:
            assert (await send(second.url, chat(prompt, "limited-global"), auth()))[0] == 200
            assert metric_sum(second.metrics(KEYS[0]),
                              "pdgate_ratelimit_backend_errors_total") >= 1
        finally:
            redis_server.start()
    finally:
        second.process.stop()

