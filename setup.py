"""Build script: pdgate's scheduling hot path compiled with mypyc where it can be.

pdgate is pure Python and runs as such. The modules in `COMPILED` are the ones every
request's scheduling decision runs through (and the KV-event index updates of the
precise profile), a request's validation, route and metrics, and those a streamed chunk
runs through on its way to the client; mypyc turns each into a C extension built from
the same typed source, which makes a decision about twice as fast
(`benchmarks.decision`) and a relayed chunk about 8% cheaper. The Python source stays
the one definition of what the code does: without mypyc or a C compiler, with
`PDGATE_COMPILE=0`, or when the build fails, the package installs and runs unchanged,
only slower. `router.build.compiled_modules()` tells which modules run compiled.

    python setup.py build_ext --inplace     # what `make setup` runs after a change

Everything else about the package is in pyproject.toml.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_ext import build_ext

#: The modules to compile, from the package's own list (stdlib-only, read by path: the
#: build environment need not have pdgate's dependencies).
_BUILD = runpy.run_path(str(Path(__file__).parent / "router" / "build.py"))
COMPILED = list(_BUILD["COMPILED_SOURCES"])


def _warn(message: str) -> None:
    print(f"pdgate setup: {message}; the modules stay pure Python", file=sys.stderr)


class OptionalBuildExt(build_ext):
    """`build_ext` that falls back to pure Python: all compiled modules or none (each
    one imports mypyc's shared runtime library, so a partial build would not import)."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # a missing compiler, a compile error
            for path in self.get_outputs():
                if os.path.exists(path):
                    os.remove(path)
            _warn(f"compiling failed ({exc})")
            return
        # mypyc rewrites only the C files whose code changed, and setuptools relinks only
        # an extension older than its C: after an edit that changes no code (a docstring),
        # the extensions would keep their old times and look older than their sources
        # (`router/build.py` `stale_modules`). They are what these sources build: say so.
        now = time.time()
        for ext in self.extensions:
            path = self.get_ext_fullpath(ext.name)
            if os.path.exists(path):
                os.utime(path, (now, now))


def _extensions() -> list[Any]:
    if os.environ.get("PDGATE_COMPILE", "1") == "0":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        _warn("mypyc is not installed")
        return []
    try:
        return list(mypycify(COMPILED, opt_level="3", group_name=_BUILD["GROUP"]))
    except (Exception, SystemExit) as exc:  # mypyc exits on a type error
        _warn(f"mypyc failed ({exc})")
        return []


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
