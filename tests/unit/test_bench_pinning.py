"""`benchmarks.pinning.GeneratorCore`: the generator's thread on one CPU, the processes
under test on the others, every mask back as it was afterwards."""

from __future__ import annotations

import os
import subprocess
import sys

from benchmarks.pinning import GeneratorCore


def test_the_generator_and_the_processes_under_test_get_cpus_of_their_own() -> None:
    before = os.sched_getaffinity(0)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with GeneratorCore() as pins:
            if len(before) < 2:
                assert not pins.active
                assert os.sched_getaffinity(child.pid) == before
            else:
                assert pins.active
                assert os.sched_getaffinity(0) == pins.generator_cpus
                assert os.sched_getaffinity(child.pid) == pins.other_cpus
                assert not pins.generator_cpus & pins.other_cpus
                assert pins.generator_cpus | pins.other_cpus == before
        assert os.sched_getaffinity(0) == before
        assert os.sched_getaffinity(child.pid) == before
    finally:
        child.kill()
        child.wait()
