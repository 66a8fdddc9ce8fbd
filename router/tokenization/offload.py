"""Tokenizing requests off the event loop when they are big enough to stall it.

Encoding is CPU work in the `tokenizers` library (Rust; it drops the GIL for part of the
work). Measured on a 2-core machine under load (`benchmarks/tokenization.py`, p50), with
the real DeepSeek tokenizer (128k BPE): a chat prompt with nothing memoized costs about
2.7 µs per token (1k tokens 2.7 ms, 8k 27 ms; one bare `encode` of 8k tokens measured
42-48 ms when the machine was busier); memoized, 0.2 ms (1k) and 0.5 ms (8k); handing a
job to a thread and back costs about 130 µs of event-loop time. So a prompt of more than
`OFFLOAD_MIN_CHARS` characters (about 250 tokens, ~0.7 ms cold) is tokenized on a small
bounded pool (`TOKENIZE_THREADS` threads, at most `MAX_PENDING_JOBS` jobs queued, past
which the caller tokenizes inline rather than queue without bound); smaller ones inline.
The thread CPU the pool's jobs take is counted (`cpu`, exported as
`pdgate_background_cpu_seconds{work="tokenize"}`): one clock read before and after a job.

One job, one thread: left alone, the `tokenizers` library spreads each batch it encodes
over a thread pool of its own (rayon, a thread per core), and the tokenizer encodes a
prompt's missing pieces as one batch. A router already runs requests side by side (the
event loop, this pool), so those threads only add hand-offs and spinning: on a 2-core
machine with both cores busy (as under load, or in a trace run beside the engines),
encoding chat-prompt chunks one job per thread cost 0.74 µs of CPU a token against 0.85
with the library's pool (0.69 against 0.73-0.82 on an idle machine), and its wall time
was shorter too (0.95 against 1.20 µs a token). `pdgate serve` therefore switches the
library's pool off (`single_threaded_library`) unless `TOKENIZERS_PARALLELISM` is set.
In the trace phase the switch made no difference beyond that phase's run-to-run spread
(`benchmarks/results/2026-12-05-tokenizer-threads/`).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, TypeVar

from router.tokenization.tokenizer import Endpoint, ModelTokenizer

OFFLOAD_MIN_CHARS: Final = 1_000
TOKENIZE_THREADS: Final = 2
MAX_PENDING_JOBS: Final = 64

#: The `tokenizers` library's switch for its own thread pool.
LIBRARY_PARALLELISM_ENV: Final = "TOKENIZERS_PARALLELISM"

T = TypeVar("T")


def single_threaded_library() -> None:
    """Keep the `tokenizers` library from splitting a job over its own threads (module
    docstring), unless the operator set `TOKENIZERS_PARALLELISM`. The library reads the
    variable at every batch, so this takes effect at once; call it once, at start-up."""
    os.environ.setdefault(LIBRARY_PARALLELISM_ENV, "false")


#: The request fields a chat template renders into the prompt: every string in them counts
#: toward its size (a tool's description or a document is text to encode like a message).
CHAT_RENDERED_FIELDS: Final = ("messages", "tools", "documents", "chat_template_kwargs")


def prompt_chars(endpoint: Endpoint, body: Mapping[str, Any]) -> int:
    """A cheap size of what a request's prompt renders from: the characters of every
    string (and object key) in its prompt, or in the fields a chat template renders."""
    if endpoint == "completion":
        return _chars(body.get("prompt"))
    return sum(_chars(body.get(name)) for name in CHAT_RENDERED_FIELDS)


def _chars(value: Any) -> int:
    """Characters of the strings (and object keys) in a parsed JSON value, walked without
    recursion: a body may nest as deep as its parser allows."""
    if isinstance(value, str):
        return len(value)
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, inner in item.items():
                total += len(key)
                if isinstance(inner, str):
                    total += len(inner)
                elif isinstance(inner, dict | list):
                    stack.append(inner)
        elif isinstance(item, list):
            for inner in item:
                if isinstance(inner, str):
                    total += len(inner)
                elif isinstance(inner, dict | list):
                    stack.append(inner)
    return total


class CpuTally:
    """Thread CPU seconds of the pool's jobs, added from its threads (hence the lock)."""

    __slots__ = ("_lock", "value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0.0

    def add(self, seconds: float) -> None:
        with self._lock:
            self.value += seconds


class TokenizePool:
    """A bounded thread pool for tokenization; owned by whoever serves requests."""

    def __init__(
        self,
        threads: int = TOKENIZE_THREADS,
        min_chars: int = OFFLOAD_MIN_CHARS,
        max_pending: int = MAX_PENDING_JOBS,
    ) -> None:
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="pdgate-tokenize")
        self.min_chars = min_chars
        self._max_pending = max_pending
        self._pending = 0
        self.cpu = CpuTally()

    async def request_ids(
        self, tokenizer: ModelTokenizer, endpoint: Endpoint, body: Mapping[str, Any]
    ) -> list[tuple[int, ...]]:
        """`tokenizer.request_ids(...)`, on the pool when the prompt is big (module docstring).

        Raises what `request_ids` raises (`ChatInputError`).
        """
        if prompt_chars(endpoint, body) < self.min_chars:
            return tokenizer.request_ids(endpoint, body)
        return await self.call(lambda: tokenizer.request_ids(endpoint, body))

    async def call(self, job: Callable[[], T]) -> T:
        """`job()` on the pool, or inline when `max_pending` jobs are already waiting."""
        if self._pending >= self._max_pending:
            return job()
        self._pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._executor, self._timed, job
            )
        finally:
            self._pending -= 1

    def _timed(self, job: Callable[[], T]) -> T:
        started = time.thread_time()
        try:
            return job()
        finally:
            self.cpu.add(time.thread_time() - started)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
