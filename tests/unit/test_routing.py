"""Route matching: model and LoRA lookup, header/uri/body matches, weighted targets."""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest

from router.resources import (
    ModelMatch,
    ModelRoute,
    ModelServer,
    ObjectMeta,
    Rule,
    StringMatch,
    TargetModel,
)
from router.routing import ModelNotFound, NoRoute, RoutingError, resolve, rule_matches
from router.view import Snapshot, build_snapshot

CHAT = "/v1/chat/completions"


def ms(name: str, model: str | None = None, namespace: str = "default") -> ModelServer:
    return ModelServer(
        meta=ObjectMeta(name=name, namespace=namespace),
        model=model,
        inference_engine="vLLM",
        match_labels={"app": name},
        pd_group=None,
        port=8000,
    )


def mr(
    *rules: Rule,
    model: str | None = "llama",
    lora: tuple[str, ...] = (),
    namespace: str = "default",
) -> ModelRoute:
    return ModelRoute(
        meta=ObjectMeta(name="route", namespace=namespace),
        model_name=model,
        lora_adapters=lora,
        rules=rules,
    )


def rule(name: str, *targets: tuple[str, int], match: ModelMatch | None = None) -> Rule:
    return Rule(
        name=name,
        target_models=tuple(TargetModel(server, weight) for server, weight in targets),
        model_match=match,
    )


def snapshot(route: ModelRoute, *servers: ModelServer) -> Snapshot:
    return build_snapshot(routes=[route], servers=list(servers), pods=[])


RNG = random.Random(7)


def test_unknown_model() -> None:
    snap = snapshot(mr(rule("r", ("a", 100))), ms("a"))
    with pytest.raises(ModelNotFound) as info:
        resolve(snap, "gpt-4", {}, CHAT, RNG)
    assert info.value.model == "gpt-4"
    assert isinstance(info.value, RoutingError)


def test_model_name_and_lora_adapter_resolve() -> None:
    snap = snapshot(mr(rule("r", ("a", 100)), lora=("sql-lora",)), ms("a", model="base"))
    decision = resolve(snap, "llama", {}, CHAT, RNG)
    assert decision.route.meta.name == "route"
    assert decision.rule.name == "r"
    assert decision.server.server.meta.name == "a"
    assert decision.upstream_model == "base"  # ModelServer.model overrides
    assert decision.lora_name is None
    adapter = resolve(snap, "sql-lora", {}, CHAT, RNG)
    assert adapter.route.meta.name == "route"
    # As Kthena: an adapter's name is never rewritten (the engine loads it by that name),
    # and it is the engine's lora_name, a part of every block's prefix-cache key.
    assert adapter.upstream_model == "sql-lora" and adapter.lora_name == "sql-lora"


def test_a_name_that_is_a_model_name_is_not_an_adapter() -> None:
    """A route whose modelName is also listed among its adapters serves the base model."""
    snap = snapshot(mr(rule("r", ("a", 100)), lora=("llama",)), ms("a", model="base"))
    decision = resolve(snap, "llama", {}, CHAT, RNG)
    assert decision.upstream_model == "base" and decision.lora_name is None


def test_upstream_model_defaults_to_request_model() -> None:
    snap = snapshot(mr(rule("r", ("a", 100))), ms("a"))
    assert resolve(snap, "llama", {}, CHAT, RNG).upstream_model == "llama"


def test_first_matching_rule_wins() -> None:
    header_rule = rule(
        "gold", ("gold", 100),
        match=ModelMatch(headers={"x-tier": StringMatch(exact="gold")}),
    )
    fallback = rule("rest", ("rest", 100))
    snap = snapshot(mr(header_rule, fallback), ms("gold"), ms("rest"))
    assert resolve(snap, "llama", {"x-tier": "gold"}, CHAT, RNG).rule.name == "gold"
    assert resolve(snap, "llama", {"x-tier": "silver"}, CHAT, RNG).rule.name == "rest"
    assert resolve(snap, "llama", {}, CHAT, RNG).rule.name == "rest"


@pytest.mark.parametrize(
    ("condition", "value", "expected"),
    [
        (StringMatch(exact="alice"), "alice", True),
        (StringMatch(exact="alice"), "alice2", False),
        (StringMatch(prefix="gold"), "gold-plus", True),
        (StringMatch(prefix="gold"), "silver", False),
        (StringMatch(regex=re.compile(r"^team-\d+$")), "team-42", True),
        (StringMatch(regex=re.compile(r"^team-\d+$")), "team-x", False),
        (StringMatch(regex=re.compile(r"beta")), "x-beta-y", True),  # unanchored, as Go
        (StringMatch(exact="alice"), None, False),  # header absent
    ],
)
def test_header_matches(condition: StringMatch, value: str | None, expected: bool) -> None:
    r = rule("r", ("a", 100), match=ModelMatch(headers={"x-user": condition}))
    headers = {} if value is None else {"x-user": value}
    assert rule_matches(r, "llama", headers, CHAT) is expected


