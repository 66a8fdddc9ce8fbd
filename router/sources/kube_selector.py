"""Narrowing the pod watch to the pods some ModelServer can select.

Watching every pod of a big cluster costs memory and CPU for nothing. When every
ModelServer's `matchLabels` share a key (Kthena's `modelserving.volcano.sh/name`, say),
`key in (v1,v2,...)` selects a superset of the pods they need, and the API server does the
filtering. Anything else (no ModelServer, no shared key, a value a selector cannot carry)
falls back to all pods in scope, which is always correct. An empty `matchLabels` selects
no pod (Kthena's rule, which the view follows), so it does not constrain the selector.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

#: Above this many values, `key` (exists) is used instead of `key in (...)`.
MAX_SELECTOR_VALUES = 64
# A label value as Kubernetes validates it (non-empty here: `in ()` needs real values).
_VALUE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_KEY = re.compile(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


def pod_selector(match_labels: Iterable[Mapping[str, str]]) -> str | None:
    """A label selector for the pods these matchLabels can select; None means all pods."""
    label_sets = [labels for labels in match_labels if labels]
    if not label_sets:
        return None
    common = set(label_sets[0]).intersection(*label_sets[1:])
    for key in sorted(common):
        values = {labels[key] for labels in label_sets}
        if len(key) > 316 or not _KEY.fullmatch(key):
            continue
        if not all(len(value) <= 63 and _VALUE.fullmatch(value) for value in values):
            continue
        if len(values) > MAX_SELECTOR_VALUES:
            return key
        return f"{key} in ({','.join(sorted(values))})"
    return None
