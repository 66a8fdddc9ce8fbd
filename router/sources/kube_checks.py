"""Problems that only show across objects: each ModelRoute is valid alone, but may name a
ModelServer that does not exist, or claim a modelName an older route already serves.

The view already routes around both (a missing target gets no traffic; the oldest route
wins a modelName); these checks only tell the operator, through the reporter.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from router.resources import ModelRoute
from router.view import build_snapshot, route_age_key

MISSING_MODEL_SERVER = "MissingModelServer"
DUPLICATE_MODEL_NAME = "DuplicateModelName"


@dataclass(frozen=True, slots=True)
class Problem:
    route: ModelRoute
    code: str  # the Event reason
    message: str


def route_problems(
    routes: Iterable[ModelRoute], servers: Collection[tuple[str, str]]
) -> list[Problem]:
    """Missing targetModels servers (same namespace) and younger duplicate modelNames.

    Which route loses a modelName is the view's decision (`build_snapshot`), so the
    report names exactly the route that gets no traffic for it.
    """
    routes = sorted(routes, key=route_age_key)
    problems: list[Problem] = []
    for route in routes:
        namespace = route.meta.namespace
        missing = sorted(
            {
                target.model_server_name
                for rule in route.rules
                for target in rule.target_models
                if (namespace, target.model_server_name) not in servers
            }
        )
        if missing:
            problems.append(
                Problem(
                    route,
                    MISSING_MODEL_SERVER,
                    f"targetModels name ModelServer {', '.join(missing)}, which does not "
                    f"exist in namespace {namespace}: those targets get no traffic",
                )
            )
    for lost in build_snapshot(routes, [], []).shadowed:
        if lost.model != lost.route.model_name:
            continue  # a LoRA adapter served elsewhere: logged by the router, no Event
        owner = lost.winner.meta
        problems.append(
            Problem(
                lost.route,
                DUPLICATE_MODEL_NAME,
                f"modelName {lost.model!r} is already served by the older "
                f"ModelRoute {owner.namespace}/{owner.name}; "
                "this route is ignored for it",
            )
        )
    return problems
