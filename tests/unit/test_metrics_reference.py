"""The README's metrics reference names every metric the router declares, and no other.

An operator writes queries and alerts from that table: a metric missing from it is one
nobody finds, and a row for a metric that no longer exists is a query that returns
nothing. The declarations are read from `router/`'s source (a metric's name and help
text passed to a prometheus-client class, a `LoopHistogram` or a collector's family).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _declared() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "router").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                first = node.args[:2]
            elif isinstance(node, ast.Tuple):  # (name, help, label, source) tables
                first = node.elts[:2]
            else:
                continue
            if (
                len(first) == 2
                and all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in first)
                and first[0].value.startswith("pdgate_")  # type: ignore[attr-defined]
            ):
                names.add(first[0].value)  # type: ignore[attr-defined]
    return names


def _documented() -> set[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("### Metrics reference", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(pdgate_[a-z0-9_]+)` \|", section, re.MULTILINE)
    return {re.sub(r"_total$", "", name) for name in rows}


def test_every_declared_metric_is_in_the_readme_and_every_row_exists() -> None:
    declared = _declared()
    assert len(declared) > 50  # the scan still finds the declarations
    documented = _documented()
    assert declared - documented == set(), "metrics missing from README's reference"
    assert documented - declared == set(), "README rows for metrics the router lacks"
