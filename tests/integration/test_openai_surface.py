"""The OpenAI/vLLM surface beyond chat and completions, through the router, end to end.

One router, two ModelServers of simulated pods: a PD server (one prefill, one decode pod)
and an aggregated one (one pod). The official openai SDK calls `models.retrieve`,
`embeddings.create` and `responses.create` (streaming and not); raw HTTP covers vLLM's
tokenize/detokenize, rerank and score routes. On the PD server these requests must reach
the decode pod alone: none of them runs a prefill.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest

from engine_sim.generation import expected_text
from engine_sim.surface import embed
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
from tests.sim_tokens import chat_ids, prompt_ids

pytestmark = pytest.mark.integration

PD_MODEL = "sim-surface-pd"
AGG_MODEL = "sim-surface-agg"
NET = loopback_net()
SPECS = [
    SimPodSpec("pd-prefill", f"{NET}.11", "prefill", "g0",
               {"app": "surface-pd", "group": "g0", "role": "prefill"}),
    SimPodSpec("pd-decode", f"{NET}.12", "decode", "g0",
               {"app": "surface-pd", "group": "g0", "role": "decode"}),
    SimPodSpec("agg-0", f"{NET}.13", "both", None, {"app": "surface-agg"}),
]
MODELS = (PD_MODEL, AGG_MODEL)


@pytest.fixture(scope="module")
def cluster(mooncake_master: object, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[SimCluster, int]]:
    sim = SimCluster(mooncake_master, tmp_path_factory.mktemp("surface"))
    port = free_port([spec.ip for spec in SPECS])
    try:
        for spec in SPECS:
            model = PD_MODEL if spec.name.startswith("pd") else AGG_MODEL
            sim.start_pod(spec, port, model, ["--fast", "--max-model-len", "4096"])
        sim.wait_pods(port, SPECS)
        write_yaml(sim.config_dir / "servers.yaml", [
            *server_manifests("surface-pd", PD_MODEL, app="surface-pd", port=port),
            *server_manifests("surface-agg", AGG_MODEL, app="surface-agg", port=port, pd=False),
        ])
        write_yaml(sim.config_dir / "pods.yaml", [pod_manifest(s) for s in SPECS])
        sim.start_router()
        yield sim, port
    finally:
        sim.stop()


def _client(cluster: tuple[SimCluster, int]) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{cluster[0].router_url}/v1", api_key="unused",
                              max_retries=0)


def _stats(cluster: tuple[SimCluster, int], pod: str) -> dict[str, Any]:
    ip = next(s.ip for s in SPECS if s.name == pod)
    stats = get_json(f"http://{ip}:{cluster[1]}/sim/stats")
    assert isinstance(stats, dict)
    return stats


def _prefill_requests(cluster: tuple[SimCluster, int]) -> int:
    stats = _stats(cluster, "pd-prefill")
    return sum(stats["requests"].values()) + stats["errors"]


async def test_models_retrieve_known_and_unknown(cluster: tuple[SimCluster, int]) -> None:
    client = _client(cluster)
    for name in MODELS:
        model = await client.models.retrieve(name)
        assert model.id == name and model.object == "model"
    with pytest.raises(openai.NotFoundError) as caught:
        await client.models.retrieve("no-such-model")
    assert caught.value.code == "model_not_found"
    assert caught.value.body["param"] == "model"  # type: ignore[index]


@pytest.mark.parametrize("model", MODELS)
async def test_embeddings_sdk(cluster: tuple[SimCluster, int], model: str) -> None:
    before = _prefill_requests(cluster)
    client = _client(cluster)
    texts = ["The river runs to the sea.", "Mountains stand still."]
    raw = await client.embeddings.with_raw_response.create(model=model, input=texts)
    result = raw.parse()  # the SDK asked for base64 and decoded it
    assert [d.index for d in result.data] == [0, 1]
    for text, item in zip(texts, result.data, strict=True):
        assert item.embedding == pytest.approx(embed(prompt_ids(text)), abs=1e-6)
    assert result.usage.prompt_tokens == sum(len(prompt_ids(t)) for t in texts)
    floats = await client.embeddings.create(model=model, input=texts[0],
                                            encoding_format="float", dimensions=8)
    assert floats.data[0].embedding == pytest.approx(embed(prompt_ids(texts[0]), 8), abs=1e-9)
    if model == PD_MODEL:
        assert raw.headers["x-pdgate-decode-pod"] == "pd-decode"
        assert "x-pdgate-prefill-pod" not in raw.headers
        assert _prefill_requests(cluster) == before  # no prefill for a pooling request


@pytest.mark.parametrize("model", MODELS)
async def test_responses_sdk(cluster: tuple[SimCluster, int], model: str) -> None:
    before = _prefill_requests(cluster)
    client = _client(cluster)
    question = "Where is the capital of China?"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}]
    # The pod computes the prompt itself (a plain request): its answer says so.
    want = expected_text(chat_ids(messages), 9, kv_from_store=False, model=model)
    response = await client.responses.create(model=model, input=question,
                                             instructions="Be brief.", max_output_tokens=9)
    assert response.object == "response" and response.status == "completed"
    assert response.output_text == want
    assert response.usage is not None and response.usage.output_tokens == 9

    stream = await client.responses.create(model=model, input=question,
                                           instructions="Be brief.", max_output_tokens=9,
                                           stream=True)
    kinds: list[str] = []
    deltas: list[str] = []
    final = None
    async for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        elif event.type == "response.completed":
            final = event.response
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert len(deltas) == 9 and "".join(deltas) == want
    assert final is not None and final.output_text == want
    if model == PD_MODEL:
        assert _prefill_requests(cluster) == before


async def _post(cluster: tuple[SimCluster, int], path: str, body: dict[str, Any]
                ) -> tuple[int, dict[str, Any], Any]:
    async with aiohttp.ClientSession() as session, session.post(
        cluster[0].router_url + path, json=body
    ) as response:
        return response.status, dict(response.headers), await response.json()


@pytest.mark.parametrize("model", MODELS)
async def test_tokenize_and_detokenize(cluster: tuple[SimCluster, int], model: str) -> None:
    text = "Tell me about rivers."
    status, headers, body = await _post(cluster, "/tokenize", {"model": model, "prompt": text})
    assert status == 200, body
    assert body["tokens"] == prompt_ids(text) and body["count"] == len(body["tokens"])
    status, _, back = await _post(cluster, "/detokenize",
                                  {"model": model, "tokens": body["tokens"]})
    assert status == 200 and text in back["prompt"]
    if model == PD_MODEL:
        assert headers["x-pdgate-decode-pod"] == "pd-decode"


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
async def test_rerank_routes(cluster: tuple[SimCluster, int], path: str) -> None:
    documents = ["Paris is in France.", "Beijing is the capital of China.", "Cats purr."]
    query = "capital of China"
    status, headers, body = await _post(cluster, path, {
        "model": PD_MODEL, "query": query, "documents": documents, "top_n": 2})
    assert status == 200, body
    anchor = embed(prompt_ids(query))
    scores = [(sum(a * b for a, b in zip(anchor, embed(prompt_ids(d)), strict=True)) + 1) / 2
              for d in documents]
    best = sorted(range(3), key=lambda i: -scores[i])[:2]
    assert [r["index"] for r in body["results"]] == best
    assert [r["document"]["text"] for r in body["results"]] == [documents[i] for i in best]
    assert body["results"][0]["relevance_score"] == pytest.approx(scores[best[0]])
    assert headers["x-pdgate-decode-pod"] == "pd-decode"


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
async def test_score_routes(cluster: tuple[SimCluster, int], path: str) -> None:
    status, _, body = await _post(cluster, path, {
        "model": AGG_MODEL, "text_1": "capital of China", "text_2": ["Beijing", "Paris"]})
    assert status == 200, body
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1]
    assert all(d["object"] == "score" and 0 <= d["score"] <= 1 for d in body["data"])
    # N x M with N != M: the engine's own 400 comes back to the client, OpenAI-shaped.
    status, _, body = await _post(cluster, path, {
        "model": AGG_MODEL, "text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/embeddings", {"model": PD_MODEL, "input": []}, "input"),
    ("/v1/responses", {"model": PD_MODEL, "input": 3}, "input"),
    ("/rerank", {"model": PD_MODEL, "documents": ["x"]}, "query"),
    ("/score", {"model": PD_MODEL, "text_1": "x"}, "text_2"),
    ("/detokenize", {"model": PD_MODEL, "tokens": ["x"]}, "tokens"),
    ("/tokenize", {"model": PD_MODEL}, "prompt"),
])
async def test_bad_bodies_are_refused_by_the_router(
    cluster: tuple[SimCluster, int], path: str, body: dict[str, Any], param: str
) -> None:
    status, _, answer = await _post(cluster, path, body)
    assert status == 400 and answer["error"]["param"] == param


async def test_unknown_model_is_an_openai_404(cluster: tuple[SimCluster, int]) -> None:
    client = _client(cluster)
    with pytest.raises(openai.NotFoundError) as caught:
        await client.embeddings.create(model="nope", input="x")
    assert caught.value.code == "model_not_found"
    status, _, body = await _post(cluster, "/rerank",
                                  {"model": "nope", "query": "q", "documents": ["d"]})
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_base64_is_what_the_sdk_decodes() -> None:
    """The simulator's base64 form is little-endian float32, as the SDK reads it."""
    from engine_sim.surface import encode_vector

    vector = embed([1, 2, 3], 4)
    packed = base64.b64decode(str(encode_vector(vector, "base64")))
    assert list(struct.unpack("<4f", packed)) == pytest.approx(vector, abs=1e-6)
