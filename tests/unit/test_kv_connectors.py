"""Unit tests for the KV connectors: the bodies they build, when prefill runs, errors.

A recording `PrefillClient` stands in for the engines; the vLLM NIXL flow is also
checked against a wire capture of vLLM Router 0.1.17.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from kv_connectors.base import Handoff, KVConnector, PDCall, PodAddress, UpstreamError
from kv_connectors.factory import get_connector
from kv_connectors.http import HTTPConnector
from kv_connectors.mooncake import MooncakeConnector
from kv_connectors.mooncake_vllm import MooncakeVllmConnector
from kv_connectors.nixl import NixlConnector
from kv_connectors.sglang import SGLangConnector

# Submodule imports: they also work while the editable install still maps the package
# as a namespace (created before `kv_connectors/__init__.py` existed).
from tests.fixtures import VLLM_ROUTER_NIXL_WIRE

PEER_WIRE = VLLM_ROUTER_NIXL_WIRE

NULL_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass(frozen=True)
class Pod:
    ip: str
    port: int
    dp_rank: int | None = None
    rank_pin: str | None = None
    local_index: int | None = None

    @property
    def base_url(self) -> str:
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"http://{host}:{self.port}"


@dataclass
class Post:
    pod: PodAddress
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    deadline: float


@dataclass
class Get:
    url: str
    headers: dict[str, str]
    deadline: float


@dataclass
class RecordingClient:
    """A `PrefillClient` that records what it is sent and answers from its fields."""

    answer: dict[str, Any] = field(default_factory=dict)
    query: Any = None
    post_error: UpstreamError | None = None
    get_error: UpstreamError | None = None
    gate: asyncio.Event | None = None
    posts: list[Post] = field(default_factory=list)
    gets: list[Get] = field(default_factory=list)

    async def post_json(
        self,
        pod: PodAddress,
        path: str,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        deadline: float,
    ) -> dict[str, Any]:
        self.posts.append(Post(pod, path, copy.deepcopy(dict(body)), dict(headers), deadline))
        if self.gate is not None:
            await self.gate.wait()
        if self.post_error is not None:
            raise self.post_error
        return self.answer

    async def get_json(self, url: str, headers: Mapping[str, str], deadline: float) -> Any:
        self.gets.append(Get(url, dict(headers), deadline))
        if self.get_error is not None:
            raise self.get_error
        return self.query


PREFILL = Pod("10.0.0.1", 8000)
DECODE = Pod("10.0.0.2", 8000)


def make_call(
    body: dict[str, Any] | None = None,
    *,
    headers: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    prefill: Pod = PREFILL,
    deadline: float = 1e12,
) -> PDCall:
    return PDCall(
        path="/v1/chat/completions",
        body=body if body is not None else chat_body(),
        headers=headers if headers is not None else {"x-request-id": "req-1"},
        request_id="req-1",
        prefill=prefill,
        decode=DECODE,
        deadline=deadline,
        annotations=annotations or {},
    )


def chat_body(**extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "Where is the capital of China?"}],
        "max_tokens": 64,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.2,
    }
    body.update(extra)
    return body


def nixl_handle(**extra: Any) -> dict[str, Any]:
    handle: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2, 3]],
        "remote_engine_id": "eng-prefill",
        "remote_request_id": "cmpl-abc-0",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
    }
    handle.update(extra)
    return handle


async def finish(handoff: Handoff) -> Any:
    assert handoff.prefill_task is not None
    return await handoff.prefill_task


# --- get_connector ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "engine", "annotations", "cls", "name"),
    [
        ("http", "vLLM", {}, HTTPConnector, "http"),
        ("lmcache", "vLLM", {}, HTTPConnector, "http"),
        ("nixl", "vLLM", {}, NixlConnector, "nixl"),
        ("mooncake", "vLLM", {}, MooncakeConnector, "mooncake"),
        (
            "mooncake",
            "vLLM",
            {"pdgate.io/mooncake-protocol": "vllm-ascend"},
            MooncakeConnector,
            "mooncake",
        ),
        (
            "mooncake",
            "vLLM",
            {"pdgate.io/mooncake-protocol": "vllm"},
            MooncakeVllmConnector,
            "mooncake-vllm",
        ),
        ("http", "SGLang", {}, SGLangConnector, "sglang"),
        ("nixl", "SGLang", {}, SGLangConnector, "sglang"),
        ("mooncake", "SGLang", {"pdgate.io/mooncake-protocol": "vllm"}, SGLangConnector, "sglang"),
        ("lmcache", "SGLang", {}, SGLangConnector, "sglang"),
    ],
)
def test_get_connector_picks_protocol(
    kind: str, engine: str, annotations: dict[str, str], cls: type[KVConnector], name: str
) -> None:
    connector = get_connector(kind, engine, annotations)
    assert type(connector) is cls
    assert connector.name == name


def test_get_connector_reads_bootstrap_ports() -> None:
    sglang = get_connector("http", "SGLang", {"pdgate.io/sglang-bootstrap-port": "9000"})
    assert isinstance(sglang, SGLangConnector)
    assert sglang.bootstrap_port == 9000
    assert isinstance(default := get_connector("http", "SGLang", {}), SGLangConnector)
    assert default.bootstrap_port == 8998
    mooncake = get_connector(
        "mooncake",
        "vLLM",
        {"pdgate.io/mooncake-protocol": "vllm", "pdgate.io/mooncake-bootstrap-port": "9100"},
    )
    assert isinstance(mooncake, MooncakeVllmConnector)
    assert mooncake.bootstrap_port == 9100


def test_get_connector_shares_instances() -> None:
    annotations = {"pdgate.io/mooncake-protocol": "vllm"}
    assert get_connector("mooncake", "vLLM", annotations) is get_connector(
        "mooncake", "vLLM", dict(annotations)
    )


@pytest.mark.parametrize(
    ("kind", "engine", "annotations"),
    [
        ("grpc", "vLLM", {}),
        ("grpc", "SGLang", {}),
        ("nixl", "TensorRT-LLM", {}),
        ("mooncake", "vLLM", {"pdgate.io/mooncake-protocol": "sglang"}),
        (
            "mooncake",
            "vLLM",
            {"pdgate.io/mooncake-protocol": "vllm", "pdgate.io/mooncake-bootstrap-port": "x"},
        ),
        (
            "mooncake",
            "vLLM",
            {"pdgate.io/mooncake-protocol": "vllm", "pdgate.io/mooncake-bootstrap-port": "0"},
        ),
        ("http", "SGLang", {"pdgate.io/sglang-bootstrap-port": "70000"}),
    ],
)
def test_get_connector_rejects_unknown(kind: str, engine: str, annotations: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        get_connector(kind, engine, annotations)


# --- http ---------------------------------------------------------------------------


async def test_http_prefill_is_one_token_and_decode_is_untouched() -> None:
    body = chat_body(max_completion_tokens=64, min_tokens=5)
    original = copy.deepcopy(body)
    client = RecordingClient(answer={"choices": []})
    call = make_call(body)

    handoff = await HTTPConnector().start(call, client)

    assert handoff.prefill_task is None
    assert len(client.posts) == 1
    post = client.posts[0]
    assert post.pod is PREFILL
    assert post.path == "/v1/chat/completions"
    assert post.headers == call.headers
    assert post.deadline == call.deadline
    expected = dict(original)
    del expected["stream_options"]
    expected.update(stream=False, max_tokens=1, max_completion_tokens=1, min_tokens=1)
    assert post.body == expected
    assert handoff.decode_body == original
    assert call.body == original  # the retry loop reuses it


async def test_http_adds_no_fields_the_client_did_not_send() -> None:
    body = {"model": "m", "prompt": "hi", "min_tokens": 1}
    client = RecordingClient()
    await HTTPConnector().start(make_call(body), client)
    assert client.posts[0].body == {
        "model": "m",
        "prompt": "hi",
        "min_tokens": 1,
        "stream": False,
        "max_tokens": 1,
    }


async def test_http_prefill_failure_propagates() -> None:
    error = UpstreamError("status_5xx", "boom", retryable=True, pod=PREFILL)
    with pytest.raises(UpstreamError) as caught:
        await HTTPConnector().start(make_call(), RecordingClient(post_error=error))
    assert caught.value is error


# --- nixl / vllm-ascend mooncake ----------------------------------------------------


@pytest.mark.parametrize("connector", [NixlConnector(), MooncakeConnector()])
async def test_handle_flow_shapes_both_bodies(connector: KVConnector) -> None:
    body = chat_body(max_completion_tokens=64, min_tokens=3)
    original = copy.deepcopy(body)
    handle = nixl_handle(remote_ptp_size=2, last_token_id=42)
    client = RecordingClient(answer={"id": "cmpl-1", "kv_transfer_params": handle})
    call = make_call(body)

    handoff = await connector.start(call, client)

    assert handoff.prefill_task is None  # sequential: prefill already finished
    assert len(client.posts) == 1
    post = client.posts[0]
    assert post.headers == call.headers
    expected = dict(original)
    del expected["stream_options"]
    expected.update(
        stream=False,
        max_tokens=1,
        max_completion_tokens=1,
        min_tokens=1,
        kv_transfer_params=NULL_PREFILL_PARAMS,
    )
    assert post.body == expected
    assert handoff.decode_body == {**original, "kv_transfer_params": handle}
    assert handoff.decode_body["kv_transfer_params"] == nixl_handle(
        remote_ptp_size=2, last_token_id=42
    )
    assert call.body == original


async def test_handle_flow_sets_min_tokens_when_absent() -> None:
    client = RecordingClient(answer={"kv_transfer_params": nixl_handle()})
    body = {"model": "m", "prompt": "hello", "max_tokens": 10}
    handoff = await NixlConnector().start(make_call(body), client)
    assert client.posts[0].body == {
        "model": "m",
        "prompt": "hello",
        "max_tokens": 1,
        "min_tokens": 1,
        "stream": False,
        "kv_transfer_params": NULL_PREFILL_PARAMS,
    }
    assert "max_completion_tokens" not in client.posts[0].body
    assert handoff.decode_body == {**body, "kv_transfer_params": nixl_handle()}


async def test_handle_flow_accepts_empty_block_list() -> None:
    handle = nixl_handle(remote_block_ids=[])
    client = RecordingClient(answer={"kv_transfer_params": handle})
    handoff = await NixlConnector().start(make_call(), client)
    assert handoff.decode_body["kv_transfer_params"] == handle


@pytest.mark.parametrize(
    "answer",
    [
        {"id": "cmpl-1", "choices": []},
        {"kv_transfer_params": None},
        {"kv_transfer_params": "eng-prefill"},
        {"kv_transfer_params": [nixl_handle()]},
        {"kv_transfer_params": {}},
        {"kv_transfer_params": {k: v for k, v in nixl_handle().items() if k != "remote_engine_id"}},
        {"kv_transfer_params": nixl_handle(remote_engine_id=None)},
        {"kv_transfer_params": nixl_handle(remote_engine_id="")},
        {"kv_transfer_params": {k: v for k, v in nixl_handle().items() if k != "remote_block_ids"}},
        {"kv_transfer_params": nixl_handle(remote_block_ids=None)},
    ],
)
@pytest.mark.parametrize("connector", [NixlConnector(), MooncakeConnector()])
async def test_handle_flow_never_decodes_without_a_handle(
    connector: KVConnector, answer: dict[str, Any]
) -> None:
    with pytest.raises(UpstreamError) as caught:
        await connector.start(make_call(), RecordingClient(answer=answer))
    error = caught.value
    assert error.reason == "missing_kv_params"
    assert error.retryable is True
    assert error.phase == "prefill"
    assert error.pod is PREFILL


async def test_handle_flow_prefill_failure_propagates() -> None:
    error = UpstreamError("connect", "down", retryable=True, pod=PREFILL)
    with pytest.raises(UpstreamError) as caught:
        await NixlConnector().start(make_call(), RecordingClient(post_error=error))
    assert caught.value is error


def load_peer_wire() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The client body, and what vLLM Router sent prefill and decode for it."""
    records = [json.loads(line) for line in PEER_WIRE.read_text().splitlines() if line.strip()]
    render = [r for r in records if r["path"].endswith("/render")]
    hops = {r["received_by"]: r for r in records if r["path"] == "/v1/chat/completions"}
    # The render call carries the client body as vLLM Router parsed it (with the
    # defaults it fills in, e.g. `no_stop_trim`), before any PD field.
    assert render and render[0]["body"] == render[-1]["body"]
    return render[0]["body"], hops["prefill"], hops["decode"]


