"""The token ids the simulator computes by default (its real DeepSeek tokenizer), for tests.

Loaded once per test process: the vocabulary takes about half a second to load.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from engine_sim.prompts import DEFAULT_CHAT_TEMPLATE, DEFAULT_TOKENIZER
from router.resources import ModelServer, ObjectMeta
from router.tokenization import (
    CHAT_TEMPLATE_ANNOTATION,
    TOKENIZER_ANNOTATION,
    ModelTokenizer,
    TokenizerRegistry,
    TokenizerSpec,
)
from router.view import ServerPods, Snapshot


@functools.cache
def sim_tokenizer() -> ModelTokenizer:
    return ModelTokenizer.load(DEFAULT_TOKENIZER, chat_template_file=DEFAULT_CHAT_TEMPLATE)


def chat_ids(messages: Sequence[Mapping[str, Any]], **fields: Any) -> list[int]:
    """A chat request's prompt ids, as the simulator (and vLLM) compute them."""
    return list(sim_tokenizer().chat_ids({"messages": list(messages), **fields}))


def prompt_ids(text: str) -> list[int]:
    """A completions prompt's ids (special tokens added, as vLLM's default)."""
    return list(sim_tokenizer().encode(text, add_special_tokens=True))


def sim_server(
    tokenizer: str | None = DEFAULT_TOKENIZER,
    chat_template: str | None = str(DEFAULT_CHAT_TEMPLATE),
    name: str = "sim",
) -> ModelServer:
    """A ModelServer whose annotations name the simulator's tokenizer and template."""
    notes = {}
    if tokenizer is not None:
        notes[TOKENIZER_ANNOTATION] = tokenizer
    if chat_template is not None:
        notes[CHAT_TEMPLATE_ANNOTATION] = chat_template
    return ModelServer(
        meta=ObjectMeta(name=name, annotations=notes), model="m", inference_engine="vLLM",
        match_labels={}, pd_group=None, port=8000,
    )


@functools.cache
def sim_registry() -> TokenizerRegistry:
    """A registry holding the simulator's tokenizer for `sim_server()` (shared, loaded once)."""
    server = sim_server()
    spec = TokenizerSpec.of(server)
    assert spec is not None
    registry = TokenizerRegistry(loader=lambda _spec: sim_tokenizer())
    registry.on_snapshot(Snapshot(servers={server.meta.key: ServerPods(server)}))
    return registry
