"""The HTTP face of the simulator: vLLM's OpenAI-compatible routes on aiohttp.web.

Kept cheap per request because router-overhead benchmarks run against it: orjson, no
middleware, no access log, and with `--fast` a whole stream goes out in one write.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
import uuid
from collections import deque
from typing import Any, Final

import orjson
from aiohttp import web

from engine_sim.data_parallel import RANK_HEADER, EngineGroup, rank_view
from engine_sim.engine import Engine, Generation
from engine_sim.faults import (
    CRASH_EXIT_STATUS,
    LEAKY_ERROR_MESSAGE,
    FaultPlan,
    Faults,
    spec_from_json,
)
from engine_sim.kv_params import TransferMode, parse_kv_transfer_params
from engine_sim.kv_transfer import KVTransferError
from engine_sim.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from engine_sim.protocol import (
    Endpoint,
    ParsedRequest,
    RequestError,
    check_model,
    parse_request,
)
from engine_sim.render import generate_request
from engine_sim.responses import (
    ChunkWriter,
    answer_text,
    chat_completion,
    error_body,
    stream_pieces,
    text_completion,
    usage,
)
from engine_sim.scheduler import QueueFullError
from engine_sim.surface import (
    ResponseWriter,
    embed,
    embedding_dim,
    embedding_response,
    encoding_format,
    rerank_response,
    responses_chat_body,
    score_pairs,
    score_response,
    similarity,
)
from router.tokenization import ChatInputError

log = logging.getLogger(__name__)

REQUEST_ID_HEADER: Final = "X-Request-Id"
_JSON: Final = "application/json"
#: Recent W3C `traceparent` headers received, kept for `/sim/stats` (tests join traces).
MAX_TRACEPARENTS: Final = 256
_SSE_HEADERS: Final = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
}


def _json(payload: Any, status: int = 200, request_id: str | None = None) -> web.Response:
    headers = {REQUEST_ID_HEADER: request_id} if request_id else None
    return web.Response(
        body=orjson.dumps(payload), status=status, content_type=_JSON, headers=headers
    )


def _error(exc: RequestError | KVTransferError | QueueFullError, request_id: str) -> web.Response:
    if isinstance(exc, KVTransferError):
        # A failed transfer is the engine's fault, not the client's: log it, as vLLM logs
        # a failed KV load.
        log.warning("request %s: KV transfer failed (%s): %s", request_id, exc.reason,
                    exc.message)
    if isinstance(exc, RequestError):
        body = error_body(exc.message, exc.status, exc.err_type, exc.param)
        return _json(body, exc.status, request_id)
    if isinstance(exc, KVTransferError):
        err_type = "ServiceUnavailableError" if exc.status == 503 else "InternalServerError"
        return _json(error_body(exc.message, exc.status, err_type), exc.status, request_id)
    body = error_body(f"engine overloaded: {exc}", 503, "ServiceUnavailableError")
    return _json(body, 503, request_id)


class SimServer:
    """Routes requests to one `Engine`, or to one of a data-parallel group's."""

    def __init__(self, engines: Engine | EngineGroup, faults: Faults | None = None) -> None:
        self.group = engines if isinstance(engines, EngineGroup) else EngineGroup([engines])
        # Rank 0: what every rank shares (config, tokenizer, limits, the /metrics page).
        self.engine = self.group.engines[0]
        self.faults = faults or Faults()
        self.cancelled = 0  # generate requests whose client went away (the handler was cancelled)
        self._created = int(time.time())
        self.traceparents: deque[dict[str, str]] = deque(maxlen=MAX_TRACEPARENTS)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions/render", self.render_chat)
        app.router.add_post("/v1/completions/render", self.render_completion)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_post("/v1/responses", self.responses)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            app.router.add_post(path, self.rerank)
        for path in ("/score", "/v1/score"):
            app.router.add_post(path, self.score)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ping", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/sim/stats", self.sim_stats)
        app.router.add_get("/sim/faults", self.get_faults)
        app.router.add_post("/sim/faults", self.set_faults)  # merge fields into the spec
        app.router.add_put("/sim/faults", self.set_faults)  # replace the spec
        return app

    async def _parse(self, request: web.Request, endpoint: Endpoint) -> ParsedRequest:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            raise RequestError(f"invalid JSON body: {exc}") from exc
        return parse_request(body, endpoint, self.engine.tokenizer, self.engine.limits)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    def _request_id(self, request: web.Request) -> str:
        """The caller's X-Request-Id (or a new one); notes a `traceparent` it carried."""
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        traceparent = request.headers.get("traceparent")
        if traceparent is not None:
            self.traceparents.append(
                {"path": request.path, "request_id": request_id, "traceparent": traceparent}
            )
        return request_id

    async def _generate(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        arrival = time.perf_counter()
        request_id = self._request_id(request)
        try:
            fault = self.faults.plan(await request.read()) if self.faults.armed else None
            if fault is not None:
                early = await self._inject_early(fault, request_id)
                if early is not None:
                    return early
            parsed = await self._parse(request, endpoint)
            try:
                plan = parse_kv_transfer_params(parsed.kv_transfer_params)
            except ValueError as exc:
                raise RequestError(str(exc), param="kv_transfer_params") from exc
            with self.group.route(request.headers.get(RANK_HEADER)) as engine:
                if fault is not None and fault.kv_missing and plan.mode is TransferMode.IMPORT:
                    self.faults.count("kv_missing")
                    raise KVTransferError(
                        "missing", 503,
                        "KV block 0 is not in the store (engine_sim fault injection)",
                    )
                response_id = f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-{request_id}"
                # Like vLLM, the engine-internal id adds random characters to the one given.
                internal_id = f"{response_id}-{secrets.token_hex(4)}"
                async with engine.run(parsed, internal_id, plan, arrival) as generation:
                    if parsed.stream:
                        return await self._stream(
                            request, engine, parsed, generation, response_id, request_id, fault
                        )
                    return await self._complete(
                        request, engine, parsed, generation, response_id, request_id, fault
                    )
        except (RequestError, KVTransferError, QueueFullError) as exc:
            return _error(exc, request_id)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def _inject_early(self, fault: FaultPlan, request_id: str) -> web.Response | None:
        """Faults that strike before the request is parsed: crash, slow start, hang, error."""
        faults = self.faults
        if fault.crash:
            faults.count("crash")
            log.error("fault injection: crashing on request %d (%s)", faults.requests, request_id)
            os._exit(CRASH_EXIT_STATUS)
        if fault.slow_start_s:
            faults.count("slow_start")
            await asyncio.sleep(fault.slow_start_s)
        if fault.hang_s is not None:
            faults.count("hang")
            await asyncio.sleep(fault.hang_s)
            body = error_body("engine_sim fault injection: hung request released", 504)
            return _json(body, 504, request_id)
        if fault.error_status is not None:
            faults.count("error")
            status = fault.error_status
            return _json(error_body(LEAKY_ERROR_MESSAGE, status, "InternalServerError"), status,
                         request_id)
        return None

    def _drop_connection(self, request: web.Request) -> None:
        self.faults.count("drop")
        transport = request.transport
        if transport is not None:
            transport.abort()

    async def _complete(
        self,
        request: web.Request,
        engine: Engine,
        parsed: ParsedRequest,
        generation: Generation,
        response_id: str,
        request_id: str,
        fault: FaultPlan | None = None,
    ) -> web.StreamResponse:
        kv_transfer_params = generation.kv_transfer_params
        if fault is not None:
            if fault.drop_after_chunks is not None:
                self._drop_connection(request)
                return web.Response()
            if fault.no_kv_params and kv_transfer_params is not None:
                self.faults.count("no_kv_params")
                kv_transfer_params = None
        if engine.paces_tokens:
            for _ in range(len(generation.pieces) - 1):
                await engine.token_gap()
        args = (response_id, int(time.time()), parsed.model,
                answer_text(parsed, generation.pieces),
                usage(generation.prompt_tokens, len(generation.pieces)), kv_transfer_params)
        body = (chat_completion(*args, role=parsed.role) if parsed.endpoint == "chat"
                else text_completion(*args))
        return _json(body, request_id=request_id)

    async def _stream(
        self,
        request: web.Request,
        engine: Engine,
        parsed: ParsedRequest,
        generation: Generation,
        response_id: str,
        request_id: str,
        fault: FaultPlan | None = None,
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={**_SSE_HEADERS, REQUEST_ID_HEADER: request_id})
        await response.prepare(request)
        writer = ChunkWriter(parsed, response_id, int(time.time()))
        pieces = stream_pieces(parsed, generation.pieces)  # one a chunk, echo included
        generated = len(generation.pieces)  # what the usage counts: the engine's tokens
        last = len(pieces) - 1
        try:
            if fault is not None and fault.drop_after_chunks is not None:
                head = writer.start()
                for i, piece in enumerate(pieces[: fault.drop_after_chunks]):
                    if i and engine.paces_tokens:
                        await engine.token_gap()
                    await response.write(head + writer.token(piece, i == last))
                    head = b""
                self._drop_connection(request)
                return response
            if not engine.paces_tokens:
                out = [writer.start()]
                out.extend(writer.token(piece, i == last) for i, piece in enumerate(pieces))
                out.append(writer.end(generated))
                await response.write(b"".join(out))
            else:
                await response.write(writer.start() + writer.token(pieces[0], last == 0))
                for i in range(1, len(pieces)):
                    await engine.token_gap()
                    await response.write(writer.token(pieces[i], i == last))
                await response.write(writer.end(generated))
            await response.write_eof()
        except ConnectionResetError:
            log.info("request %s: client went away mid-stream", request_id)
        return response

    async def render_chat(self, request: web.Request) -> web.Response:
        return await self._render(request, "chat")

    async def render_completion(self, request: web.Request) -> web.Response:
        return await self._render(request, "completion")

    async def _render(self, request: web.Request, endpoint: Endpoint) -> web.Response:
        request_id = self._request_id(request)
        try:
            parsed = await self._parse(request, endpoint)
        except RequestError as exc:
            return _error(exc, request_id)
        rendered = generate_request(parsed)
        return _json(rendered if endpoint == "chat" else [rendered], request_id=request_id)

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's `POST /tokenize`: `TokenizeCompletionRequest` (`prompt`,
        `add_special_tokens` default true) or `TokenizeChatRequest` (`messages`, `tools`,
        `add_generation_prompt` default true, `continue_final_message`,
        `add_special_tokens` default false, `chat_template_kwargs`), `return_token_strs`;
        answers `TokenizeResponse` {count, max_model_len, tokens, token_strs}."""
        request_id = self._request_id(request)
        try:
            body = await self._json_object(request)
            self._check_model(body)
            endpoint: Endpoint = "chat" if "messages" in body else "completion"
            if endpoint == "completion" and not isinstance(body.get("prompt"), str):
                raise RequestError("'prompt' must be a string", param="prompt")
            try:
                prompts = self.engine.tokenizer.request_ids(endpoint, body)
            except ChatInputError as exc:
                raise RequestError(str(exc)) from exc
        except RequestError as exc:
            return _error(exc, request_id)
        tokens = [t for prompt in prompts for t in prompt]
        strs = self.engine.tokenizer.token_strs(tokens) if body.get("return_token_strs") else None
        return _json(
            {
                "count": len(tokens),
                "max_model_len": self.engine.limits.max_model_len,
                "tokens": tokens,
                "token_strs": strs,
            },
            request_id=request_id,
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's `POST /detokenize`: `{"tokens": [...]}` -> `{"prompt": text}`."""
        request_id = self._request_id(request)
        try:
            body = await self._json_object(request)
            self._check_model(body)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**63
                for t in tokens
            ):
                raise RequestError("'tokens' must be a list of token ids", param="tokens")
        except RequestError as exc:
            return _error(exc, request_id)
        return _json({"prompt": self.engine.tokenizer.decode(tokens)}, request_id=request_id)

    def _ids(self, text: str) -> tuple[int, ...]:
        prompts = self.engine.tokenizer.request_ids("completion", {"prompt": text})
        return tuple(t for prompt in prompts for t in prompt)

    async def embeddings(self, request: web.Request) -> web.Response:
        """vLLM's `POST /v1/embeddings`: `input` (text, texts, token ids, token-id lists)
        or chat `messages`; `encoding_format`, `dimensions`. Vectors: `surface.embed`."""
        request_id = self._request_id(request)
        try:
            body = await self._json_object(request)
            self._check_model(body)
            dim, fmt = embedding_dim(body), encoding_format(body)
            value = body.get("input")
            if "messages" in body and value is None:
                try:
                    prompts = self.engine.tokenizer.request_ids("chat", body)
                except ChatInputError as exc:
                    raise RequestError(str(exc), param="messages") from exc
            elif isinstance(value, str):
                prompts = [self._ids(value)]
            elif isinstance(value, list) and value and all(type(t) is int for t in value):
                prompts = [tuple(value)]
            elif isinstance(value, list) and value and all(isinstance(t, str) for t in value):
                prompts = [self._ids(t) for t in value]
            elif isinstance(value, list) and value and all(
                    isinstance(p, list) and all(type(t) is int for t in p) for p in value):
                prompts = [tuple(p) for p in value]
            else:
                raise RequestError("'input' must be a string, a list of strings or token ids",
                                   param="input")
            if any(not p for p in prompts):
                raise RequestError("an input is empty", param="input")
        except RequestError as exc:
            return _error(exc, request_id)
        vectors = [embed(p, dim) for p in prompts]
        tokens = sum(len(p) for p in prompts)
        return _json(embedding_response(request_id, self.engine.limits.model, vectors, fmt,
                                        tokens), request_id=request_id)

    async def rerank(self, request: web.Request) -> web.Response:
        """vLLM's rerank routes: `query`, `documents` (strings), `top_n` (0: all)."""
        request_id = self._request_id(request)
        try:
            body = await self._json_object(request)
            self._check_model(body)
            query, documents = body.get("query"), body.get("documents")
            if not isinstance(query, str):
                raise RequestError("'query' must be a string", param="query")
            if not isinstance(documents, list) or not all(isinstance(d, str) for d in documents):
                raise RequestError("'documents' must be a list of strings", param="documents")
            top_n = body.get("top_n") or 0
            if type(top_n) is not int or top_n < 0:
                raise RequestError("'top_n' must be a non-negative integer", param="top_n")
        except RequestError as exc:
            return _error(exc, request_id)
        query_ids = self._ids(query)
        doc_ids = [self._ids(d) for d in documents]
        anchor = embed(query_ids)
        scores = [similarity(anchor, embed(ids)) for ids in doc_ids]
        total = sum(len(query_ids) + len(ids) for ids in doc_ids)
        return _json(rerank_response(request_id, self.engine.limits.model, scores, documents,
                                     top_n, total), request_id=request_id)

    async def score(self, request: web.Request) -> web.Response:
        """vLLM's score routes: `text_1` x `text_2` (1 x 1, 1 x N or N x N)."""
        request_id = self._request_id(request)
        try:
            body = await self._json_object(request)
            self._check_model(body)
            pairs = score_pairs(body.get("text_1"), body.get("text_2"))
        except RequestError as exc:
            return _error(exc, request_id)
        ids = [(self._ids(a), self._ids(b)) for a, b in pairs]
        scores = [similarity(embed(a), embed(b)) for a, b in ids]
        tokens = sum(len(a) + len(b) for a, b in ids)
        return _json(score_response(request_id, self.engine.limits.model, scores, tokens),
                     request_id=request_id)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """vLLM's `POST /v1/responses`: generated like chat, answered as a `Response`
        object or, with `stream: true`, its named events (no `[DONE]`, as vLLM)."""
        arrival = time.perf_counter()
        request_id = self._request_id(request)
        try:
            body = await self._json_object(request)
            self._check_model(body)
            parsed = parse_request(responses_chat_body(body), "chat", self.engine.tokenizer,
                                   self.engine.limits)
            plan = parse_kv_transfer_params(None)
            internal_id = f"resp_{request_id}-{secrets.token_hex(4)}"
            with self.group.route(request.headers.get(RANK_HEADER)) as engine:
                async with engine.run(parsed, internal_id, plan, arrival) as generation:
                    return await self._respond(request, engine, body, parsed, generation,
                                               request_id)
        except (RequestError, KVTransferError, QueueFullError) as exc:
            return _error(exc, request_id)
        except ChatInputError as exc:
            return _error(RequestError(str(exc), param="input"), request_id)

    async def _respond(
        self,
        request: web.Request,
        engine: Engine,
        body: dict[str, Any],
        parsed: ParsedRequest,
        generation: Generation,
        request_id: str,
    ) -> web.StreamResponse:
        """`/v1/responses`: a `Response` object, or its stream of named events."""
        writer = ResponseWriter(request_id, parsed.model, body, generation.prompt_tokens)
        pieces = generation.pieces
        if body.get("stream") is not True:
            if engine.paces_tokens:
                for _ in range(len(pieces) - 1):
                    await engine.token_gap()
            return _json(writer.response("".join(pieces), len(pieces)), request_id=request_id)
        response = web.StreamResponse(headers={**_SSE_HEADERS, REQUEST_ID_HEADER: request_id})
        await response.prepare(request)
        await response.write(writer.start())
        for i, piece in enumerate(pieces):
            if i and engine.paces_tokens:
                await engine.token_gap()
            await response.write(writer.delta(piece))
        await response.write(writer.end("".join(pieces), len(pieces)))
        await response.write_eof()
        return response

    async def _json_object(self, request: web.Request) -> dict[str, Any]:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            raise RequestError(f"invalid JSON body: {exc}") from exc
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        return body

    def _check_model(self, body: dict[str, Any]) -> None:
        check_model(body.get("model"), self.engine.limits)

    async def models(self, request: web.Request) -> web.Response:
        """The model and its LoRA adapters, as vLLM lists them (an adapter's `root` is its
        path, its `parent` the base model)."""
        model = self.engine.config.model
        cards = [(model, model, None)] + [
            (name, path, model) for name, path in self.engine.config.lora_modules
        ]
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": card_id,
                        "object": "model",
                        "created": self._created,
                        "owned_by": "vllm",
                        "root": root,
                        "parent": parent,
                        "max_model_len": self.engine.limits.max_model_len,
                        "permission": [
                            {
                                "id": f"modelperm-{card_id}",
                                "object": "model_permission",
                                "created": self._created,
                                "allow_create_engine": False,
                                "allow_sampling": True,
                                "allow_logprobs": True,
                                "allow_search_indices": False,
                                "allow_view": True,
                                "allow_fine_tuning": False,
                                "organization": "*",
                                "group": None,
                                "is_blocking": False,
                            }
                        ],
                    }
                    for card_id, root, parent in cards
                ],
            }
        )

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.engine.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE}
        )

    async def sim_stats(self, request: web.Request) -> web.Response:
        """One engine's stats; with data parallelism `{"data_parallel_size": N, "ranks":
        [each rank's]}`, or global rank R's alone with `?rank=R` (400 for a rank this
        server does not run; `data_parallel.rank_view`). Then the server's own fields."""
        try:
            stats = rank_view(self.group.engines, request.query.get("rank"),
                              lambda engine: engine.stats_json())
        except ValueError as exc:
            return _json(error_body(str(exc), 400), 400)
        return _json({**stats, "cancelled": self.cancelled,
                      "traceparents": list(self.traceparents)})

    async def get_faults(self, request: web.Request) -> web.Response:
        return _json({**self.faults.to_json(), "cancelled": self.cancelled})

    async def set_faults(self, request: web.Request) -> web.Response:
        """POST merges the given fields into the current spec; PUT starts from the defaults."""
        try:
            data = orjson.loads(await request.read())
            base = self.faults.spec if request.method == "POST" else None
            self.faults.set(spec_from_json(data, base))
        except (orjson.JSONDecodeError, ValueError) as exc:
            return _json(error_body(str(exc), 400), 400)
        log.info("fault spec now %s", self.faults.spec)
        return await self.get_faults(request)
