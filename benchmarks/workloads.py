"""Seeded workloads: the same request sequence for every router under test.

- `shared-prefix`: G groups x Q questions; every group has its own long system prompt and
  the requests of all groups arrive shuffled (SGLang's generated-shared-prefix, llm-d's
  prefix benchmark).
- `multi-round`: U users, each a multi-turn chat of R rounds whose history grows
  (production-stack's multi-round QA). The assistant turns in the history are synthetic
  and seeded, not the answers received, so the prompts do not depend on the router.
- `random`: independent prompts, nothing shared.
- `overhead`: tiny prompts and a few output tokens, run against `--fast` engines so that
  the router's own cost is what shows.

Text is made of synthetic words that the simulator's real tokenizer makes one token of,
leading space included (`benchmarks.words`), so `n` tokens are `n` words.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

from benchmarks.specs import RequestSpec, Session
from benchmarks.words import single_token_words

TOKENS_PER_WORD: Final = 1
SESSION_HEADER: Final = "x-session-id"


def text(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of seeded text."""
    return " ".join(rng.choices(single_token_words(), k=max(1, tokens // TOKENS_PER_WORD)))


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    sessions: tuple[tuple[RequestSpec, ...], ...]
    description: str

    @property
    def request_count(self) -> int:
        return sum(len(session) for session in self.sessions)


@dataclass(frozen=True, slots=True)
class SharedPrefixParams:
    groups: int
    questions: int
    system_tokens: int
    question_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class MultiRoundParams:
    users: int
    rounds: int
    system_tokens: int
    question_tokens: int
    answer_tokens: int


@dataclass(frozen=True, slots=True)
class RandomParams:
    requests: int
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class OverheadParams:
    requests: int
    prompt_tokens: int = 8
    output_tokens: int = 4


def _body(model: str, messages: Sequence[dict[str, str]], max_tokens: int, stream: bool) -> bytes:
    body: dict[str, Any] = {
        "model": model,
        "messages": list(messages),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


def _rng(name: str, seed: int) -> random.Random:
    # str seeds hash with SHA-512 (version 2): independent of PYTHONHASHSEED.
    return random.Random(f"pdgate-bench:{name}:{seed}")


def shared_prefix(
    params: SharedPrefixParams, model: str, seed: int, stream: bool = True
) -> Workload:
    rng = _rng("shared-prefix", seed)
    systems = [
        f"Group {g}. " + text(rng, params.system_tokens) for g in range(params.groups)
    ]
    pairs = [(g, q) for g in range(params.groups) for q in range(params.questions)]
    questions = {pair: text(rng, params.question_tokens) + "?" for pair in pairs}
    rng.shuffle(pairs)
    sessions = []
    for index, (g, q) in enumerate(pairs):
        messages = [
            {"role": "system", "content": systems[g]},
            {"role": "user", "content": questions[(g, q)]},
        ]
        body = _body(model, messages, params.output_tokens, stream)
        sessions.append((RequestSpec(index, 0, body, stream, tag=f"g{g}"),))
    return Workload(
        "shared-prefix",
        tuple(sessions),
        f"{params.groups} groups x {params.questions} questions, system prompt "
        f"~{params.system_tokens} tokens, question ~{params.question_tokens}, "
        f"output {params.output_tokens}",
    )


def multi_round(params: MultiRoundParams, model: str, seed: int, stream: bool = True) -> Workload:
    rng = _rng("multi-round", seed)
    sessions = []
    for user in range(params.users):
        history: list[dict[str, str]] = [
            {"role": "system", "content": f"User {user}. " + text(rng, params.system_tokens)}
        ]
        turns = []
        # A session header, as chat front ends send; routers that do not use it ignore it.
        session = ((SESSION_HEADER, f"bench-user-{seed}-{user}"),)
        for turn in range(params.rounds):
            history.append({"role": "user", "content": text(rng, params.question_tokens) + "?"})
            body = _body(model, history, params.answer_tokens, stream)
            turns.append(RequestSpec(user, turn, body, stream, tag=f"u{user}", headers=session))
            history.append({"role": "assistant", "content": text(rng, params.answer_tokens)})
        sessions.append(tuple(turns))
    return Workload(
        "multi-round",
        tuple(sessions),
        f"{params.users} users x {params.rounds} rounds, system ~{params.system_tokens} "
        f"tokens, +~{params.question_tokens + params.answer_tokens} per round",
    )


def random_prompts(params: RandomParams, model: str, seed: int, stream: bool = True) -> Workload:
    rng = _rng("random", seed)
    sessions = []
    for index in range(params.requests):
        messages = [{"role": "user", "content": f"{index}. " + text(rng, params.prompt_tokens)}]
        body = _body(model, messages, params.output_tokens, stream)
        sessions.append((RequestSpec(index, 0, body, stream),))
    return Workload(
        "random",
        tuple(sessions),
        f"{params.requests} unrelated prompts of ~{params.prompt_tokens} tokens, "
        f"output {params.output_tokens}",
    )


def overhead(params: OverheadParams, model: str, seed: int, stream: bool = True) -> Workload:
    rng = _rng("overhead", seed)
    sessions = []
    for index in range(params.requests):
        messages = [{"role": "user", "content": text(rng, params.prompt_tokens)}]
        body = _body(model, messages, params.output_tokens, stream)
        sessions.append((RequestSpec(index, 0, body, stream),))
    return Workload(
        "overhead",
        tuple(sessions),
        f"tiny prompts (~{params.prompt_tokens} tokens), {params.output_tokens} output tokens",
    )


def session_slice(sessions: Sequence[Session], count: int) -> list[Session]:
    """The first `count` sessions (a shorter run over the same sequence)."""
    return list(sessions[:count])
