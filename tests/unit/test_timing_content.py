"""`carries_content`: the relay's per-chunk test for generated content (TTFT, ITL)."""

from __future__ import annotations

import random

import pytest

from router.timing import CONTENT, carries_content


@pytest.mark.parametrize(("chunk", "expected"), [
    (b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n', True),
    (b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n', False),
    (b'data: {"choices":[{"delta":{"content": "spaced"}}]}\n\n', True),
    (b'data: {"choices":[{"text":" a"}]}\n\n', True),
    (b'data: {"choices":[{"delta":{"reasoning_content":"hmm"}}]}\n\n', True),
    (b'data: {"choices":[{"delta":{"tool_calls":[{"id":"c"}]}}]}\n\n', True),
    (b'data: {"choices":[{"delta":{"tool_calls":[]}}]}\n\n', False),
    (b'data: {"choices":[],"usage":{"completion_tokens":3}}\n\n', False),
    (b"data: [DONE]\n\n", False),
    (b'"content":"', False),  # the string's first character has not arrived
])
def test_content_chunks_are_told_from_the_rest(chunk: bytes, expected: bool) -> None:
    assert carries_content(chunk) is expected


def test_agrees_with_the_reference_pattern() -> None:
    pieces = [b'"content":', b'"text":', b'"reasoning":', b'"reasoning_content":',
              b'"tool_calls":', b'"', b" ", b"\n", b"a", b"[", b"{", b":"]
    rng = random.Random(13)
    for _ in range(50_000):
        chunk = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        assert carries_content(chunk) is (CONTENT.search(chunk) is not None), chunk
