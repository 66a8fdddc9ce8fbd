"""Property-based fuzzing: the request parser, the resource loader, the whole data path.

- `parse_request` on arbitrary bytes and arbitrary JSON: a `ParsedRequest` whose body can be
  forwarded (orjson writes it back), or a 4xx `APIError`; nothing else.
- `parse_object` on arbitrary objects and on valid manifests with one part mutated: a
  resource the view accepts, or `InvalidObject`; nothing else.
- The ASGI app in-process (routing, scheduling, the PD connector, the relay; the engines
  replaced by a stub that always answers well) on arbitrary bodies and headers: never a
  5xx, always an OpenAI error body on refusal, and nothing left in flight.

Each property prints how many cases it tried (`pytest -s`).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.app import PDGateApp
from router.errors import APIError
from router.request import CHAT_PATH, COMPLETIONS_PATH, parse_request
from router.resources import InvalidObject, parse_object
from router.state import AppState, RouterConfig
from router.view import ClusterView

MODEL = "fuzz-model"
EXAMPLE = Path(__file__).resolve().parents[2] / "config" / "kthena-pd-example.yaml"
PATHS = (CHAT_PATH, COMPLETIONS_PATH)
TRIED: dict[str, int] = {}


@pytest.fixture(scope="module", autouse=True)
def report_cases() -> Iterator[None]:
    yield
    cases = {k: v for k, v in TRIED.items() if "/status" not in k}
    print("\nfuzz cases tried:", TRIED, "total", sum(cases.values()))


def tried(name: str) -> None:
    TRIED[name] = TRIED.get(name, 0) + 1


scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=16,
)
# Deep lists orjson can still write (it stops at 254 levels); deeper ones are raw bytes below.
deep = st.integers(1, 240).map(lambda n: orjson.loads(b"[" * n + b"]" * n))
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]) | json_values},
        optional={"content": st.text(max_size=40) | json_values | deep},
    ) | json_values,
    max_size=4,
)
bodies = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL, "unknown-model", ""]) | json_values},
    optional={
        "messages": messages | json_values,
        "prompt": st.text(max_size=40) | st.lists(st.integers(0, 50000), max_size=8)
        | json_values,
        "max_tokens": st.integers(-3, 2_000_000) | json_values,
        "max_completion_tokens": st.integers(-3, 2_000_000) | json_values,
        "stream": st.booleans() | json_values,
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
        "temperature": json_values,
        "kv_transfer_params": json_values,
        "extra": json_values | deep,
    },
)
_options = {
    "max_tokens": st.integers(1, 64),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "temperature": st.floats(0, 2),
    "extra": json_values,
}
valid_bodies = {
    CHAT_PATH: st.fixed_dictionaries({
        "model": st.just(MODEL),
        "messages": st.lists(st.fixed_dictionaries({
            "role": st.sampled_from(["user", "system", "assistant"]),
            "content": st.text(max_size=200)}), min_size=1, max_size=4),
    }, optional=_options),
    COMPLETIONS_PATH: st.fixed_dictionaries({
        "model": st.just(MODEL),
        "prompt": st.text(max_size=200) | st.lists(st.integers(0, 50000), min_size=1,
                                                    max_size=16),
    }, optional=_options),
}


def body_for(path: str) -> st.SearchStrategy[Any]:
    """Valid bodies, valid bodies with one field replaced by anything, or anything."""
    valid = valid_bodies[path]
    one_wrong = valid.flatmap(lambda body: st.tuples(
        st.sampled_from(sorted(body)), json_values | deep
    ).map(lambda change: {**body, change[0]: change[1]}))
    return st.one_of(valid, one_wrong, bodies)


def corrupt(raw: bytes, data: st.DataObject) -> bytes:
    """Flip, cut or splice bytes of an encoded body."""
    if not raw:
        return raw
    position = data.draw(st.integers(0, len(raw) - 1))
    how = data.draw(st.sampled_from(["flip", "cut", "insert"]))
    if how == "flip":
        return raw[:position] + bytes([raw[position] ^ 0x80]) + raw[position + 1:]
    if how == "cut":
        return raw[:position]
    return raw[:position] + data.draw(st.binary(min_size=1, max_size=4)) + raw[position:]


def check_parse(path: str, raw: bytes) -> None:
    try:
        parsed = parse_request(path, raw)
    except APIError as exc:
        assert 400 <= exc.status < 500
        assert set(orjson.loads(exc.body())["error"]) == {"message", "type", "param", "code"}
        return
    assert orjson.loads(orjson.dumps(parsed.body)) == parsed.body  # it can be forwarded
    assert isinstance(parsed.model, str) and parsed.model


@settings(max_examples=400, deadline=None)
@given(path=st.sampled_from(PATHS), raw=st.binary(max_size=300))
def test_parser_on_arbitrary_bytes(path: str, raw: bytes) -> None:
    tried("parser/bytes")
    check_parse(path, raw)


@settings(max_examples=100, deadline=None)
@given(path=st.sampled_from(PATHS), depth=st.integers(1, 3000))
def test_parser_on_deep_nesting(path: str, depth: int) -> None:
    tried("parser/deep")
    nested = b"[" * depth + b"]" * depth
    check_parse(path, b'{"model":"m","prompt":' + nested + b',"messages":[{"role":"u",'
                b'"content":' + nested + b"}]}")


@settings(max_examples=600, deadline=None)
@given(path=st.sampled_from(PATHS), data=st.data())
def test_parser_on_arbitrary_json(path: str, data: st.DataObject) -> None:
    tried("parser/json")
    raw = orjson.dumps(data.draw(body_for(path) | json_values))
    check_parse(path, raw)
    check_parse(path, corrupt(raw, data))


# --- the resource loader --------------------------------------------------------------


def example_manifests() -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(EXAMPLE.read_text()) if isinstance(doc, dict)]


def paths_of(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            out += paths_of(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            out += paths_of(child, (*prefix, index))
    return out


def check_load(raw: Any) -> None:
    try:
        resource = parse_object(raw)
    except InvalidObject:
        return
    ClusterView().apply(resource)  # a resource the loader accepts, the view can hold


def test_unhashable_kind_is_invalid() -> None:
    """Found by fuzzing: `kind: []` raised TypeError and stopped the whole directory load."""
    with pytest.raises(InvalidObject):
        parse_object({"apiVersion": "v1", "kind": [], "metadata": {"name": "x"}})


@settings(max_examples=400, deadline=None)
@given(raw=json_values)
def test_loader_on_arbitrary_objects(raw: Any) -> None:
    tried("loader/arbitrary")
    check_load(raw)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_loader_on_mutated_manifests(data: st.DataObject) -> None:
    tried("loader/mutated")
    doc = copy.deepcopy(data.draw(st.sampled_from(example_manifests())))
    path = data.draw(st.sampled_from(paths_of(doc)[1:]))
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if data.draw(st.booleans()) and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(json_values | deep)
    check_load(doc)


# --- the data path, in-process ----------------------------------------------------------


class StubResponse:
    """`router.http_client.Response` as the proxy reads it: status, headers, body."""

    def __init__(self, stream: bool) -> None:
        self.status = 200
        if stream:
            self.headers = {"content-type": "text/event-stream"}
            chunk = b'data: {"choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n'
            usage = b'data: {"choices":[],"usage":{"completion_tokens":1}}\n\n'
            self._chunks = [chunk, usage, b"data: [DONE]\n\n"]
        else:
            self.headers = {"content-type": "application/json"}
            self._chunks = [orjson.dumps({
                "choices": [{"index": 0, "message": {"content": "ok"}}],
                "usage": {"completion_tokens": 1}})]

    async def readany(self) -> bytes:
        return self._chunks.pop(0) if self._chunks else b""

    async def read(self, limit: int) -> bytes:
        body = b"".join(self._chunks)
        self._chunks.clear()
        return body

    def close(self) -> None:
        pass

    def release(self) -> None:
        pass


class StubUpstream:
    """Engines that always answer well: whatever goes wrong is the router's doing."""

    async def open(self, pod: Any, path: str, body: bytes, headers: Any, deadline: float,
                   phase: str) -> StubResponse:
        return StubResponse(bool(orjson.loads(body).get("stream")))

    async def post_json(self, pod: Any, path: str, body: Any, headers: Any,
                        deadline: float) -> dict[str, Any]:
        orjson.dumps(body)
        return {"kv_transfer_params": {"remote_engine_id": "e", "remote_block_ids": [1]}}

    async def get_json(self, url: str, headers: Any, deadline: float) -> Any:
        return {}

    async def probe(self, url: str, timeout_s: float) -> bool:
        return True

    async def close(self) -> None:
        pass