async def test_nixl_matches_vllm_router_wire_capture() -> None:
    client_body, prefill_hop, decode_hop = load_peer_wire()
    answer_params = decode_hop["body"]["kv_transfer_params"]
    client = RecordingClient(
        answer={"id": "cmpl-x", "choices": [], "kv_transfer_params": copy.deepcopy(answer_params)}
    )
    headers = {
        "content-type": "application/json",
        "x-request-id": prefill_hop["headers"]["x-request-id"],
    }
    call = make_call(copy.deepcopy(client_body), headers=headers)

    handoff = await NixlConnector().start(call, client)

    sent_prefill = client.posts[0].body
    sent_decode = handoff.decode_body
    for name in ("max_tokens", "stream", "min_tokens", "kv_transfer_params"):
        assert sent_prefill.get(name) == prefill_hop["body"].get(name), name
        assert sent_decode.get(name) == decode_hop["body"].get(name), name
    assert sent_prefill == prefill_hop["body"]
    assert sent_decode == decode_hop["body"]
    # Both hops carry one X-Request-Id in the capture; the prefill gets the call's headers,
    # which the router also sends to decode.
    assert prefill_hop["headers"]["x-request-id"] == decode_hop["headers"]["x-request-id"]
    assert client.posts[0].headers["x-request-id"] == decode_hop["headers"]["x-request-id"]


