"""A serving router encodes each tokenizing job on the thread that runs it: the
`tokenizers` library's own thread pool stays off unless the operator turns it on
(`router.tokenization.offload.single_threaded_library`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from router.tokenization.offload import LIBRARY_PARALLELISM_ENV, single_threaded_library

ROOT = Path(__file__).resolve().parents[2]

#: Encodes a batch of pieces as the tokenizer does for a prompt's missing pieces, and
#: prints the process's threads (native ones included) before and after.
_PROBE = """
import sys
import psutil
from engine_sim.prompts import DEFAULT_TOKENIZER
from router.tokenization import ModelTokenizer
from router.tokenization.offload import single_threaded_library
tokenizer = ModelTokenizer.load(DEFAULT_TOKENIZER)
if sys.argv[1] == "serve":
    single_threaded_library()
before = psutil.Process().num_threads()
texts = ["the prefix cache of a prefill pod " * 200] * 8
ids = tokenizer._encode(texts, False)
assert len(ids) == 8 and all(ids[0] == one for one in ids)
print(before, psutil.Process().num_threads())
"""


def _threads(mode: str) -> tuple[int, int]:
    env = {k: v for k, v in os.environ.items() if k != LIBRARY_PARALLELISM_ENV}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=120, check=True,
    ).stdout.split()
    return int(out[0]), int(out[1])


def test_serving_encodes_a_batch_without_the_library_thread_pool() -> None:
    before, after = _threads("serve")
    assert after == before
    # The control: without the switch the library starts its pool for the same batch,
    # so the count above can tell the difference.
    before, after = _threads("library-default")
    assert after > before


def test_an_operator_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LIBRARY_PARALLELISM_ENV, "true")
    single_threaded_library()
    assert os.environ[LIBRARY_PARALLELISM_ENV] == "true"
    monkeypatch.delenv(LIBRARY_PARALLELISM_ENV)
    single_threaded_library()
    assert os.environ[LIBRARY_PARALLELISM_ENV] == "false"
