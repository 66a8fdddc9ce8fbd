"""Deterministic tokenizer stand-in and chat template: THE contract the router hashes against.

The simulator has no model and downloads nothing, yet prefix-cache-aware routing needs the
router to compute the very token ids (and so the very block hashes) an engine computes. This
module is that contract; the router imports `render_chat` and `encode` from here. Changing
any rule below changes every block hash, so treat the rules as a wire format.

Chat template (`render_chat`), one line per message, then the generation prompt:

    <|im_start|>{role}\\n{content}<|im_end|>\\n      (for every message, in order)
    <|im_start|>assistant\\n                         (when add_generation_prompt, the default)

`content` is a string, null (rendered as ""), or a list of parts: `{"type": "text", "text":
...}` parts contribute their text, any other part contributes the placeholder
`<|{type}|>` (e.g. `<|image_url|>`); parts are joined with "\\n".

Tokenization (`encode`): the text is split, left to right, into pieces by `PIECE_PATTERN`:
a special token (`SPECIAL_TOKENS`), else a run of 1-16 word characters, else one punctuation
character, else a run of 1-16 whitespace characters. A special token maps to its fixed id;
any other piece maps to `NUM_RESERVED_IDS + xxh64(piece utf-8, seed=TOKENIZER_SEED) %
(VOCAB_SIZE - NUM_RESERVED_IDS)`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import xxhash

VOCAB_SIZE: Final = 32_000
NUM_RESERVED_IDS: Final = 16
TOKENIZER_SEED: Final = 0

SPECIAL_TOKENS: Final[Mapping[str, int]] = {
    "<|endoftext|>": 0,
    "<|im_start|>": 1,
    "<|im_end|>": 2,
}

PIECE_PATTERN: Final = re.compile(
    "|".join(re.escape(token) for token in SPECIAL_TOKENS) + r"|\w{1,16}|[^\w\s]|\s{1,16}"
)

#: Default bounds of a `Tokenizer`'s memo caches (entries).
PIECE_CACHE_SIZE: Final = 65_536
ENCODE_CACHE_SIZE: Final = 256


def pieces(text: str) -> list[str]:
    """Split text into the pieces that become tokens (one id per piece)."""
    return PIECE_PATTERN.findall(text)


def piece_id(piece: str) -> int:
    """The token id of one piece."""
    special = SPECIAL_TOKENS.get(piece)
    if special is not None:
        return special
    digest = xxhash.xxh64_intdigest(piece.encode("utf-8"), seed=TOKENIZER_SEED)
    return NUM_RESERVED_IDS + digest % (VOCAB_SIZE - NUM_RESERVED_IDS)


def encode(text: str) -> list[int]:
    """Token ids of `text` (pure, uncached: the reference implementation)."""
    return [piece_id(piece) for piece in PIECE_PATTERN.findall(text)]


def _render_content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                raise ValueError("each content part must be an object with a string 'type'")
            if part["type"] == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise ValueError("a text content part needs a string 'text'")
                parts.append(text)
            else:
                parts.append(f"<|{part['type']}|>")
        return "\n".join(parts)
    raise ValueError("message content must be a string, null or a list of parts")


def render_chat(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """Render chat messages to the prompt text (see the module docstring for the template).

    Raises ValueError when `messages` is not a non-empty list of {role, content} objects.
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    out: list[str] = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ValueError("each message must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError("each message needs a string 'role'")
        out.append(f"<|im_start|>{role}\n{_render_content(message.get('content'))}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


class Tokenizer:
    """`encode` with bounded memo caches, owned by one engine so nothing global mutates.

    Produces exactly what the module-level `encode` produces.
    """

    def __init__(
        self, piece_cache_size: int = PIECE_CACHE_SIZE, encode_cache_size: int = ENCODE_CACHE_SIZE
    ) -> None:
        self._piece_id: Callable[[str], int] = functools.lru_cache(maxsize=piece_cache_size)(
            piece_id
        )
        self._encode: Callable[[str], tuple[int, ...]] = functools.lru_cache(
            maxsize=encode_cache_size
        )(self._encode_uncached)

    def _encode_uncached(self, text: str) -> tuple[int, ...]:
        lookup = self._piece_id
        return tuple([lookup(piece) for piece in PIECE_PATTERN.findall(text)])

    def encode(self, text: str) -> tuple[int, ...]:
        """Token ids of `text`, memoized."""
        return self._encode(text)