# --- sglang -------------------------------------------------------------------------


async def test_sglang_runs_prefill_beside_decode() -> None:
    gate = asyncio.Event()
    client = RecordingClient(answer={"id": "p"}, gate=gate)
    call = make_call()

    handoff = await SGLangConnector().start(call, client)

    assert handoff.prefill_task is not None
    await asyncio.sleep(0)
    assert len(client.posts) == 1  # prefill is on the wire...
    assert not handoff.prefill_task.done()  # ...and still running when decode is handed out
    gate.set()
    assert await finish(handoff) == {"id": "p"}


async def test_sglang_bootstrap_fields_match_on_both_requests() -> None:
    body = chat_body()
    original = copy.deepcopy(body)
    client = RecordingClient()
    call = make_call(body)

    handoff = await SGLangConnector().start(call, client)
    await finish(handoff)

    prefill = client.posts[0].body
    decode = handoff.decode_body
    room = decode["bootstrap_room"]
    assert isinstance(room, int) and 0 <= room < 2**63
    fields = {"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": room}
    assert decode == {**original, **fields}
    expected_prefill = {**original, **fields, "stream": False}
    del expected_prefill["stream_options"]
    assert prefill == expected_prefill  # max_tokens stays the client's, as SGLang's router
    assert client.posts[0].headers == call.headers
    assert client.posts[0].pod is PREFILL
    assert call.body == original


