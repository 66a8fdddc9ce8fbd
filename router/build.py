"""Which of pdgate's modules are built as C extensions, and which of them run compiled.

`setup.py` compiles `COMPILED_MODULES` with mypyc when it can (see its docstring): the
scheduler's pick path and the indexes it reads, the code that runs once or more per
request in pure Python arithmetic. The Python source is the one definition of what they
do; a build without a compiler runs it as is. Stdlib only: setup.py reads this file.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib import import_module
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

#: The modules setup.py compiles. A module joins only if the whole suite passes with it
#: compiled. `kv_wire` stays out: msgspec already decodes it in C, and mypyc's runtime
#: type checks reject the tagged unions it decodes into.
#: mypyc's group: the one shared library (`router/hot_path__mypyc.*.so`) that holds the
#: compiled code of all of them.
GROUP = "router.hot_path"
COMPILED_MODULES: tuple[str, ...] = (
    "router.load",
    "router.scheduling.approx_index",
    "router.scheduling.backlog",
    "router.scheduling.block_hash",
    "router.scheduling.block_index",
    "router.scheduling.context",
    "router.scheduling.filters",
    "router.scheduling.kv_events",
    "router.scheduling.pipeline",
    "router.scheduling.pool_view",
    "router.scheduling.precise_index",
    "router.scheduling.scorers",
    "router.scheduling.scorers.base",
    "router.scheduling.scorers.kv_cache_usage",
    "router.scheduling.scorers.least_request",
    "router.scheduling.scorers.precise_prefix_cache",
    "router.scheduling.scorers.prefill_backlog",
    "router.scheduling.scorers.prefix_cache",
    "router.scheduling.scorers.queue_depth",
    "router.scheduling.scorers.random_score",
    "router.scheduling.scorers.round_robin",
    "router.scheduling.scorers.session_affinity",
    "router.scheduling.ttft_model",
)


def source_path(module: str) -> str:
    """The module's source file, relative to the repository root."""
    path = module.replace(".", "/")
    return f"{path}/__init__.py" if module == "router.scheduling.scorers" else f"{path}.py"


def compiled_modules() -> list[str]:
    """The modules of `COMPILED_MODULES` this process runs from a C extension."""
    suffixes = tuple(EXTENSION_SUFFIXES)
    return [
        name for name in COMPILED_MODULES
        if (getattr(import_module(name), "__file__", None) or "").endswith(suffixes)
    ]


def stale_modules() -> list[str]:
    """Compiled modules of a source checkout whose source is newer than the build: an
    edit since the last `make setup`, which the process does not run. An installed
    package is never stale (the installer writes its files in no particular order)."""
    checkout = Path(__file__).resolve().parent.parent
    if not (checkout / "setup.py").exists():
        return []
    library = shared_library(checkout)
    if library is None:
        return []
    return stale_in(checkout, library, compiled_modules())


def shared_library(checkout: Path) -> Path | None:
    """The library that holds the compiled code of every module (mypyc's group,
    `GROUP`), in a checkout built in place; each module's own extension is a shim that
    setuptools does not rewrite when only the code changed."""
    package, _, name = GROUP.rpartition(".")
    folder = checkout.joinpath(*package.split("."))
    for suffix in EXTENSION_SUFFIXES:
        library = folder / f"{name}__mypyc{suffix}"
        if library.exists():
            return library
    return None


def stale_in(checkout: Path, library: Path, modules: Iterable[str]) -> list[str]:
    """The `modules` whose source in `checkout` is newer than the built `library`."""
    built = library.stat().st_mtime
    return [
        name for name in modules
        if (source := checkout / source_path(name)).exists() and source.stat().st_mtime > built
    ]
