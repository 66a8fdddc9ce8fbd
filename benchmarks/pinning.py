"""A core of its own for the load generator while the overload phase runs.

Past saturation the generator's own work grows with the offered rate (5,000-15,000
arrivals a second here), and on a 2-core machine that shares the cores with the router and
the pods it takes CPU the router needs: every router's goodput then falls for a reason
that has nothing to do with it (measured: pdgate 0.69 / 0.59 of its maximum at 1.5x / 3x,
vLLM Router 0.66 / 0.56). Clients do not run on a router's cores in a deployment, so for
this phase the generator (the calling thread) is pinned to the first allowed CPU and every
thread of the processes under test (routers, pods, the Mooncake master) to the others. The
phase measures its own maximum under the same pins, so "a share of the maximum" compares
like with like. With one allowed CPU nothing is pinned (`active` is false).
"""

from __future__ import annotations

import os
from types import TracebackType

import psutil


def _threads(pid: int) -> list[int]:
    try:
        return [thread.id for thread in psutil.Process(pid).threads()]
    except psutil.Error:
        return []


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` to `cpus` (threads it starts later inherit the mask)."""
    for tid in _threads(pid):
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # the thread ended meanwhile, or is not ours to move
            continue


class GeneratorCore:
    """Context manager: the calling thread on one CPU, the bench's child processes (and
    their children) on the rest; every mask restored on exit."""

    def __init__(self) -> None:
        self.allowed = sorted(os.sched_getaffinity(0))
        self.active = len(self.allowed) >= 2
        self.generator_cpus = set(self.allowed[:1])
        self.other_cpus = set(self.allowed[1:])
        self._pinned: list[int] = []

    def _under_test(self) -> list[int]:
        return [p.pid for p in psutil.Process().children(recursive=True)]

    def __enter__(self) -> GeneratorCore:
        if self.active:
            self._pinned = self._under_test()
            for pid in self._pinned:
                _pin(pid, self.other_cpus)
            os.sched_setaffinity(0, self.generator_cpus)  # this thread only
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self.active:
            return
        every = set(self.allowed)
        os.sched_setaffinity(0, every)
        for pid in self._pinned:
            _pin(pid, every)

    def describe(self) -> str:
        if not self.active:
            return "not pinned (one CPU allowed)"
        return (f"load generator on CPU {min(self.generator_cpus)}, routers and pods on "
                f"CPU {', '.join(map(str, sorted(self.other_cpus)))}")
