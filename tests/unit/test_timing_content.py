"""`carries_content` / `content_events`: the relay's per-write test for generated content
(TTFT, ITL)."""

from __future__ import annotations

import random

import pytest

from router.timing import CONTENT, carries_content, content_events


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


ROLE = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
TOKEN = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"completion_tokens":3}}\n\n'


@pytest.mark.parametrize(("write", "expected"), [
    (TOKEN, 1),
    (ROLE, 0),
    (ROLE + TOKEN, 1),  # a stream's first read: the role chunk and the first token
    (TOKEN * 3, 3),
    (TOKEN + USAGE + b"data: [DONE]\n\n", 1),
    (b'data: {"choices":[{"delta":{"content":"say data: twice"}}]}\n\n', 1),
    (b"event: response.output_text.delta\n" + TOKEN + b"event: response.completed\n"
     b'data: {"type":"response.completed"}\n\n', 1),
    (b"", 0),
])
def test_content_events_counts_the_events_of_one_write(write: bytes, expected: int) -> None:
    """Events relayed in one write (the events of one upstream read) are each a token the
    client received: the ITL histogram gets one observation per content event."""
    assert content_events(write) == expected