def test_all_headers_must_match() -> None:
    r = rule("r", ("a", 100), match=ModelMatch(headers={
        "x-a": StringMatch(exact="1"), "x-b": StringMatch(exact="2"),
    }))
    assert rule_matches(r, "m", {"x-a": "1", "x-b": "2"}, CHAT)
    assert not rule_matches(r, "m", {"x-a": "1", "x-b": "3"}, CHAT)
    assert not rule_matches(r, "m", {"x-a": "1"}, CHAT)


def test_uri_match() -> None:
    r = rule("r", ("a", 100), match=ModelMatch(uri=StringMatch(prefix="/v1/chat")))
    assert rule_matches(r, "m", {}, CHAT)
    assert not rule_matches(r, "m", {}, "/v1/completions")
    exact = rule("r", ("a", 100), match=ModelMatch(uri=StringMatch(exact="/v1/completions")))
    assert rule_matches(exact, "m", {}, "/v1/completions")
    assert not rule_matches(exact, "m", {}, CHAT)


def test_body_model_match() -> None:
    lora_rule = rule("lora", ("lora-server", 100), match=ModelMatch(body_model="sql-lora"))
    base_rule = rule("base", ("base-server", 100))
    snap = snapshot(
        mr(lora_rule, base_rule, lora=("sql-lora",)), ms("lora-server"), ms("base-server")
    )
    assert resolve(snap, "sql-lora", {}, CHAT, RNG).server.server.meta.name == "lora-server"
    assert resolve(snap, "llama", {}, CHAT, RNG).server.server.meta.name == "base-server"


def test_combined_conditions_are_anded() -> None:
    r = rule("r", ("a", 100), match=ModelMatch(
        headers={"x-user": StringMatch(exact="alice")},
        uri=StringMatch(prefix="/v1/chat"),
        body_model="llama",
    ))
    assert rule_matches(r, "llama", {"x-user": "alice"}, CHAT)
    assert not rule_matches(r, "other", {"x-user": "alice"}, CHAT)
    assert not rule_matches(r, "llama", {"x-user": "bob"}, CHAT)
    assert not rule_matches(r, "llama", {"x-user": "alice"}, "/v1/completions")


def test_no_rule_matches() -> None:
    only = rule("r", ("a", 100), match=ModelMatch(uri=StringMatch(exact="/v1/completions")))
    snap = snapshot(mr(only), ms("a"))
    with pytest.raises(NoRoute) as info:
        resolve(snap, "llama", {}, CHAT, RNG)
    assert "no rule" in info.value.reason
    assert info.value.model == "llama"


def test_weights_are_respected() -> None:
    snap = snapshot(mr(rule("r", ("a", 80), ("b", 20), ("c", 0))), ms("a"), ms("b"), ms("c"))
    rng = random.Random(12345)
    n = 20_000
    counts = Counter(
        resolve(snap, "llama", {}, CHAT, rng).server.server.meta.name for _ in range(n)
    )
    assert counts["c"] == 0  # weight 0 is never chosen
    assert counts["a"] / n == pytest.approx(0.8, abs=0.015)
    assert counts["b"] / n == pytest.approx(0.2, abs=0.015)


def test_a_route_with_one_weighted_target_draws_nothing() -> None:
    for targets in ((("a", 100),), (("a", 100), ("b", 0)), (("gone", 50), ("a", 50))):
        snap = snapshot(mr(rule("r", *targets)), ms("a"), ms("b"))
        rng = random.Random(7)
        state = rng.getstate()
        assert resolve(snap, "llama", {}, CHAT, rng).server.server.meta.name == "a"
        assert rng.getstate() == state  # no draw spent on a choice of one


def test_seeded_rng_is_deterministic() -> None:
    snap = snapshot(mr(rule("r", ("a", 50), ("b", 50))), ms("a"), ms("b"))

    def draws(seed: int) -> list[str]:
        rng = random.Random(seed)
        return [resolve(snap, "llama", {}, CHAT, rng).server.server.meta.name for _ in range(50)]

    assert draws(1) == draws(1)
    assert set(draws(1)) == {"a", "b"}


def test_missing_servers_are_skipped() -> None:
    snap = snapshot(mr(rule("r", ("gone", 90), ("a", 10))), ms("a"))
    rng = random.Random(0)
    assert {resolve(snap, "llama", {}, CHAT, rng).server.server.meta.name
            for _ in range(200)} == {"a"}


def test_server_in_another_namespace_does_not_count() -> None:
    snap = snapshot(mr(rule("r", ("a", 100))), ms("a", namespace="other"))
    with pytest.raises(NoRoute, match="no target ModelServer"):
        resolve(snap, "llama", {}, CHAT, RNG)


def test_no_target_server_exists() -> None:
    snap = snapshot(mr(rule("r", ("gone", 100))))
    with pytest.raises(NoRoute) as info:
        resolve(snap, "llama", {}, CHAT, RNG)
    assert "no target ModelServer" in info.value.reason


def test_all_existing_targets_weight_zero() -> None:
    snap = snapshot(mr(rule("r", ("a", 0), ("b", 0))), ms("a"), ms("b"))
    with pytest.raises(NoRoute, match="weight 0"):
        resolve(snap, "llama", {}, CHAT, RNG)
