"""Synthetic words that the simulator's real tokenizer makes exactly one token of.

The 1,829 lower-case three-letter words of the DeepSeek vocabulary, each a single token
with its leading space, so a text of N space-separated words is N tokens of exactly 4
characters (what `approximateIndex.charsPerToken` assumes, and what the old stand-in
tokenizer gave). Workloads sized in tokens stay sized in tokens with the real tokenizer.
"""

from __future__ import annotations

import functools
import re
from typing import Final

from engine_sim.prompts import DEFAULT_CHAT_TEMPLATE, DEFAULT_TOKENIZER
from router.tokenization import ModelTokenizer

WORD_COUNT: Final = 4096
_WORD: Final = re.compile("\u0120[a-z]{3}")


@functools.cache
def sim_tokenizer() -> ModelTokenizer:
    """The simulator's default tokenizer and template (what the pods and the router use)."""
    return ModelTokenizer.load(DEFAULT_TOKENIZER, chat_template_file=DEFAULT_CHAT_TEMPLATE)


@functools.cache
def single_token_words() -> tuple[str, ...]:
    vocab = sim_tokenizer().vocab()
    return tuple(sorted(t[1:] for t in vocab if _WORD.fullmatch(t))[:WORD_COUNT])
