"""FastAPI's own errors come out OpenAI-shaped: 422 becomes a 400, crashes a JSON 500.

The router's control plane has no route with typed parameters yet, so a small app with
one shows what `router.control_errors.install` does with FastAPI's validation errors.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient

from router import control_errors


def _app() -> FastAPI:
    app = FastAPI()
    control_errors.install(app)

    @app.get("/items/{item}")
    async def item(item: int, limit: int = 10) -> dict[str, int]:
        return {"item": item, "limit": limit}

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("an internal detail")

    return app


def test_validation_errors_are_openai_400s() -> None:
    client = TestClient(_app())
    response = client.get("/items/abc")
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == "item"
    assert error["code"] == "invalid_value" and "item" in error["message"]
    assert client.get("/items/1?limit=x").json()["error"]["param"] == "limit"
    assert client.get("/items/1").json() == {"item": 1, "limit": 10}


def test_unknown_path_method_and_crash() -> None:
    client = TestClient(_app(), raise_server_exceptions=False)
    missing = client.get("/nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "Invalid URL (GET /nope)."
    wrong = client.post("/items/1")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "GET"
    crash = client.get("/boom")
    assert crash.status_code == 500
    assert crash.json()["error"] == {"message": "Internal error.", "type": "internal_error",
                                     "param": None, "code": None}
    assert "internal detail" not in crash.text
