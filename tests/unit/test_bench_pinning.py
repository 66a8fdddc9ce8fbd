"""`benchmarks.pinning.GeneratorCore`: the generator's thread on one CPU, every thread of
the processes under test on the others, every mask back as it was afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from benchmarks.pinning import GeneratorCore

#: A child with two threads, like a pod or a router with a worker thread.
CHILD = ("import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); "
         "time.sleep(30)")


def _masks(pid: int) -> set[frozenset[int]]:
    return {frozenset(os.sched_getaffinity(t.id)) for t in psutil.Process(pid).threads()}


def test_the_generator_and_the_processes_under_test_get_cpus_of_their_own() -> None:
    before = os.sched_getaffinity(0)
    child = subprocess.Popen([sys.executable, "-c", CHILD])
    try:
        deadline = time.monotonic() + 10
        while psutil.Process(child.pid).num_threads() < 2:  # the child's thread is up
            assert time.monotonic() < deadline, "the child never started its thread"
            time.sleep(0.01)
        with GeneratorCore() as pins:
            if len(before) < 2:
                assert not pins.active
                assert _masks(child.pid) == {frozenset(before)}
            else:
                assert pins.active
                assert os.sched_getaffinity(0) == pins.generator_cpus
                assert _masks(child.pid) == {frozenset(pins.other_cpus)}
                assert not pins.generator_cpus & pins.other_cpus
                assert pins.generator_cpus | pins.other_cpus == before
        assert os.sched_getaffinity(0) == before
        assert _masks(child.pid) == {frozenset(before)}
    finally:
        child.kill()
        child.wait()