def cluster_objects() -> list[dict[str, Any]]:
    api = "networking.serving.volcano.sh/v1alpha1"
    pods = [
        {"apiVersion": "v1", "kind": "Pod",
         "metadata": {"name": f"{role}-0", "namespace": "default",
                      "labels": {"app": "fz", "group": "g", "role": role}},
         "status": {"phase": "Running", "podIP": f"10.0.0.{i + 1}",
                    "conditions": [{"type": "Ready", "status": "True"}]}}
        for i, role in enumerate(("prefill", "decode"))
    ]
    return [
        {"apiVersion": api, "kind": "ModelRoute",
         "metadata": {"name": "fz", "namespace": "default"},
         "spec": {"modelName": MODEL,
                  "rules": [{"name": "r", "targetModels": [{"modelServerName": "fz"}]}],
                  "rateLimit": {"outputTokensPerUnit": 10**9, "unit": "second"}}},
        {"apiVersion": api, "kind": "ModelServer",
         "metadata": {"name": "fz", "namespace": "default"},
         "spec": {"inferenceEngine": "vLLM", "workloadPort": {"port": 8000},
                  "workloadSelector": {"matchLabels": {"app": "fz"}, "pdGroup": {
                      "groupKey": "group", "prefillLabels": {"role": "prefill"},
                      "decodeLabels": {"role": "decode"}}},
                  "kvConnector": {"type": "nixl"}}},
        *pods,
    ]