async def test_sglang_port_from_annotations() -> None:
    client = RecordingClient()
    handoff = await SGLangConnector(bootstrap_port=9000).start(make_call(), client)
    await finish(handoff)
    assert handoff.decode_body["bootstrap_port"] == 9000
    call = make_call(annotations={"pdgate.io/sglang-bootstrap-port": "9100"})
    handoff = await SGLangConnector(bootstrap_port=9000).start(call, client)
    await finish(handoff)
    assert handoff.decode_body["bootstrap_port"] == 9100
    assert client.posts[-1].body["bootstrap_port"] == 9100


async def test_sglang_bad_port_annotation_fails_the_call() -> None:
    call = make_call(annotations={"pdgate.io/sglang-bootstrap-port": "nope"})
    client = RecordingClient()
    with pytest.raises(UpstreamError) as caught:
        await SGLangConnector().start(call, client)
    assert caught.value.reason == "bad_config"
    assert caught.value.retryable is False
    assert client.posts == []


async def test_sglang_rooms_are_fresh_per_attempt() -> None:
    client = RecordingClient()
    rooms = set()
    for _ in range(20):
        handoff = await SGLangConnector().start(make_call(), client)
        await finish(handoff)
        rooms.add(handoff.decode_body["bootstrap_room"])
    assert len(rooms) == 20


