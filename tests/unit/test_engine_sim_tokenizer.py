"""The tokenizer stand-in and chat template are a contract: pin their behaviour."""

from __future__ import annotations

import pytest

from engine_sim.tokenizer import (
    NUM_RESERVED_IDS,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    Tokenizer,
    encode,
    pieces,
    render_chat,
)


def test_render_chat_template() -> None:
    text = render_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_render_chat_content_parts_and_no_generation_prompt() -> None:
    content = [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "data:,"}},
        {"type": "text", "text": "here"},
    ]
    text = render_chat(
        [{"role": "user", "content": content}, {"role": "assistant", "content": None}],
        add_generation_prompt=False,
    )
    assert text == (
        "<|im_start|>user\nlook\n<|image_url|>\nhere<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"
    )


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        [{"content": "x"}],
        [{"role": "user", "content": 3}],
        [{"role": "u", "content": [{"text": "x"}]}],
    ],
)
def test_render_chat_rejects_bad_messages(messages: object) -> None:
    with pytest.raises(ValueError):
        render_chat(messages)  # type: ignore[arg-type]


def test_pieces_split_words_punctuation_whitespace_and_specials() -> None:
    assert pieces("<|im_start|>user\nHello, world!") == [
        "<|im_start|>", "user", "\n", "Hello", ",", " ", "world", "!",
    ]  # fmt: skip
    assert pieces("a" * 20) == ["a" * 16, "a" * 4]


def test_encode_is_deterministic_and_in_range() -> None:
    ids = encode("The quick brown fox jumps over the lazy dog. " * 3)
    assert ids == encode("The quick brown fox jumps over the lazy dog. " * 3)
    assert all(NUM_RESERVED_IDS <= i < VOCAB_SIZE for i in ids)
    assert ids[0] == ids[19]  # "The" again after 19 pieces
    assert encode("<|im_start|><|im_end|>") == [SPECIAL_TOKENS["<|im_start|>"], 2]


def test_encode_pinned_values() -> None:
    # Changing these breaks every router that hashes prompts: do it only on purpose.
    assert encode("hello world") == [encode("hello")[0], encode(" ")[0], encode("world")[0]]
    assert encode("hi there") == [23610, 2845, 20258]


def test_tokenizer_class_matches_encode() -> None:
    tokenizer = Tokenizer(piece_cache_size=4, encode_cache_size=2)
    for text in ("alpha beta", "gamma, delta!", "alpha beta", "é ü 漢字"):
        assert list(tokenizer.encode(text)) == encode(text)