@pytest.fixture(scope="module")
def app() -> PDGateApp:
    state = AppState(RouterConfig())
    for raw in cluster_objects():
        state.view.apply(parse_object(raw))
    state.proxy.upstream = StubUpstream()  # type: ignore[assignment]
    return PDGateApp(state)


async def call(app: PDGateApp, method: str, path: str, headers: list[tuple[bytes, bytes]],
               body: bytes,
               on_send: Callable[[dict[str, Any]], None] | None = None) -> tuple[int, bytes]:
    """One request through the ASGI app: its status and body. `on_send` sees each message
    as the app sends it (a test that checks the router's state at that moment)."""
    sent: list[dict[str, Any]] = []
    parts = [body[i:i + 97] for i in range(0, len(body), 97)] or [b""]
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        if parts:
            chunk = parts.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(parts)}
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if on_send is not None:
            on_send(message)

    scope = {"type": "http", "method": method, "path": path, "headers": headers,
             "query_string": b"", "http_version": "1.1", "scheme": "http",
             "server": ("127.0.0.1", 8080), "client": ("127.0.0.1", 5000), "root_path": ""}
    await app(scope, receive, send)  # type: ignore[arg-type]
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


headers_strategy = st.lists(
    st.tuples(st.binary(min_size=1, max_size=20).map(lambda b: b.lower()),
              st.binary(max_size=60)),
    max_size=6,
)
oversized_headers = st.sampled_from(["none"] * 8 + ["one huge", "very many"])


def oversize(headers: list[tuple[bytes, bytes]], how: str) -> list[tuple[bytes, bytes]]:
    if how == "one huge":
        return [*headers, (b"x-filler", b"v" * 40_000)]
    if how == "very many":
        return headers + [(b"x-filler", b"v")] * 150
    return headers


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(PATHS), headers=headers_strategy, how=oversized_headers,
       data=st.data())
def test_data_path_never_answers_5xx(app: PDGateApp, path: str,
                                     headers: list[tuple[bytes, bytes]], how: str,
                                     data: st.DataObject) -> None:
    tried("asgi")
    headers = oversize(headers, how)
    raw = orjson.dumps(data.draw(body_for(path)))
    if data.draw(st.integers(0, 4)) == 0:
        raw = corrupt(raw, data)
    method = data.draw(st.sampled_from(["POST"] * 9 + ["GET"]))
    status, answer = asyncio.run(call(app, method, path, headers, raw))
    assert status < 500, answer
    tried(f"asgi/status {status}")  # not a case: how the cases ended
    if status != 200:
        assert set(orjson.loads(answer)["error"]) == {"message", "type", "param", "code"}
    elif b"text/event-stream" not in answer:
        assert answer.endswith(b"data: [DONE]\n\n") or answer.startswith(b"{")
    assert app.state.inflight.total() == 0
    assert app.state.resilience.drain.active == 0
