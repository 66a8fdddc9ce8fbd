"""router.build: the list of modules setup.py compiles, and how a process tells whether
it runs them compiled and whether a build in place is older than the source."""

from __future__ import annotations

import os
from importlib import import_module
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

from router.build import (
    COMPILED_MODULES,
    COMPILED_SOURCES,
    compiled_modules,
    module_name,
    shared_library,
    stale_in,
    summary,
)

REPO = Path(__file__).resolve().parents[2]


def test_every_listed_module_has_its_source_in_the_repository() -> None:
    assert module_name("router/scheduling/scorers/__init__.py") == "router.scheduling.scorers"
    for source, name in zip(COMPILED_SOURCES, COMPILED_MODULES, strict=True):
        assert (REPO / source).is_file(), source
        assert import_module(name).__name__ == name


def test_compiled_is_all_of_the_list_or_none_of_it() -> None:
    # Each compiled module imports mypyc's one shared runtime library: a partial build
    # would not import, so the build keeps all or none (setup.py's OptionalBuildExt).
    compiled = compiled_modules()
    assert compiled in ([], list(COMPILED_MODULES))
    for name in compiled:
        assert (import_module(name).__file__ or "").endswith(tuple(EXTENSION_SUFFIXES))
    # What logs and bench reports say of this process.
    n = len(COMPILED_MODULES)
    assert summary() == (f"compiled with mypyc ({n} of {n} modules)" if compiled
                         else "pure Python (not compiled)")


def test_a_source_edited_after_the_build_is_stale(tmp_path: Path) -> None:
    name, path = "router.scheduling.pipeline", "router/scheduling/pipeline.py"
    source = tmp_path / path
    source.parent.mkdir(parents=True)
    source.write_text("# the source\n")
    assert shared_library(tmp_path) is None  # nothing built: nothing to be stale
    library = tmp_path / "router" / f"hot_path__mypyc{EXTENSION_SUFFIXES[0]}"
    library.write_bytes(b"\0")
    assert shared_library(tmp_path) == library
    os.utime(source, (1_000, 1_000))
    os.utime(library, (2_000, 2_000))
    assert stale_in(tmp_path, library, [path]) == []
    os.utime(source, (3_000, 3_000))  # edited after the build
    assert stale_in(tmp_path, library, [path]) == [name]
