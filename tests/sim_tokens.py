"""The token ids the simulator computes by default (its real DeepSeek tokenizer), for tests.

Loaded once per test process: the vocabulary takes about half a second to load.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from engine_sim.prompts import DEFAULT_CHAT_TEMPLATE, DEFAULT_TOKENIZER
from router.tokenization import ModelTokenizer


@functools.cache
def sim_tokenizer() -> ModelTokenizer:
    return ModelTokenizer.load(DEFAULT_TOKENIZER, chat_template_file=DEFAULT_CHAT_TEMPLATE)


def chat_ids(messages: Sequence[Mapping[str, Any]], **fields: Any) -> list[int]:
    """A chat request's prompt ids, as the simulator (and vLLM) compute them."""
    return list(sim_tokenizer().chat_ids({"messages": list(messages), **fields}))


def prompt_ids(text: str) -> list[int]:
    """A completions prompt's ids (special tokens added, as vLLM's default)."""
    return list(sim_tokenizer().encode(text, add_special_tokens=True))
