"""The scheduler's picks on fixed seeds and states are pinned: speed work must not change them.

Each scenario drives one `SchedulerRuntime` through a seeded sequence of picks whose state
moves between picks the way it does in the router: dispatched requests raise the chosen
pods' in-flight counts and finish later, engine metrics are re-scraped (some pods report
nothing, some are saturated), pods are ejected and avoided, the view is replaced by a new
snapshot (a pod leaves, then comes back), sequential-PD prefill durations calibrate the
TTFT fit, the SLO gate refuses some requests. Every decision (pods, costs, predicted TTFT)
is compared with `tests/fixtures/pinned_picks.json`, recorded from the scheduler before
its decision path was optimised. When a change of behaviour is intended, rewrite the
fixture with `python -m tests.unit.test_sched_pinned_picks --write` and say why in the
commit.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from router.errors import APIError
from router.load import InFlight
from router.resources import ModelServer, ObjectMeta, PDGroup
from router.scheduling import Pick, ScheduleRequest
from router.scheduling.config import SchedulerConfig, parse_scheduler_config
from router.scheduling.context import PromptInfo
from router.scheduling.kv_events import scope_of
from router.scheduling.metrics_scraper import EngineLoad
from router.scheduling.pool_view import pool_writers
from router.scheduling.runtime import SchedulerRuntime
from router.view import ClusterView, Endpoint, PDGroupPods, ServerPods
from tests.unit.test_sched_pipeline import sim_tokens

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "pinned_picks.json"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PICKS_PER_SCENARIO = 160


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _server(name: str, pd: bool, annotations: dict[str, str]) -> ModelServer:
    return ModelServer(
        meta=ObjectMeta(name=name, annotations=annotations),
        model="m",
        inference_engine="vLLM",
        match_labels={"app": name},
        pd_group=PDGroup("group", {"role": "prefill"}, {"role": "decode"}) if pd else None,
        port=8000,
    )


def _pod(name: str, role: str, group: str | None) -> Endpoint:
    return Endpoint("default", name, "10.0.0.1", 8000, role, group)  # type: ignore[arg-type]


def aggregated(pods: int, drop: int | None = None, **annotations: str) -> ServerPods:
    return ServerPods(
        server=_server("agg", False, annotations),
        aggregated=tuple(_pod(f"a{i}", "both", None) for i in range(pods) if i != drop),
    )


def pd(groups: int, drop: int | None = None, **annotations: str) -> ServerPods:
    """Groups of 1 or 2 prefill and 1 or 2 decode pods (uneven on purpose)."""
    out = []
    for g in range(groups):
        name = f"g{g}"
        pre = tuple(_pod(f"p{g}-{j}", "prefill", name) for j in range(1 + g % 2))
        dec = tuple(_pod(f"d{g}-{j}", "decode", name) for j in range(1 + (g // 2) % 2))
        if drop == g:
            pre = pre[:1] if len(pre) > 1 else pre
            dec = dec[1:] if len(dec) > 1 else dec
        out.append(PDGroupPods(group=name, prefill=pre, decode=dec))
    return ServerPods(server=_server("pd", True, annotations), groups=tuple(out))


def _requests(rng: random.Random) -> Callable[[int], ScheduleRequest]:
    words = [f"w{i}" for i in range(200)]
    systems = [" ".join(rng.choice(words) for _ in range(rng.randrange(50, 900)))
               for _ in range(6)]  # fmt: skip

    def make(n: int) -> ScheduleRequest:
        question = " ".join(rng.choice(words) for _ in range(rng.randrange(5, 40)))
        headers = {"x-session-id": f"s{rng.randrange(5)}"} if rng.random() < 0.3 else {}
        kind = rng.random()
        if kind < 0.1:
            body: dict[str, Any] = {"model": "m", "prompt": systems[n % 6] + question}
            return ScheduleRequest("m", COMPLETIONS, body, headers)
        body = {
            "model": "m",
            "messages": [{"role": "system", "content": systems[rng.randrange(6)]},
                         {"role": "user", "content": question}],
        }  # fmt: skip
        flow = "single" if kind > 0.95 else "generate" if kind > 0.92 else "pd"
        return ScheduleRequest("m", CHAT, body, headers, flow=flow)

    return make


def _cost(value: float | None) -> str | None:
    return None if value is None else format(value, ".9g")


def _record(pick: Pick | None, predicted: float | None) -> list[Any]:
    if pick is None:
        return ["none"]
    return [
        pick.decode.key, None if pick.prefill is None else pick.prefill.key,
        _cost(pick.decode_cost), _cost(pick.prefill_cost), _cost(predicted),
    ]


def run_scenario(
    config: SchedulerConfig, build: Callable[[int | None], ServerPods], seed: int
) -> list[list[Any]]:
    """Every decision of one seeded scenario, as JSON-friendly rows."""
    rng = random.Random(seed)
    clock = Clock()
    ejected: set[str] = set()
    registry = CollectorRegistry()
    view = ClusterView()
    rt = SchedulerRuntime(config, InFlight(registry), view, registry,
                          rng=random.Random(seed + 1), is_ejected=ejected.__contains__,
                          tokenize=sim_tokens, clock=clock)  # fmt: skip
    scheduler = rt.scheduler
    server = build(None)
    # With the precise scorer, each prefill stores its prompt's blocks and says so (a KV
    # event); on a server that declares a pool its connector writes them to the store too.
    publishes = config.uses("precise-prefix-cache")
    a = config.approximate_index
    make = _requests(rng)
    running: list[Endpoint] = []
    rows: list[list[Any]] = []

    def scrape(pods: tuple[Endpoint, ...]) -> None:
        for p in pods:
            if rng.random() < 0.15:
                continue  # this pod's scrape failed: its old load goes stale or stays
            waiting = rng.choice([0, 0, 1, 2, 5, 40]) if rng.random() > 0.1 else None
            rt.engines.put(p.key, EngineLoad(
                running=rng.randrange(8), waiting=waiting,
                kv_usage=None if rng.random() < 0.1 else rng.random(),
                at=clock.now,
            ))  # fmt: skip

    scrape(server.endpoints())
    for n in range(PICKS_PER_SCENARIO):
        clock.now += rng.choice([0.0005, 0.002, 0.02])
        if n % 10 == 0:
            scrape(server.endpoints())
        if n == 60:
            server = build(1)  # a new snapshot: a pod left
            scheduler.forget_layouts()
        if n == 100:
            server = build(None)  # and came back
            scheduler.forget_layouts()
        if publishes:
            pool = config.pool_view
            rt.precise.set_pool_writers(pool_writers([server], pool.enabled, pool.capacity_tokens))
        if n % 25 == 0:
            ejected.clear()
            keys = [p.key for p in server.endpoints()]
            ejected.update(rng.sample(keys, rng.randrange(2)))
        while running and rng.random() < 0.45:
            rt.deps.inflight.release(running.pop(rng.randrange(len(running))))
        req = make(n)
        keys = [p.key for p in server.endpoints()]
        avoid = frozenset(rng.sample(keys, 1)) if rng.random() < 0.1 else frozenset()
        prediction = scheduler.predict(server, req, avoid) if n % 7 == 0 else None
        predicted = None if prediction is None else prediction.ttft_s
        try:
            pick = scheduler.pick(server, req, avoid)
        except APIError as exc:
            rows.append(["refused", exc.status, _cost(predicted)])
            continue
        rows.append(_record(pick, predicted))
        if pick is None:
            continue
        for endpoint in pick.endpoints:
            rt.deps.inflight.acquire(endpoint)
            running.append(endpoint)
        if pick.on_prefill is not None and rng.random() < 0.7:
            pick.on_prefill(rng.uniform(0.005, 0.2))
        if publishes and rng.random() < 0.8:  # some events are still on their way
            prompt = PromptInfo(req, rt.deps.hasher, a.block_bytes, a.max_prompt_blocks,
                                a.chars_per_token)
            stored = pick.prefill or pick.decode
            rt.precise.stored(stored.key, scope_of(server), prompt.precise_hashes(), "GPU")
    return rows


PRECISE = {
    "profiles": {
        "prefill": {"scorers": [
            {"type": "precise-prefix-cache", "weight": 1.0, "storeHitFactor": 0.7},
            {"type": "least-request", "weight": 1.0},
            {"type": "queue", "weight": 0.5},
        ]},
    },
    # No event streams to open; blocks keyed by engine hashes (the engines' seed known),
    # so the scenario's own events need no token ids.
    "preciseIndex": {"enabled": False, "keys": "hashes", "hashSeed": "0"},
}
SCORE_UNIT = {
    "profiles": {
        name: {"unit": "score", "scorers": [
            {"type": "prefix-cache", "weight": 2.0},
            {"type": "session-affinity", "weight": 1.0},
            {"type": "least-request", "weight": 1.0},
            {"type": "queue", "weight": 1.0},
            {"type": "kv-cache-usage", "weight": 0.5},
        ]}
        for name in ("prefill", "decode", "aggregated")
    },
}
SLO = {"sloAdmission": {"enabled": True, "ttftTarget": "400ms", "action": "reject"}}
POOL = {"pdgate.io/kv-pool": "mooncake-store"}

SCENARIOS: dict[str, tuple[dict[str, Any], Callable[[int | None], ServerPods], int]] = {
    "default aggregated 8": ({}, lambda d: aggregated(8, d), 1),
    "default aggregated 64": ({}, lambda d: aggregated(64, d), 2),
    "default PD 8 groups": ({}, lambda d: pd(8, d), 3),
    "default PD 6 groups, pool": ({}, lambda d: pd(6, d, **POOL), 4),
    "default aggregated 8, pool": ({}, lambda d: aggregated(8, d, **POOL), 5),
    "precise PD 4 groups, pool": (PRECISE, lambda d: pd(4, d, **POOL), 6),
    "score unit aggregated 8": (SCORE_UNIT, lambda d: aggregated(8, d), 7),
    "score unit PD 4 groups": (SCORE_UNIT, lambda d: pd(4, d), 8),
    "SLO gate PD 4 groups": (SLO, lambda d: pd(4, d), 9),
}


def _all() -> dict[str, list[list[Any]]]:
    return {
        name: run_scenario(parse_scheduler_config(doc), build, seed)
        for name, (doc, build, seed) in SCENARIOS.items()
    }


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_picks_are_the_pinned_ones(name: str) -> None:
    expected = json.loads(FIXTURE.read_text(encoding="utf-8"))[name]
    doc, build, seed = SCENARIOS[name]
    got = run_scenario(parse_scheduler_config(doc), build, seed)
    for n, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert have == want, f"{name}: decision {n} changed"


def test_the_scenarios_exercise_what_they_pin() -> None:
    """The fixture is not degenerate: picks spread, some are refused, PD picks pairs."""
    pinned = json.loads(FIXTURE.read_text(encoding="utf-8"))
    assert set(pinned) == set(SCENARIOS)
    for name, rows in pinned.items():
        assert len(rows) == PICKS_PER_SCENARIO
        chosen = {row[0] for row in rows if len(row) == 5}
        assert len(chosen) >= 3, name
    assert any(row[0] == "refused" for row in pinned["SLO gate PD 4 groups"])
    assert all(row[1] is not None for row in pinned["default PD 8 groups"]
               if len(row) == 5 and row[2] is not None and row[3] is not None)  # fmt: skip


if __name__ == "__main__" and "--write" in sys.argv:
    FIXTURE.write_text(json.dumps(_all(), indent=0) + "\n", encoding="utf-8")
    print(f"wrote {FIXTURE}")