@pytest.mark.parametrize(
    ("extra", "size"),
    [
        ({"n": 3}, 3),
        ({"n": 1}, None),
        ({"prompt": ["a", "b"]}, 2),
        ({"prompt": [[1, 2], [3]]}, 2),
        ({"prompt": [1, 2, 3]}, None),
        ({"prompt": "a"}, None),
        ({"text": ["a", "b", "c"]}, 3),
        ({"input_ids": [[1], [2]]}, 2),
        ({"input_ids": [1, 2]}, None),
    ],
)
async def test_sglang_batches_get_one_room_per_sample(
    extra: dict[str, Any], size: int | None
) -> None:
    client = RecordingClient()
    handoff = await SGLangConnector().start(make_call({"model": "m", **extra}), client)
    await finish(handoff)
    decode = handoff.decode_body
    prefill = client.posts[0].body
    for name in ("bootstrap_host", "bootstrap_port", "bootstrap_room"):
        assert prefill[name] == decode[name]
    if size is None:
        assert isinstance(decode["bootstrap_room"], int)
        return
    assert decode["bootstrap_host"] == ["10.0.0.1"] * size
    assert decode["bootstrap_port"] == [8998] * size
    assert len(set(decode["bootstrap_room"])) == size


async def test_sglang_prefill_failure_surfaces_in_the_task() -> None:
    error = UpstreamError("status_5xx", "boom", retryable=True, pod=PREFILL)
    handoff = await SGLangConnector().start(make_call(), RecordingClient(post_error=error))
    with pytest.raises(UpstreamError) as caught:
        await finish(handoff)
    assert caught.value is error


# --- upstream vLLM mooncake ---------------------------------------------------------


def query_answer(*ranks: int) -> dict[str, Any]:
    return {
        str(rank): {
            "engine_id": f"eng-{rank}",
            "worker_addr": {"0": {"0": f"10.0.0.1:{6000 + rank}"}},
        }
        for rank in ranks
    }


async def test_mooncake_vllm_queries_then_runs_prefill_beside_decode() -> None:
    gate = asyncio.Event()
    client = RecordingClient(query=query_answer(0), gate=gate, answer={"id": "p"})
    call = make_call(chat_body(max_completion_tokens=64))

    handoff = await MooncakeVllmConnector().start(call, client)

    assert [g.url for g in client.gets] == ["http://10.0.0.1:8998/query"]
    assert client.gets[0].headers == {}
    assert handoff.prefill_task is not None
    await asyncio.sleep(0)
    assert len(client.posts) == 1
    assert not handoff.prefill_task.done()
    gate.set()
    assert await finish(handoff) == {"id": "p"}


