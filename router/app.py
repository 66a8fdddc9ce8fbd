"""The ASGI application: a raw-ASGI data path for `/v1/*` POSTs, FastAPI for the rest.

The data path skips frameworks on purpose (a Starlette StreamingResponse costs about 8x
a raw ASGI stream; see ENGINEERING.md). It reads the body, validates it, and hands it to
the `Proxy` while a watcher listens on `receive()` for the client going away: uvicorn
reports a disconnect only there, and on one the request's task is cancelled, which
cancels prefill and decode upstream and releases the in-flight counters.

Before the body is read a data request passes the drain check, the header limits and the
API key; a router at its admission bound with a full queue answers 503 there, before any
parsing; after parsing, admission control proper (on by default, see admission.py).
`EarlyShed` makes that first 503 cheaper still: the connection layer asks it from the
request's head, before uvicorn builds a scope or starts a task, and it answers when the
same checks in the same order end in the same 503 (router/http/protocol.py).
With an admin port, `/metrics`,
the probes (`/health`, `/healthz`, `/readyz`) and the API's documents (`/docs`, `/redoc`,
`/openapi.json`) move to a FastAPI app of their own (`build_ops_app`); without one, the
documents and `/metrics`
need the API key when keys are set (`KEYED_CONTROL_PATHS`), and the probes stay open.
Every error either app answers is OpenAI-shaped (`router/control_errors.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.convertors import Convertor, register_url_convertor

from router import control_errors
from router.errors import APIError, bad_request, method_not_allowed, model_not_found
from router.http.protocol import EdgeCycle, direct_writer
from router.proxy import request_id_for
from router.request import (
    ENDPOINTS,
    ParsedRequest,
    body_too_large,
    openapi_paths,
    parse_request,
)
from router.resilience.drain import shutting_down
from router.responder import Responder
from router.security.limits import read_headers
from router.state import AppState

log = logging.getLogger("pdgate.app")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

DATA_PATHS = frozenset(ENDPOINTS)
#: The same paths as the connection layer sees them (raw bytes, not percent-decoded).
RAW_DATA_PATHS = frozenset(path.encode() for path in ENDPOINTS)
#: Control-plane paths that need the API key when keys are set (`/v1/models` checks it
#: itself): what the API looks like and how it is loaded is the clients' business only.
#: The probes (`/health`, `/healthz`, `/readyz`) stay open for the kubelet and tools.
DOC_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")
KEYED_CONTROL_PATHS = frozenset((*DOC_PATHS, "/metrics"))
CLIENT_CLOSED = 499  # nginx's code for "client closed the request", for metrics only
#: The `model` label of requests for no model a route serves (see router/metrics.py).
NO_MODEL = ""
#: How long a response cut off by the shutdown may take to send its ending.
SHUTDOWN_WRITE_S = 1.0


class _ModelIdConvertor(Convertor[str]):
    """A model id in a path: any characters, slashes (`org/name`) and newlines included
    (Starlette's `path` stops at a newline, and the id must reach the OpenAI 404)."""

    regex = "(?s:.+)"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("model_id", _ModelIdConvertor())


class EarlyShed:
    """The connection layer's `EarlyRefusal`: a data request that `_data` would shed
    before parsing (saturated admission, past the drain check, the header limits and the
    API key) is refused from its head. Anything else, including a request that fails one
    of those checks, goes to `_data`, which answers it as always."""

    def __init__(self, state: AppState) -> None:
        self.state = state

    def check(self, method: bytes, path: bytes, headers: list[tuple[bytes, bytes]]
              ) -> APIError | None:
        admission = self.state.resilience.admission
        if not admission.saturated() or path not in RAW_DATA_PATHS:
            return None
        try:
            _check_head(self.state, method.decode("latin-1"), headers)
        except APIError:
            return None
        return admission.refuse_saturated()

    def done(self, error: APIError, seconds: float, answered: bool) -> None:
        # As `_data` counts a client gone before its body ends: 499.
        self.state.metrics.request_done(
            NO_MODEL, error.status if answered else CLIENT_CLOSED, seconds)


class PDGateApp:
    """The ASGI entry point. Owns the lifespan; delegates the control plane to FastAPI."""

    def __init__(self, state: AppState) -> None:
        self.state = state
        separate_ops = state.config.security.admin_port is not None
        self.control = build_control_plane(state, ops=not separate_ops)
        self.ops = build_ops_app(state, self.control) if separate_ops else None
        #: For the API listener's connection layer (see `EarlyShed`).
        self.early_shed = EarlyShed(state)
        keyed = state.security.api_keys is not None and not separate_ops
        self._keyed_paths = KEYED_CONTROL_PATHS if keyed else frozenset()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http" and scope["path"] in DATA_PATHS:
            await self._data(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)
        else:
            if kind == "http":
                limits = self.state.security.config
                keys = self.state.security.api_keys
                try:
                    headers = read_headers(
                        scope["headers"], limits.max_headers, limits.max_header_bytes
                    )
                    if keys is not None and scope["path"] in self._keyed_paths:
                        keys.check(headers.get("authorization"))
                except APIError as exc:
                    await Responder(send).error(exc)
                    return
            await self.control(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.state.start()
                except Exception as exc:  # report, let the server exit
                    log.exception("start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.state.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _data(self, scope: Scope, receive: Receive, send: Send) -> None:
        began = time.perf_counter()
        out = Responder(send, began)
        model = NO_MODEL
        state = self.state
        drain = state.resilience.drain
        this = asyncio.current_task()
        assert this is not None
        drain.enter(this)
        headers: dict[str, str] | None = None  # once the head passed its checks
        try:
            headers = _check_head(state, scope["method"], scope["headers"])
            limits = state.security.config
            if state.resilience.admission.saturated():
                # Shed before parsing: the body is read (the connection stays usable) but
                # no JSON is parsed, no route resolved, no counter taken.
                if await _read_body(receive, limits.max_body_bytes) is not None:
                    await out.error(state.resilience.admission.refuse_saturated(),
                                    request_id_for(headers))
                return
            raw = await _read_body(receive, limits.max_body_bytes)
            if raw is None:
                return  # the client left before sending its body
            parsed = parse_request(scope["path"], raw, limits.max_body_bytes)
            if parsed.model in state.view.snapshot.routes_by_model:
                model = parsed.model  # known names only: a client cannot grow label sets
            if state.resilience.admission.enabled:
                work = self._admitted(parsed, headers, out, model)
            else:
                work = state.proxy.serve(parsed, headers, out)
            await _until_disconnect(work, receive, out, direct_writer(send))
        except APIError as exc:  # refused before the proxy gave the request its id
            if not out.started:
                await out.error(exc, request_id_for(headers))
        except ClientGone:
            out.status = CLIENT_CLOSED
        except asyncio.CancelledError:
            if not drain.draining:
                raise
            # The drain's cut-off (or the server's last-resort cancel): end, don't cut.
            this.uncancel()
            await _end_for_shutdown(out)
        except Exception:
            log.exception("unexpected error serving %s", scope["path"])
            if not out.started:
                await out.error(APIError(500, "Internal error.", type="internal_error"),
                                request_id_for(headers))
        finally:
            drain.leave(this)
            state.metrics.request_done(
                model, out.status or CLIENT_CLOSED, time.perf_counter() - began
            )

    async def _admitted(
        self, parsed: ParsedRequest, headers: dict[str, str], out: Responder, model: str
    ) -> None:
        """Serve once admission control lets the request in (or refuse it with a 503)."""
        admission = self.state.resilience.admission
        if not admission.try_enter(model):
            await admission.wait(model)
        try:
            await self.state.proxy.serve(parsed, headers, out)
        finally:
            admission.leave(model)


def _check_head(state: AppState, method: str, raw: Iterable[tuple[bytes, bytes]]
                ) -> dict[str, str]:
    """What a data request's head must pass before its body is read, in this order: the
    drain, the method, the header limits, the API key, a JSON media type (raises
    `APIError`). Its headers. `_data` and `EarlyShed` both go through it, so the refusal
    from the head sees the same checks in the same order."""
    if state.resilience.drain.draining:
        raise shutting_down()
    if method != "POST":
        raise method_not_allowed(method, allow="POST")
    limits = state.security.config
    headers = read_headers(raw, limits.max_headers, limits.max_header_bytes)
    if state.security.api_keys is not None:
        state.security.api_keys.check(headers.get("authorization"))
    media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        # vLLM's `validate_json_request` (a 400 in current vLLM, 415 before). It also keeps
        # a web page from posting to the API cross-site: a browser sends `text/plain` and
        # form bodies without asking the server first, never `application/json`.
        raise bad_request("Unsupported Media Type: Only 'application/json' is allowed",
                          code="unsupported_media_type")
    return headers


async def _end_for_shutdown(out: Responder) -> None:
    """End a response the shutdown cancelled with a `shutting_down` error, if the client
    still reads: within `SHUTDOWN_WRITE_S`, and quietly if cancelled again meanwhile."""
    with contextlib.suppress(asyncio.CancelledError, TimeoutError, OSError):
        async with asyncio.timeout(SHUTDOWN_WRITE_S):
            await out.end(shutting_down())


class ClientGone(Exception):
    """The client disconnected; the request was cancelled upstream."""


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _until_disconnect(
    work: Awaitable[None], receive: Receive, out: Responder, cycle: EdgeCycle | None
) -> None:
    """Run `work` in this task while watching for the client going away.

    uvicorn reports a disconnect only through `receive()`. One that comes before the
    response is finished cancels this task, which cancels prefill and decode upstream and
    releases every counter on the way out. (uvicorn also answers `http.disconnect` once
    the response is finished: that is no client gone, and the clean-up left runs.)
    Running `work` here rather than in a task of its own keeps one task per request off
    the hot path; on the edge's own cycle (`cycle`) the connection calls back on a
    disconnect, so no watcher task is needed either.
    """
    this = asyncio.current_task()
    assert this is not None
    gone = False

    def client_left() -> None:
        nonlocal gone
        if not out.finished:
            gone = True
            this.cancel()

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        client_left()

    watcher = None
    if cycle is not None:
        cycle.on_disconnect = client_left
        if cycle.disconnected:  # it left before the watch began
            cycle.client_left()
    else:
        watcher = asyncio.get_running_loop().create_task(watch())
    try:
        await work
    except asyncio.CancelledError:
        if not gone:
            raise
        this.uncancel()
        raise ClientGone from None
    finally:
        if watcher is not None:
            watcher.cancel()
        elif cycle is not None:
            cycle.on_disconnect = None


def build_control_plane(state: AppState, ops: bool = True) -> FastAPI:
    """Models, health, readiness, metrics and the API's documents: cheap endpoints,
    framework welcome. With `ops=False` (an admin port) the last four live elsewhere.

    The OpenAPI document also describes the data-path endpoints (served by `PDGateApp`
    before FastAPI sees them), so API tooling and schemathesis see the whole API.
    """
    docs: dict[str, Any] = {} if ops else {"openapi_url": None, "docs_url": None,
                                           "redoc_url": None}
    app = FastAPI(title="pdgate", version="0.1.0", **docs)
    control_errors.install(app)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            paths, components = openapi_paths()
            schema.setdefault("paths", {}).update(paths)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
            if state.security.api_keys is not None:
                schema["components"]["securitySchemes"] = {
                    "bearer": {"type": "http", "scheme": "bearer"}
                }
                schema["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        if state.security.api_keys is not None:
            state.security.api_keys.check(request.headers.get("authorization"))
        created = int(state.started_at)
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": created, "owned_by": "pdgate"}
                for name in state.view.snapshot.model_names()
            ],
        }

    @app.get("/v1/models/{model_id:model_id}")
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        """The SDK's `models.retrieve`: a served model, or an OpenAI-shaped 404."""
        if state.security.api_keys is not None:
            state.security.api_keys.check(request.headers.get("authorization"))
        if model_id not in state.view.snapshot.routes_by_model:
            raise model_not_found(model_id)
        return {"id": model_id, "object": "model", "created": int(state.started_at),
                "owned_by": "pdgate"}

    if ops:
        add_ops_routes(app, state)
    return app


def build_ops_app(state: AppState, api: FastAPI) -> FastAPI:
    """The admin port's app: metrics, probes and the documents of `api`, apart from
    client traffic (the admin port is not to be exposed, so none of it asks for a key)."""
    app = FastAPI(title="pdgate-admin", version="0.1.0", openapi_url=None, docs_url=None,
                  redoc_url=None)
    control_errors.install(app)
    add_ops_routes(app, state)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(api.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs() -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{api.title} - docs")

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> Response:
        return get_redoc_html(openapi_url="/openapi.json", title=f"{api.title} - ReDoc")

    return app


def add_ops_routes(app: FastAPI, state: AppState) -> None:
    @app.get("/health")
    async def health() -> Response:
        """200 while the process is up, with an empty body, as vLLM and SGLang answer."""
        return Response(status_code=200)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        ready = state.ready
        body: dict[str, Any] = {"ready": ready, "synced": state.synced,
                                "draining": state.draining}
        if state.config.sync is not None:  # which of several router processes answers
            body["origin"] = state.config.sync.origin
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await state.metrics_exposition(), media_type=CONTENT_TYPE_LATEST)
