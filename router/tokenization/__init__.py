"""A model's own tokenizer and chat template, applied exactly as vLLM applies them.

Public API (router and simulator both use it; it imports nothing from either):

- `ModelTokenizer.load(spec, revision=None, chat_template_file=None)` /
  `ModelTokenizer.from_dir(path, chat_template_file=None)`: load offline (`source.py`).
  `chat_ids(body)`, `completion_ids(prompt, add_special_tokens=True)`,
  `request_ids("chat" | "completion", body)` (one id tuple per prompt),
  `render_chat(messages, tools=..., add_generation_prompt=..., continue_final_message=...,
  chat_template_kwargs=...)`, `encode(text, add_special_tokens)`, `decode(ids)`,
  `token_strs(ids)`. Bad input raises `ChatInputError` (a ValueError).
- `resolve_tokenizer_dir(spec, revision=None, env=None)` -> Path, `TokenizerNotFound`.
- `TokenizerRegistry` / `TokenizerSpec`: per-ModelServer tokenizers from annotations.
- `TokenizePool`: bounded off-loop tokenization above `OFFLOAD_MIN_CHARS`.
- `ChatTemplate`: one compiled template (`render`, `content_format`).
"""

from router.tokenization.messages import ChatInputError, UnsupportedContent
from router.tokenization.offload import OFFLOAD_MIN_CHARS, TokenizePool, prompt_chars
from router.tokenization.registry import (
    CHAT_TEMPLATE_ANNOTATION,
    REVISION_ANNOTATION,
    TOKENIZER_ANNOTATION,
    TokenizerRegistry,
    TokenizerSpec,
)
from router.tokenization.source import TokenizerNotFound, resolve_tokenizer_dir
from router.tokenization.template import ChatTemplate, ChatTemplateError
from router.tokenization.tokenizer import Endpoint, ModelTokenizer, TokenizerLoadError

__all__ = [
    "CHAT_TEMPLATE_ANNOTATION",
    "OFFLOAD_MIN_CHARS",
    "REVISION_ANNOTATION",
    "TOKENIZER_ANNOTATION",
    "ChatInputError",
    "ChatTemplate",
    "ChatTemplateError",
    "Endpoint",
    "ModelTokenizer",
    "TokenizePool",
    "TokenizerLoadError",
    "TokenizerNotFound",
    "TokenizerRegistry",
    "TokenizerSpec",
    "UnsupportedContent",
    "prompt_chars",
    "resolve_tokenizer_dir",
]
