"""The benchmark's workloads: seeded, deterministic, and shaped as documented."""

from __future__ import annotations

import itertools
import subprocess
import sys

import orjson

from benchmarks.loadgen import poisson_arrivals
from benchmarks.workloads import (
    MultiRoundParams,
    OverheadParams,
    RandomParams,
    SharedPrefixParams,
    Workload,
    multi_round,
    overhead,
    random_prompts,
    shared_prefix,
)
from tests.sim_tokens import chat_ids, prompt_ids

SP = SharedPrefixParams(groups=3, questions=4, system_tokens=256, question_tokens=16,
                        output_tokens=4)
MR = MultiRoundParams(users=3, rounds=4, system_tokens=128, question_tokens=16, answer_tokens=8)


def _all(seed: int) -> list[Workload]:
    return [
        shared_prefix(SP, "m", seed),
        multi_round(MR, "m", seed),
        random_prompts(RandomParams(requests=5, prompt_tokens=64, output_tokens=4), "m", seed),
        overhead(OverheadParams(requests=5), "m", seed),
    ]


def _bodies(workload: Workload) -> list[bytes]:
    return [spec.body for session in workload.sessions for spec in session]


def test_same_seed_same_requests() -> None:
    for first, second in zip(_all(7), _all(7), strict=True):
        assert _bodies(first) == _bodies(second)


def test_different_seed_different_requests() -> None:
    for first, second in zip(_all(7), _all(8), strict=True):
        assert _bodies(first) != _bodies(second)


def test_independent_of_the_process_hash_seed() -> None:
    code = (
        "from benchmarks.workloads import *;"
        "import hashlib;"
        "w=shared_prefix(SharedPrefixParams(2,3,64,8,4),'m',1);"
        "print(hashlib.sha256(b''.join(s.body for x in w.sessions for s in x)).hexdigest())"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            capture_output=True,
            check=True,
            text=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(digests) == 1


def test_shared_prefix_groups_share_their_system_prompt_and_are_shuffled() -> None:
    workload = shared_prefix(SP, "m", 0)
    assert workload.request_count == SP.groups * SP.questions
    systems: dict[str, set[str]] = {}
    order = []
    for (spec,) in workload.sessions:
        body = orjson.loads(spec.body)
        systems.setdefault(spec.tag, set()).add(body["messages"][0]["content"])
        order.append(spec.tag)
        assert body["max_tokens"] == SP.output_tokens and body["stream"] is True
    assert all(len(s) == 1 for s in systems.values()) and len(systems) == SP.groups
    assert order != sorted(order)  # groups interleave
    tokens = len(prompt_ids(next(iter(systems["g0"]))))
    assert abs(tokens - SP.system_tokens) <= 8


def test_multi_round_history_grows_and_each_turn_extends_the_last() -> None:
    workload = multi_round(MR, "m", 0)
    assert len(workload.sessions) == MR.users
    for session in workload.sessions:
        assert [spec.turn for spec in session] == list(range(MR.rounds))
        prompts = [chat_ids(orjson.loads(spec.body)["messages"]) for spec in session]
        for shorter, longer in itertools.pairwise(prompts):
            # the previous prompt's tokens are a prefix of the next one's (the template ends
            # a user turn with the generation prompt itself)
            assert longer[: len(shorter)] == shorter
            assert len(longer) > len(shorter)


def test_random_prompts_share_nothing_beyond_the_template() -> None:
    workload = random_prompts(RandomParams(requests=4, prompt_tokens=64, output_tokens=4), "m", 0)
    contents = [orjson.loads(s.body)["messages"][0]["content"] for (s,) in workload.sessions]
    firsts = {c.split(" ", 2)[1] for c in contents}
    assert len(set(contents)) == 4 and len(firsts) >= 3


def test_poisson_arrivals_are_seeded_and_have_the_rate() -> None:
    first = poisson_arrivals(100.0, 2000, seed=3)
    assert first == poisson_arrivals(100.0, 2000, seed=3)
    assert first != poisson_arrivals(100.0, 2000, seed=4)
    assert all(b > a for a, b in itertools.pairwise(first))
    assert 17.0 < first[-1] < 23.0  # 2000 arrivals at 100/s take about 20 s
