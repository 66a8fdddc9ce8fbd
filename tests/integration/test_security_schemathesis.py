"""schemathesis against the router's own OpenAPI document: no 5xx from any input.

The document (`/openapi.json`, FastAPI's control plane) describes the raw-ASGI data-path
endpoints too, so schemathesis generates chat and completion bodies, valid and invalid,
and sends them through a real router to simulated PD pods. Half the generated bodies are
pointed at the served model so they reach the engines; the rest end at routing (404).
Every answer must be below 500, and every refusal an OpenAI error body.

Needs `pip install schemathesis` (skipped without it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.harness import SimCluster, free_port, write_yaml
from tests.integration.test_faults_kit import FaultCluster, Router, pd_specs, server_manifests

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

pytestmark = pytest.mark.integration

MODEL = "sim-schema-model"
KEY = "schema-key-0000"
STATUSES: Counter[int] = Counter()


@pytest.fixture(scope="module")
def schema_router(mooncake_master: object, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[Router]:
    specs = pd_specs("schema")
    port = free_port([s.ip for s in specs])
    cluster = FaultCluster(SimCluster(mooncake_master, tmp_path_factory.mktemp("schema")),
                           port, specs)
    keys = cluster.sim.workdir / "keys"
    keys.write_text(KEY + "\n")
    try:
        cluster.start_pods(MODEL, ["--fast", "--max-model-len", "2048"])
        write_yaml(cluster.sim.config_dir / "server.yaml",
                   server_manifests("schema", MODEL, app="schema", port=port))
        yield cluster.start_router(["--api-keys", str(keys), "--max-body-bytes", "262144"])
    finally:
        cluster.stop()
        print("\nschemathesis: statuses", dict(sorted(STATUSES.items())),
              "cases", sum(STATUSES.values()))


#: Every operation of the router's OpenAPI document, each fuzzed by its own test so that
#: each stays a bounded number of requests within the default time limit.
OPERATIONS = (
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
    "/tokenize", "/detokenize", "/rerank", "/v1/rerank", "/v2/rerank", "/score",
    "/v1/score", "/v1/models/{model_id}", "/v1/models", "/healthz", "/readyz", "/health",
    "/metrics",
)


def _operations(router: Router) -> list[Any]:
    api = schemathesis.openapi.from_url(f"{router.url}/openapi.json",
                                        headers={"authorization": f"Bearer {KEY}"})
    return [result.ok() for result in api.get_all_operations()]


def test_every_operation_is_fuzzed(schema_router: Router) -> None:
    assert {op.path for op in _operations(schema_router)} <= set(OPERATIONS)
    assert {op.path for op in _operations(schema_router)} >= set(OPERATIONS[:12])


@pytest.mark.parametrize("path", OPERATIONS)
def test_no_input_gets_a_5xx(schema_router: Router, path: str) -> None:
    """Positive and negative cases for one operation (schemathesis' pytest plugin does
    not run under pytest 9, so its strategies are driven with hypothesis directly)."""
    operations = [op for op in _operations(schema_router) if op.path == path]
    if not operations:
        pytest.skip(f"{path} is not in this router's OpenAPI document")
    modes = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
    for operation in operations:
        for mode in modes:
            # The PD flow's bodies get the most cases; the other data endpoints (several
            # of them aliases sharing one schema) fewer; the control plane fewest.
            if operation.path in ("/v1/chat/completions", "/v1/completions"):
                examples = 100
            elif operation.method.upper() == "POST":
                examples = 25
            else:
                examples = 10

            @settings(max_examples=examples, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case: Any) -> None:
                check(case, schema_router)

            run()


def check(case: Any, router: Router) -> None:
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("model"), str) and len(body["model"]) % 2:
        body["model"] = MODEL
    response = case.call(base_url=router.url, headers={"authorization": f"Bearer {KEY}"},
                         timeout=30)
    STATUSES[response.status_code] += 1
    assert response.status_code < 500, (case.method, case.path, body, response.text[:300])
    if response.status_code >= 400 and case.path.startswith("/v1/"):
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
