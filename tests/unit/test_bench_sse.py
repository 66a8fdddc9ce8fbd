"""The benchmark's SSE parsing: event splitting across reads, and what counts as content."""

from __future__ import annotations

import orjson
import pytest

from benchmarks.sse import ChunkKind, SSEError, SSEParser, classify


def _chunk(delta: dict[str, object] | None = None, text: str | None = None) -> bytes:
    choice: dict[str, object] = {"index": 0}
    if delta is not None:
        choice["delta"] = delta
    if text is not None:
        choice["text"] = text
    return b"data: " + orjson.dumps({"object": "chat.completion.chunk", "choices": [choice]})


STREAM = (
    _chunk({"role": "assistant", "content": ""})
    + b"\n\n"
    + _chunk({"content": " hello"})
    + b"\n\n"
    + _chunk({"content": " world"})
    + b"\n\n"
    + b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
    + b"data: [DONE]\n\n"
)


def _kinds(payloads: list[bytes]) -> list[ChunkKind]:
    return [classify(p)[0] for p in payloads]


def test_whole_stream_in_one_read() -> None:
    payloads = SSEParser().feed(STREAM)
    assert _kinds(payloads) == [
        ChunkKind.OTHER,
        ChunkKind.CONTENT,
        ChunkKind.CONTENT,
        ChunkKind.OTHER,
        ChunkKind.DONE,
    ]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64])
def test_any_split_gives_the_same_events(size: int) -> None:
    parser = SSEParser()
    payloads: list[bytes] = []
    for start in range(0, len(STREAM), size):
        payloads += parser.feed(STREAM[start : start + size])
    payloads += parser.close()
    assert payloads == SSEParser().feed(STREAM)


def test_crlf_line_endings_even_when_split_between_cr_and_lf() -> None:
    crlf = STREAM.replace(b"\n", b"\r\n")
    parser = SSEParser()
    payloads: list[bytes] = []
    for start in range(0, len(crlf), 5):
        payloads += parser.feed(crlf[start : start + 5])
    assert payloads == SSEParser().feed(STREAM)


def test_incomplete_event_waits_for_its_blank_line() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: [DO") == []
    assert parser.feed(b"NE]\n") == []
    assert parser.feed(b"\n") == [b"[DONE]"]


def test_final_event_without_blank_line_is_kept_on_close() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: [DONE]") == []
    assert parser.close() == [b"[DONE]"]


def test_comments_and_other_fields_are_ignored_and_data_lines_join() -> None:
    parser = SSEParser()
    out = parser.feed(b": keep-alive\n\nevent: message\nid: 7\ndata: {\"a\":\ndata: 1}\n\n")
    assert out == [b'{"a":\n1}']


def test_role_only_and_empty_deltas_are_not_content() -> None:
    assert classify(_chunk({"role": "assistant"})[6:])[0] is ChunkKind.OTHER
    assert classify(_chunk({"content": ""})[6:])[0] is ChunkKind.OTHER
    assert classify(_chunk({"content": None})[6:])[0] is ChunkKind.OTHER


def test_reasoning_and_completions_text_are_content() -> None:
    assert classify(_chunk({"reasoning_content": "hmm"})[6:])[0] is ChunkKind.CONTENT
    assert classify(_chunk(text=" hi")[6:])[0] is ChunkKind.CONTENT
    assert classify(_chunk(text="")[6:])[0] is ChunkKind.OTHER


def test_errors_in_both_shapes() -> None:
    nested = b'{"error": {"message": "boom", "code": 500}}'
    flat = b'{"object": "error", "message": "boom"}'
    assert classify(nested)[0] is ChunkKind.ERROR
    assert classify(flat)[0] is ChunkKind.ERROR


def test_non_json_payload_is_an_error() -> None:
    with pytest.raises(SSEError):
        classify(b"not json")
