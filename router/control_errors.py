"""OpenAI-shaped errors for the FastAPI control plane (models, probes, metrics, docs).

FastAPI answers unknown paths with `{"detail": "Not Found"}`, wrong methods with
`{"detail": "Method Not Allowed"}`, invalid parameters with a 422 list and crashes with
plain text; the openai SDK then shows only "Error code: 404". These handlers answer every
one of them as `{"error": {"message", "type", "param", "code"}}` through `APIError`:
unknown path 404 (`Invalid URL (GET /x).`, as OpenAI words it), 405 with `Allow`,
validation failures 400 (OpenAI has no 422), anything else 500.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from router.errors import APIError, method_not_allowed


def not_found(method: str, path: str) -> APIError:
    return APIError(404, f"Invalid URL ({method} {path}).", code="not_found")


def _render(exc: APIError) -> Response:
    return Response(exc.body(), status_code=exc.status, headers=exc.headers,
                    media_type="application/json")


def _http_error(request: Request, exc: HTTPException) -> APIError:
    if exc.status_code == 404:
        return not_found(request.method, request.url.path)
    if exc.status_code == 405:
        error = method_not_allowed(request.method)
        allow = (exc.headers or {}).get("Allow") or (exc.headers or {}).get("allow")
        if allow:
            error.headers["allow"] = allow
        return error
    message = exc.detail if isinstance(exc.detail, str) else "The request failed."
    kind = "invalid_request_error" if exc.status_code < 500 else "internal_error"
    return APIError(exc.status_code, message, type=kind, headers=dict(exc.headers or {}))


def _validation_error(exc: RequestValidationError) -> APIError:
    errors: list[Any] = list(exc.errors())
    first = errors[0] if errors else {}
    location = [str(part) for part in first.get("loc", ()) if part not in ("body", "query",
                                                                          "path", "header")]
    param = ".".join(location) or None
    message = str(first.get("msg", "The request is invalid."))
    return APIError(400, f"{param}: {message}" if param else message, param=param,
                    code="invalid_value")


def install(app: FastAPI) -> None:
    """Answer every error `app` produces in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return _render(exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return _render(_http_error(request, exc))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _render(_validation_error(exc))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        # Starlette re-raises after this answer, and the server logs the traceback.
        return _render(APIError(500, "Internal error.", type="internal_error"))
