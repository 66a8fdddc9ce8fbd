"""The opcode counter behind `python -m benchmarks.opcodes` and its per-request report."""

from __future__ import annotations

import sys

from benchmarks.opcodes import OpcodeCounter, per_request, report


def _loop(n: int) -> int:
    total = 0
    for i in range(n):
        total += i
    return total


def _unused() -> None:
    return None


def _count(*calls: int) -> dict[str, list[int]]:
    counter = OpcodeCounter()
    previous = sys.gettrace()
    counter.install()
    try:
        for n in calls:
            _loop(n)
    finally:
        counter.uninstall()
        sys.settrace(previous)
    return counter.snapshot()


def _entry(snapshot: dict[str, list[int]], name: str) -> list[int]:
    [key] = [k for k in snapshot if k.endswith(f"({name})") and __file__ in k]
    return snapshot[key]


def test_the_counter_counts_each_calls_opcodes_the_same_every_time() -> None:
    once = _entry(_count(5), "_loop")
    twice = _entry(_count(5, 5), "_loop")
    longer = _entry(_count(50), "_loop")
    assert once[1] == 1 and twice[1] == 2
    assert twice[0] == 2 * once[0] > 0  # the same code runs the same opcodes
    assert longer[0] > once[0]  # ... and more of them for more iterations
    assert not any(k.endswith("(_unused)") for k in _count(5))


def test_per_request_is_the_difference_between_two_snapshots_most_opcodes_first() -> None:
    before = {"a.py:1(f)": [100, 10], "a.py:9(g)": [50, 5], "b.py:3(h)": [7, 1]}
    after = {"a.py:1(f)": [300, 30], "a.py:9(g)": [650, 25], "b.py:3(h)": [7, 1],
             "c.py:2(new)": [40, 4]}
    rows = per_request(before, after, 20)
    assert rows == [("a.py:9(g)", 30.0, 1.0), ("a.py:1(f)", 10.0, 1.0),
                    ("c.py:2(new)", 2.0, 0.2)]  # h did not run in between: left out
    text = report(rows, 2, root="")
    assert text.splitlines()[0] == "42 opcodes and 2 Python calls a request"
    assert "a.py:9(g)" in text and "a.py:1(f)" in text and "c.py" not in text


def test_the_report_shortens_paths_to_the_package() -> None:
    rows = [("/x/repo/router/proxy.py:5(serve)", 3.0, 1.0),
            ("/x/repo/.venv/lib/python3.11/site-packages/uvicorn/main.py:7(run)", 2.0, 1.0)]
    lines = report(rows, 5, root="/x/repo").splitlines()
    assert lines[-2].endswith("  router/proxy.py:5(serve)")
    assert lines[-1].endswith("  uvicorn/main.py:7(run)")
