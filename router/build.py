"""Which of pdgate's modules are built as C extensions, and which of them run compiled.

`setup.py` compiles `COMPILED_SOURCES` with mypyc when it can (see its docstring): the
scheduler's pick path and the indexes it reads, the code that runs once or more per
request in pure Python arithmetic (a request's validation, its route, the metrics it
updates), and a stream's per-chunk work (the relay's state, the content check that times
tokens, the usage watcher). The Python source is the one definition of what they do; a
build without a compiler runs it as is. Stdlib only: setup.py reads this file.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib import import_module
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

#: mypyc's group: the one shared library (`router/hot_path__mypyc.*.so`) that holds the
#: compiled code of every module below; each module's own extension is a small shim.
GROUP = "router.hot_path"
#: The sources setup.py compiles, relative to the repository root. A module joins only if
#: the whole suite passes with it compiled. `kv_wire` stays out: msgspec already decodes
#: it in C, and mypyc's runtime type checks reject the tagged unions it decodes into.
COMPILED_SOURCES: tuple[str, ...] = (
    "router/histogram.py",
    "router/load.py",
    "router/metrics.py",
    "router/relay.py",
    "router/request.py",
    "router/routing.py",
    "router/sampling_bounds.py",
    "router/tally.py",
    "router/token_ids.py",
    "router/timing.py",
    "router/security/limits.py",
    "router/security/usage.py",
    "router/scheduling/approx_index.py",
    "router/scheduling/backlog.py",
    "router/scheduling/block_hash.py",
    "router/scheduling/block_index.py",
    "router/scheduling/context.py",
    "router/scheduling/filters.py",
    "router/scheduling/inflight_prefixes.py",
    "router/scheduling/kv_events.py",
    "router/scheduling/pick.py",
    "router/scheduling/pipeline.py",
    "router/scheduling/pool_view.py",
    "router/scheduling/precise_index.py",
    "router/scheduling/prefill_ticket.py",
    "router/scheduling/profile.py",
    "router/scheduling/scorers/__init__.py",
    "router/scheduling/scorers/base.py",
    "router/scheduling/scorers/cache_pressure.py",
    "router/scheduling/scorers/kv_cache_usage.py",
    "router/scheduling/scorers/least_request.py",
    "router/scheduling/scorers/precise_prefix_cache.py",
    "router/scheduling/scorers/prefill_backlog.py",
    "router/scheduling/scorers/prefix_cache.py",
    "router/scheduling/scorers/queue_depth.py",
    "router/scheduling/scorers/random_score.py",
    "router/scheduling/scorers/round_robin.py",
    "router/scheduling/scorers/session_affinity.py",
    "router/scheduling/ties.py",
    "router/scheduling/ttft_model.py",
)


def module_name(source: str) -> str:
    """`router/scheduling/scorers/__init__.py` -> `router.scheduling.scorers`."""
    return source.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


#: The same modules by import name.
COMPILED_MODULES: tuple[str, ...] = tuple(module_name(s) for s in COMPILED_SOURCES)


def compiled_modules() -> list[str]:
    """The modules of `COMPILED_MODULES` this process runs from a C extension."""
    suffixes = tuple(EXTENSION_SUFFIXES)
    return [
        name for name in COMPILED_MODULES
        if (getattr(import_module(name), "__file__", None) or "").endswith(suffixes)
    ]


def summary() -> str:
    """How this process runs the hot path, in the words logs and reports use."""
    done = len(compiled_modules())
    return (f"compiled with mypyc ({done} of {len(COMPILED_MODULES)} modules)" if done
            else "pure Python (not compiled)")


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
    compiled = set(compiled_modules())
    return stale_in(checkout, library, [s for s in COMPILED_SOURCES if module_name(s) in compiled])


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


def stale_in(checkout: Path, library: Path, sources: Iterable[str]) -> list[str]:
    """The modules of `sources` (paths in `checkout`) whose source is newer than the
    built `library`."""
    built = library.stat().st_mtime
    return [
        module_name(source) for source in sources
        if (checkout / source).exists() and (checkout / source).stat().st_mtime > built
    ]