async def test_mooncake_vllm_bodies() -> None:
    body = chat_body(max_completion_tokens=64)
    original = copy.deepcopy(body)
    client = RecordingClient(query=query_answer(0))
    call = make_call(body)

    handoff = await MooncakeVllmConnector().start(call, client)
    await finish(handoff)

    prefill = client.posts[0].body
    decode = handoff.decode_body
    transfer_id = decode["kv_transfer_params"]["transfer_id"]
    assert transfer_id.startswith("xfer-req-1-")
    expected_prefill = dict(original)
    del expected_prefill["stream_options"]
    expected_prefill.update(
        stream=False,
        max_tokens=1,
        max_completion_tokens=1,
        min_tokens=1,
        kv_transfer_params={
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": transfer_id,
        },
    )
    assert prefill == expected_prefill
    assert decode == {
        **original,
        "kv_transfer_params": {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "transfer_id": transfer_id,
            "remote_bootstrap_addr": "http://10.0.0.1:8998",
            "remote_engine_id": "eng-0",
        },
    }
    assert client.posts[0].headers == {**call.headers, "X-data-parallel-rank": "0"}
    assert call.body == original


async def test_mooncake_vllm_transfer_ids_are_fresh_per_attempt() -> None:
    client = RecordingClient(query=query_answer(0))
    ids = set()
    for _ in range(10):
        handoff = await MooncakeVllmConnector().start(make_call(), client)
        await finish(handoff)
        ids.add(handoff.decode_body["kv_transfer_params"]["transfer_id"])
    assert len(ids) == 10


async def test_mooncake_vllm_bootstrap_port_and_ipv6() -> None:
    client = RecordingClient(query=query_answer(0))
    call = make_call(
        prefill=Pod("fd00::5", 8000), annotations={"pdgate.io/mooncake-bootstrap-port": "9200"}
    )
    handoff = await MooncakeVllmConnector().start(call, client)
    await finish(handoff)
    assert client.gets[0].url == "http://[fd00::5]:9200/query"
    assert handoff.decode_body["kv_transfer_params"]["remote_bootstrap_addr"] == (
        "http://[fd00::5]:9200"
    )
    handoff = await MooncakeVllmConnector(bootstrap_port=9300).start(make_call(), client)
    await finish(handoff)
    assert client.gets[-1].url == "http://10.0.0.1:9300/query"


async def test_mooncake_vllm_bounds_the_query_wait() -> None:
    client = RecordingClient(query=query_answer(0))
    now = asyncio.get_running_loop().time()
    handoff = await MooncakeVllmConnector().start(make_call(deadline=now + 100), client)
    await finish(handoff)
    assert client.gets[0].deadline <= now + 6
    handoff = await MooncakeVllmConnector().start(make_call(deadline=now + 1), client)
    await finish(handoff)
    assert client.gets[-1].deadline == now + 1


async def test_mooncake_vllm_pins_the_client_rank() -> None:
    client = RecordingClient(query=query_answer(0, 1, 2))
    call = make_call(headers={"x-request-id": "req-1", "x-data-parallel-rank": "2"})
    handoff = await MooncakeVllmConnector().start(call, client)
    await finish(handoff)
    assert handoff.decode_body["kv_transfer_params"]["remote_engine_id"] == "eng-2"
    assert client.posts[0].headers == {"x-request-id": "req-1", "X-data-parallel-rank": "2"}


async def test_mooncake_vllm_pins_the_rank_the_router_picked() -> None:
    """A prefill target that is one rank of a data-parallel pod: that rank's engine,
    whatever the client asked for; a bootstrap answer without it is this pod's fault."""
    client = RecordingClient(query=query_answer(0, 1, 2))
    rank1 = Pod("10.0.0.1", 8000, dp_rank=1, rank_pin="1")
    call = make_call(headers={"x-request-id": "req-1", "x-data-parallel-rank": "2"},
                     prefill=rank1)
    handoff = await MooncakeVllmConnector().start(call, client)
    await finish(handoff)
    assert handoff.decode_body["kv_transfer_params"]["remote_engine_id"] == "eng-1"
    assert client.posts[0].headers == {"x-request-id": "req-1", "X-data-parallel-rank": "1"}
    lonely = RecordingClient(query=query_answer(0))
    with pytest.raises(UpstreamError) as caught:
        await MooncakeVllmConnector().start(make_call(prefill=rank1), lonely)
    assert caught.value.reason == "bad_bootstrap" and lonely.posts == []


