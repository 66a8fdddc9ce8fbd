"""`python -m benchmarks.opcodes`: the Python work one request costs the router, counted.

Latency at concurrency 1 and CPU per request move by 5-10% between rounds on a shared
machine, more than a change of a few microseconds can show. The bytecode instructions
(opcodes) the router's interpreter runs for a request move by a fraction of a percent
(its periodic work, engine scrapes, falls in the window or not): this starts `--fast`
pods and pdgate with an opcode counter in the router process (`OpcodeCounter`:
`sys.settrace` with `f_trace_opcodes`; `python -m benchmarks.opcodes --traced-router ...`
is that process), sends `--warm` requests from the sequential client (one keep-alive
connection, one request at a time, as the concurrency-1 figure is taken), has the router
write its counts (SIGUSR1), sends `--requests` more, has it write them again, and prints
opcodes and calls per request, in all and per function.

Code compiled with mypyc (`router/build.py`) runs no bytecode: only its calls back into
the interpreter count. Tracing makes the router many times slower; the counts, not the
times, are the result. `benchmarks/HISTORY.md` ("Concurrency 1: where a request's time
goes") has the first reading.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any, cast

from benchmarks.cluster import MODEL, ClusterShape, Mode, SimCluster
from benchmarks.policies import OVERHEAD_POLICY, pdgate_specs
from benchmarks.routers import RunningRouter
from benchmarks.sequential import run_sequential
from benchmarks.workloads import OverheadParams, overhead

#: Seconds the bench waits for the router to write its counts after SIGUSR1 (the handler
#: runs when the router's loop next runs Python: its periodic work comes within a second).
SNAPSHOT_WAIT_S = 30.0
#: The counts' file in the traced router's working directory, numbered per snapshot.
SNAPSHOT_ENV = "PDGATE_OPCODES_OUT"

#: (file, first line, function name): one function.
Key = tuple[str, int, str]


class OpcodeCounter:
    """Opcodes and calls per function of everything this thread runs once `install`ed."""

    def __init__(self) -> None:
        self.opcodes: Counter[Key] = Counter()
        self.calls: Counter[Key] = Counter()
        self.paused = False

    def install(self) -> None:
        sys.settrace(self._trace)

    def uninstall(self) -> None:
        sys.settrace(None)

    def _trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if self.paused:
            return None
        code = frame.f_code
        key = (code.co_filename, code.co_firstlineno, code.co_name)
        if event == "call":
            self.calls[key] += 1
            frame.f_trace_opcodes = True
            frame.f_trace_lines = False
        elif event == "opcode":
            self.opcodes[key] += 1
        return self._trace

    def snapshot(self) -> dict[str, list[int]]:
        """The counts so far, by `file:line(name)`: [opcodes, calls]."""
        return {"{}:{}({})".format(*key): [self.opcodes[key], self.calls[key]]
                for key in self.calls.keys() | self.opcodes.keys()}


def per_request(before: dict[str, list[int]], after: dict[str, list[int]], requests: int
                ) -> list[tuple[str, float, float]]:
    """(function, opcodes, calls) per request between two snapshots, most opcodes first;
    functions that ran less than once per 100 requests are left out."""
    rows = []
    for name, (opcodes, calls) in after.items():
        was = before.get(name, [0, 0])
        rows.append((name, (opcodes - was[0]) / requests, (calls - was[1]) / requests))
    return sorted((r for r in rows if r[1] >= 0.01 or r[2] >= 0.01),
                  key=lambda r: (-r[1], r[0]))


def report(rows: list[tuple[str, float, float]], top: int, root: str = "") -> str:
    """Totals, then the `top` functions, paths shortened to the part after
    `site-packages/` or after `root`."""
    def short(name: str) -> str:
        if "site-packages/" in name:
            return name.rpartition("site-packages/")[2]
        if root and name.startswith(root):
            return name[len(root):].lstrip("/")
        return name

    lines = [f"{sum(r[1] for r in rows):,.0f} opcodes and {sum(r[2] for r in rows):,.0f} "
             "Python calls a request", "", "opcodes  calls  function"]
    lines += [f"{opcodes:7.1f} {calls:6.1f}  {short(name)}" for name, opcodes, calls in rows[:top]]
    return "\n".join(lines)


def _traced_router(argv: list[str]) -> int:
    """The router's `main` under an `OpcodeCounter`; SIGUSR1 writes the counts so far
    to `$PDGATE_OPCODES_OUT.<n>.json` (n = 1, 2, ...)."""
    from router.cli import main as router_main  # the router only in the traced process

    counter = OpcodeCounter()
    out = os.environ[SNAPSHOT_ENV]
    written = 0

    def write_counts(signum: int, frame: FrameType | None) -> None:
        nonlocal written
        counter.paused = True
        try:
            written += 1
            path = Path(f"{out}.{written}.json")
            path.with_suffix(".tmp").write_text(json.dumps(counter.snapshot()))
            path.with_suffix(".tmp").replace(path)
        finally:
            counter.paused = False

    signal.signal(signal.SIGUSR1, write_counts)
    counter.install()
    return router_main(argv)


class _TracedRouter(RunningRouter):
    """pdgate started through `_traced_router` instead of `python -m router`."""

    def _argv(self, port: int) -> list[str]:
        argv = super()._argv(port)
        assert argv[1:3] == ["-m", "router"], argv
        return [argv[0], "-m", "benchmarks.opcodes", "--traced-router", *argv[3:]]


def _counts(pid: int, path: Path) -> dict[str, list[int]]:
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + SNAPSHOT_WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"the router wrote no counts to {path} in {SNAPSHOT_WAIT_S} s")
        time.sleep(0.05)
    return cast(dict[str, list[int]], json.loads(path.read_text()))


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["--traced-router"]:
        return _traced_router(args_in[1:])
    parser = argparse.ArgumentParser(prog="python -m benchmarks.opcodes", description=__doc__)
    parser.add_argument("--mode", choices=("agg", "pd"), default="agg")
    parser.add_argument("--warm", type=int, default=100, help="requests before counting")
    parser.add_argument("--requests", type=int, default=200, help="requests counted")
    parser.add_argument("--no-stream", action="store_true", help="non-streaming requests")
    parser.add_argument("--top", type=int, default=40, help="functions listed")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/opcodes/raw"))
    args = parser.parse_args(args_in)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    mode = cast(Mode, args.mode)
    workload = overhead(OverheadParams(requests=args.warm + args.requests), MODEL, 0,
                        not args.no_stream)
    specs = [spec for session in workload.sessions for spec in session]
    counts = out / "counts"
    for old in out.glob("counts.*.json"):
        old.unlink()
    os.environ[SNAPSHOT_ENV] = str(counts)  # inherited by the router process
    with SimCluster(ClusterShape(mode, 1 if mode == "pd" else 2, fast=True), out / "logs") as c:
        router = _TracedRouter(pdgate_specs([OVERHEAD_POLICY], 0.1)[0], c, out)
        with router:
            assert router.process is not None
            asyncio.run(run_sequential(router.target, specs[:args.warm], 60.0))
            before = _counts(router.process.pid, Path(f"{counts}.1.json"))
            results, _ = asyncio.run(run_sequential(router.target, specs[args.warm:], 60.0))
            after = _counts(router.process.pid, Path(f"{counts}.2.json"))
    failed = sum(1 for r in results if not r.ok)
    if failed:
        raise SystemExit(f"{failed} of {len(results)} counted requests failed")
    root = str(Path(__file__).resolve().parent.parent)
    print(f"{mode}, {'non-' if args.no_stream else ''}streaming, {len(results)} requests "
          f"after {args.warm}:")
    print(report(per_request(before, after, len(results)), args.top, root))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
