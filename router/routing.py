"""Route matching: from a request's model, headers and path to one ModelServer.

Follows Kthena's router: the model name selects a ModelRoute (by `modelName` or a
LoRA adapter), the first rule whose `modelMatch` holds wins, and a target is drawn by
weight. It reads only an immutable `Snapshot` and allocates next to nothing, because it
runs once per request.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from router.resources import ModelRoute, Rule
from router.view import ServerPods, Snapshot


class RoutingError(LookupError):
    """Base of the routing failures; `model` is the name the client asked for."""

    def __init__(self, model: str, message: str) -> None:
        super().__init__(message)
        self.model = model


class ModelNotFound(RoutingError):
    """No ModelRoute serves this model name or LoRA adapter (the client's 404)."""

    def __init__(self, model: str) -> None:
        super().__init__(model, f"model {model!r} not found")


class NoRoute(RoutingError):
    """A route exists but no rule matches or no target ModelServer exists."""

    def __init__(self, model: str, reason: str) -> None:
        super().__init__(model, f"no route for model {model!r}: {reason}")
        self.reason = reason


class RouteDecision:
    """Where a request goes: its route, the rule that matched, the ModelServer's pods.

    A plain class, not a frozen dataclass: one is made per request, and this module is
    compiled (router/build.py), which compiles a written `__init__` but not a dataclass's
    (a frozen one sets each field through `object.__setattr__`). Nothing changes it."""

    __slots__ = ("lora_name", "route", "rule", "server", "upstream_model")

    def __init__(self, route: ModelRoute, rule: Rule, server: ServerPods,
                 upstream_model: str, lora_name: str | None = None) -> None:
        self.route = route
        self.rule = rule
        self.server = server
        #: The model name the engine is asked for: the ModelServer's `model` if set, else
        #: the request's; a LoRA adapter's name always stays (the engine loads it by name).
        self.upstream_model = upstream_model
        #: The adapter the request names, when the route serves it as a LoRA adapter: the
        #: engine's `lora_name`, which vLLM puts in every block's hash.
        self.lora_name = lora_name


def lora_name_of(route: ModelRoute, model: str) -> str | None:
    """`model` when `route` serves it as a LoRA adapter rather than as its modelName."""
    return model if model != route.model_name and model in route.lora_adapters else None


def rule_matches(rule: Rule, model: str, headers: Mapping[str, str], path: str) -> bool:
    """Kthena's selectRule predicate: every condition set in `modelMatch` must hold.

    `headers` keys must be lower-cased; a header that is absent never matches.
    """
    match = rule.model_match
    if match is None:
        return True
    if match.body_model is not None and match.body_model != model:
        return False
    if match.uri is not None and not match.uri.matches(path):
        return False
    for name, condition in match.headers.items():
        if not condition.matches(headers.get(name)):
            return False
    return True


def select_rule(
    route: ModelRoute, model: str, headers: Mapping[str, str], path: str
) -> Rule | None:
    """The first rule of `route` that matches, or None."""
    for rule in route.rules:
        if rule_matches(rule, model, headers, path):
            return rule
    return None


def resolve(
    snapshot: Snapshot,
    model: str,
    headers: Mapping[str, str],
    path: str,
    rng: random.Random,
) -> RouteDecision:
    """Pick the route, rule and ModelServer for one request.

    Raises `ModelNotFound` for an unknown model and `NoRoute` when no rule matches or
    no target server exists. Targets whose ModelServer is missing, or whose weight is
    0, are never drawn; the others are drawn in proportion to their weights.
    """
    route = snapshot.routes_by_model.get(model)
    if route is None:
        raise ModelNotFound(model)
    rule = select_rule(route, model, headers, path)
    if rule is None:
        raise NoRoute(model, f"no rule of ModelRoute {_name(route)} matches the request")

    servers = snapshot.servers
    namespace = route.meta.namespace
    # Two passes over a handful of targets instead of building a list per request.
    total = 0
    existing = 0
    weighted = 0
    chosen: ServerPods | None = None  # the one target with weight, if only one has any
    for target in rule.target_models:
        server = servers.get((namespace, target.model_server_name))
        if server is not None:
            existing += 1
            total += target.weight
            if target.weight:
                weighted += 1
                chosen = server
    if existing == 0:
        raise NoRoute(model, f"no target ModelServer of rule {rule.name!r} exists")
    if total == 0:
        raise NoRoute(model, f"every existing target of rule {rule.name!r} has weight 0")

    if weighted > 1:  # a weighted split: draw (a route with one target, the common one, does not)
        point = rng.randrange(total)
        for target in rule.target_models:
            server = servers.get((namespace, target.model_server_name))
            if server is None or target.weight == 0:
                continue
            point -= target.weight
            if point < 0:
                chosen = server
                break
    assert chosen is not None  # point < total, so the walk always lands
    # As Kthena: a name the route serves as a LoRA adapter (and not as its modelName, which
    # is looked up first) goes to the engine as is; any other is rewritten to the
    # ModelServer's `model` when it sets one.
    if lora_name_of(route, model) is not None:
        return RouteDecision(route, rule, chosen, model, lora_name=model)
    upstream = chosen.server.model
    return RouteDecision(route, rule, chosen, upstream if upstream else model)


def _name(route: ModelRoute) -> str:
    return f"{route.meta.namespace}/{route.meta.name}"


__all__ = [
    "ModelNotFound",
    "NoRoute",
    "RouteDecision",
    "RoutingError",
    "resolve",
    "rule_matches",
    "select_rule",
]