@pytest.mark.parametrize(("pin", "entry", "bootstrap_port"), [("1", "1", 8998), (None, "0", 8999)])
async def test_mooncake_vllm_names_a_node_rank_by_its_local_index(
    pin: str | None, entry: str, bootstrap_port: int
) -> None:
    """Global rank 3, its pod's second rank. Hybrid (pinned by local index 1): the pod's
    bootstrap server lists its engines by local index, as vLLM registers them
    (`get_mooncake_dp_engine_index`). External (no pin): the rank's own servers, API and
    bootstrap ports + its index on the pod, list its one engine as 0."""
    client = RecordingClient(query=query_answer(0, 1))
    call = make_call(prefill=Pod("10.0.0.1", 8001, dp_rank=3, rank_pin=pin, local_index=1))
    handoff = await MooncakeVllmConnector().start(call, client)
    await finish(handoff)
    assert client.gets[0].url == f"http://10.0.0.1:{bootstrap_port}/query"
    assert handoff.decode_body["kv_transfer_params"]["remote_engine_id"] == f"eng-{entry}"


async def test_mooncake_vllm_picks_a_rank_and_its_engine() -> None:
    client = RecordingClient(query=query_answer(0, 1, 2, 3))
    seen = set()
    for _ in range(40):
        handoff = await MooncakeVllmConnector().start(make_call(), client)
        await finish(handoff)
        rank = client.posts[-1].headers["X-data-parallel-rank"]
        assert handoff.decode_body["kv_transfer_params"]["remote_engine_id"] == f"eng-{rank}"
        seen.add(rank)
    assert len(seen) > 1


@pytest.mark.parametrize(
    "query",
    [
        None,
        [],
        "eng",
        {},
        {"0": "eng-0"},
        {"0": {"worker_addr": {"0": {"0": "a:1"}}}},
        {"0": {"engine_id": "", "worker_addr": {"0": {"0": "a:1"}}}},
        {"0": {"engine_id": 7, "worker_addr": {"0": {"0": "a:1"}}}},
        {"0": {"engine_id": "eng-0"}},
        {"0": {"engine_id": "eng-0", "worker_addr": {}}},
        {"0": {"engine_id": "eng-0", "worker_addr": ["a:1"]}},
        {"rank0": {"engine_id": "eng-0", "worker_addr": {"0": {"0": "a:1"}}}},
        # Older vLLM keyed /query by engine id: not this protocol.
        {"eng-0": {"0": {"0": "a:1"}}},
    ],
)
async def test_mooncake_vllm_rejects_a_bad_query_answer(query: Any) -> None:
    client = RecordingClient(query=query)
    with pytest.raises(UpstreamError) as caught:
        await MooncakeVllmConnector().start(make_call(), client)
    error = caught.value
    assert error.reason == "bad_bootstrap"
    assert error.retryable is True
    assert error.pod is PREFILL
    assert error.phase == "prefill"
    assert client.posts == []  # no prefill without a rendezvous


async def test_mooncake_vllm_failed_query_is_a_bootstrap_error() -> None:
    cause = UpstreamError("connect", "refused", retryable=True, phase="prefill")
    client = RecordingClient(get_error=cause)
    with pytest.raises(UpstreamError) as caught:
        await MooncakeVllmConnector().start(make_call(), client)
    error = caught.value
    assert error.reason == "bad_bootstrap"
    assert error.retryable is True
    assert error.pod is PREFILL
    assert error.__cause__ is cause
    assert client.posts == []


async def test_mooncake_vllm_prefill_failure_surfaces_in_the_task() -> None:
    error = UpstreamError("status_5xx", "boom", retryable=True, pod=PREFILL)
    client = RecordingClient(query=query_answer(0), post_error=error)
    handoff = await MooncakeVllmConnector().start(make_call(), client)
    with pytest.raises(UpstreamError) as caught:
        await finish(handoff)
    assert caught.value is error
