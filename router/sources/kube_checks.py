"""Problems that only show across objects: each ModelRoute is valid alone, but may name a
ModelServer that does not exist, or claim a modelName an older route already serves.

The view already routes around both (a missing target gets no traffic; the oldest route
wins a modelName); these checks only tell the operator, through the reporter.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from router.resources import ModelRoute, timestamp_key

MISSING_MODEL_SERVER = "MissingModelServer"
DUPLICATE_MODEL_NAME = "DuplicateModelName"


@dataclass(frozen=True, slots=True)
class Problem:
    route: ModelRoute
    code: str  # the Event reason
    message: str


def _age_order(route: ModelRoute) -> tuple[object, str, str]:
    # The view's order: oldest creationTimestamp first, then namespace/name.
    return (timestamp_key(route.meta.creation_timestamp), route.meta.namespace, route.meta.name)


def route_problems(
    routes: Iterable[ModelRoute], servers: Collection[tuple[str, str]]
) -> list[Problem]:
    """Missing targetModels servers (same namespace) and younger duplicate modelNames."""
    problems: list[Problem] = []
    owners: dict[str, ModelRoute] = {}
    for route in sorted(routes, key=_age_order):
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
        if route.model_name is None:
            continue
        owner = owners.setdefault(route.model_name, route)
        if owner is not route:
            problems.append(
                Problem(
                    route,
                    DUPLICATE_MODEL_NAME,
                    f"modelName {route.model_name!r} is already served by the older "
                    f"ModelRoute {owner.meta.namespace}/{owner.meta.name}; "
                    "this route is ignored for it",
                )
            )
    return problems
