"""`ModelTokenizer`: a model's own tokenizer and chat template, tokenizing as vLLM does.

Chat (`chat_ids`): the messages are rebuilt as vLLM does (`messages.conversation`, in the
template's content format), rendered with the template (`template.ChatTemplate`), and the
text is encoded with `add_special_tokens=False` (the request's `add_special_tokens`,
default false, as vLLM's chat and `/tokenize` chat requests), since the template writes
the BOS itself. Completions (`completion_ids`): a string prompt is encoded with
`add_special_tokens` (default true), token ids pass through, and a batch gives one token
list per prompt.

Special tokens on encode: those `tokenizer.json`'s post-processor adds. transformers (v5)
does the same: with a `tokenizer.json` it drops `add_bos_token` / `add_eos_token` from
`tokenizer_config.json` (a checked-in `tokenizer.json` already encodes them), and so does
this package; named special tokens missing from the vocabulary are added, as it does.

Memo, exact by construction. The `tokenizers` library cuts a text at every added token
(special or not) and encodes the pieces in between independently. When the tokenizer
makes that cut context-free (no normalizer; no added token that strips spaces around it
or matches whole words only; no Metaspace pre-tokenizer, whose "prepend on the first
piece only" depends on position), encoding piece by piece and concatenating is the same
computation, so `chat_ids` memoizes pieces: a repeated system prompt, tool list or earlier
turn costs a dictionary lookup. Pieces missing from the memo are encoded in one batch
call. For other tokenizers (`piecewise` false) whole texts are memoized. Bounds:
`PIECE_MEMO_ENTRIES` pieces holding at most `PIECE_MEMO_TOKENS` ids, pieces shorter than
`PIECE_MEMO_MIN_CHARS` are not stored; `TEXT_MEMO_ENTRIES` whole texts. Each memo also
keeps at most `MEMO_CHARS` characters of text as its keys: the texts are the clients' (a
request body may be megabytes, and a run of spaces encodes at about a hundred characters
a token, so the id bound alone let whole bodies pile up).

Chunks, exact by construction too. A byte-level BPE (`ByteLevel` pre-tokenizer, no prefix
space added) encodes each pre-token on its own, and the regex splits of every such
tokenizer in use (GPT-2, cl100k/Llama 3, DeepSeek, Qwen) end a pre-token at a space that
follows a letter and precedes one (the space starts the next word's pre-token). So a
piece longer than `CHUNK_CHARS` is cut there, about every `CHUNK_CHARS` characters counted
from the piece's start, and its chunks go through the piece memo: two prompts that share a
long leading text (a document, a conversation's earlier turns in one message) share their
leading chunks, and only the rest is encoded. The test suite checks chunked == whole on
random and real texts.
"""

from __future__ import annotations

import json
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal

import tokenizers

from router.tokenization.config import TokenizerConfig, TokenizerConfigError
from router.tokenization.messages import ChatInputError, conversation, tool_schemas
from router.tokenization.source import resolve_tokenizer_dir
from router.tokenization.template import ChatTemplate, ChatTemplateError

Endpoint = Literal["chat", "completion"]

#: Bounds of one tokenizer's memos.
PIECE_MEMO_ENTRIES: Final = 4_096
PIECE_MEMO_TOKENS: Final = 4_000_000
PIECE_MEMO_MIN_CHARS: Final = 32
TEXT_MEMO_ENTRIES: Final = 256
#: Characters of text one memo keeps as its keys, at most.
MEMO_CHARS: Final = 16_000_000
#: Pieces longer than twice this are cut into chunks of about this many characters.
CHUNK_CHARS: Final = 1_024
#: Bound of compiled request-level templates kept per tokenizer.
TEMPLATE_CACHE_ENTRIES: Final = 8


class TokenizerLoadError(ValueError):
    """A tokenizer that could not be loaded; the message says what and why."""


class _LRU:
    """A small thread-safe LRU of text -> token ids, bounded in entries, stored ids and
    the characters of the texts it is keyed by.

    Ids are kept as 4-byte `array("I")` items: a tuple of Python ints costs about 36 bytes
    an id (the memo of a long-prompt workload was ~36 MB as tuples, ~4 MB as arrays)."""

    def __init__(self, entries: int, tokens: int, chars: int = MEMO_CHARS) -> None:
        self._data: OrderedDict[Any, tuple[array[int], int]] = OrderedDict()
        self._entries = entries
        self._tokens = tokens
        self._chars = chars
        self._stored = 0
        self._stored_chars = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: Any) -> array[int] | None:
        with self._lock:
            entry = self._data.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._data.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: Any, value: Sequence[int], chars: int) -> None:
        """Keep `value` under `key`, a text of `chars` characters (or keyed by one)."""
        with self._lock:
            if key in self._data or chars > self._chars:
                return
            self._data[key] = (array("I", value), chars)
            self._stored += len(value)
            self._stored_chars += chars
            while self._data and (
                len(self._data) > self._entries or self._stored > self._tokens
                or self._stored_chars > self._chars
            ):
                _, (dropped, dropped_chars) = self._data.popitem(last=False)
                self._stored -= len(dropped)
                self._stored_chars -= dropped_chars

    @property
    def chars(self) -> int:
        """Characters of text held as keys."""
        return self._stored_chars

    def __len__(self) -> int:
        return len(self._data)


def _spec_of(backend: tokenizers.Tokenizer) -> dict[str, Any]:
    """The parts of `tokenizer.json` the memo's exactness depends on, read back from the
    loaded tokenizer: parsing the whole file in Python as well (vocabulary and merges)
    would double the load's peak memory (~110 vs ~67 MB for DeepSeek's 128k BPE)."""

    def state(part: Any) -> Any:
        return None if part is None else json.loads(part.__getstate__())

    return {
        "normalizer": state(backend.normalizer),
        "pre_tokenizer": state(backend.pre_tokenizer),
        "added_tokens": [
            {"lstrip": t.lstrip, "rstrip": t.rstrip, "single_word": t.single_word}
            for t in backend.get_added_tokens_decoder().values()
        ],
    }


def _piecewise(spec: Mapping[str, Any]) -> bool:
    """Whether cutting at added tokens is context-free for this tokenizer.json."""
    normalizer = spec.get("normalizer")
    if normalizer is not None and not (
        normalizer.get("type") == "Sequence" and not normalizer.get("normalizers")
    ):
        return False
    for token in spec.get("added_tokens") or ():
        if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
            return False
    return "Metaspace" not in json.dumps(spec.get("pre_tokenizer"))


def _chunkable(spec: Mapping[str, Any]) -> bool:
    """Whether a space between two letters always starts a pre-token (the docstring):
    a byte-level pre-tokenizer that adds no prefix space, and no other kind."""
    pre = json.dumps(spec.get("pre_tokenizer"))
    return (
        _piecewise(spec)
        and '"ByteLevel"' in pre
        and '"add_prefix_space": true' not in pre
        and not any(kind in pre for kind in ('"Whitespace', '"BertPreTokenizer"',
                                             '"CharDelimiterSplit"', '"Metaspace"'))
    )


#: A space between two word characters other than digits and "_" (the literal first, so
#: the scan jumps from space to space in C): every space between two letters
#: (`str.isalpha`) is one; `chunks` checks each candidate with `isalpha`.
_CUT_CANDIDATE: Final = re.compile(r" (?=[^\W\d_])(?<=[^\W\d_] )")


def chunks(piece: str, size: int = CHUNK_CHARS) -> list[str]:
    """`piece` cut at spaces between two letters, about every `size` characters from its
    start (a piece shorter than 2 x `size` stays whole): each cut is the first such space
    `size` or more characters after the one before (or the start)."""
    end = len(piece)
    if end < 2 * size:
        return [piece]
    out: list[str] = []
    start = 0
    while end - start >= 2 * size:
        found = _CUT_CANDIDATE.search(piece, start + size, end)
        while found is not None and not (piece[found.start() - 1].isalpha()
                                         and piece[found.start() + 1].isalpha()):
            found = _CUT_CANDIDATE.search(piece, found.end(), end)
        if found is None:
            break  # no cut left: the rest stays whole
        cut = found.start()
        out.append(piece[start:cut])
        start = cut
    out.append(piece[start:])
    return out


class AddedTokenSplitter:
    """`re.split` of a text by its added tokens, longest first, kept at odd positions.

    The regex of all added tokens reads the text a character at a time and, at every
    character a token could start with, tries the tokens in turn: 37 µs for a 6 KB chat
    with DeepSeek's 1,283 added tokens, 4.9 ms for 6 KB of HTML (752 `<`, each trying
    every token that starts with `<`). Here `str.find` jumps from one first character of a
    token to the next (DeepSeek's start with `<` or the full-width bar, U+FF5C), and there
    only the lengths of the tokens that begin with the text's next two characters are
    tried (none for `<span`), longest first as the regex tries them, each slice looked up
    in a set. Where such characters are dense (`DENSE_MISSES` places in a row without a
    token: markup, code), a regex of the tokens' first two characters finds the places
    instead, in C, for the rest of the text. 8 µs and 0.3 ms for those two texts.
    """

    DENSE_MISSES: Final = 16

    __slots__ = ("_by_prefix", "_firsts", "_places", "_tokens")

    def __init__(self, added: Sequence[str]) -> None:
        longest_first = sorted((token for token in added if token), key=len, reverse=True)
        self._tokens = frozenset(longest_first)
        lengths: dict[str, dict[int, None]] = {}  # first two characters -> lengths, longest first
        for token in longest_first:
            lengths.setdefault(token[:2], {})[len(token)] = None
        self._by_prefix = {prefix: tuple(found) for prefix, found in lengths.items()}
        self._firsts = sorted({token[0] for token in longest_first})
        prefixes = sorted(self._by_prefix, key=len, reverse=True)  # two characters first
        self._places = re.compile("|".join(map(re.escape, prefixes)))

    def split(self, text: str) -> list[str]:
        out: list[str] = []
        firsts, find = self._firsts, text.find
        ahead = [find(first) for first in firsts]  # each first character's next place
        start = resume = misses = 0
        while misses < self.DENSE_MISSES:
            places = [place for place in ahead if place >= 0]
            if not places:
                out.append(text[start:])
                return out
            place = min(places)
            end = self._take(text, place, start, out)
            if end >= 0:
                start = resume = end
                misses = 0
            else:
                resume = place + 1
                misses += 1
            for i, found in enumerate(ahead):
                if 0 <= found < resume:
                    ahead[i] = find(firsts[i], resume)
        search = self._places.search
        found_place = search(text, resume)
        while found_place is not None:
            place = found_place.start()
            end = self._take(text, place, start, out)
            if end >= 0:
                start = resume = end
            else:
                resume = place + 1
            found_place = search(text, resume)
        out.append(text[start:])
        return out

    def _take(self, text: str, place: int, start: int, out: list[str]) -> int:
        """The end of the longest added token that starts at `place` (appended to `out`
        after the text since `start`), or -1 when none does."""
        by_prefix = self._by_prefix
        # tokens of two characters or more, then one-character tokens: longest first
        for length in by_prefix.get(text[place : place + 2], ()) + by_prefix.get(text[place], ()):
            token = text[place : place + length]
            if token in self._tokens:
                out += (text[start:place], token)
                return place + len(token)
        return -1


class ModelTokenizer:
    """One model's tokenizer + chat template. Thread-safe; one per model, shared."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: TokenizerConfig,
        *,
        name: str = "",
        chat_template: str | None = None,
        piecewise: bool = False,
        chunked: bool = False,
    ) -> None:
        self.name = name
        self.config = config
        self._backend = backend
        self._override = None if chat_template is None else ChatTemplate(chat_template)
        self._templates: OrderedDict[str, ChatTemplate] = OrderedDict()
        self._templates_lock = threading.Lock()
        self._fix_special_tokens()
        added = [t.content for t in backend.get_added_tokens_decoder().values()]
        added.sort(key=len, reverse=True)
        self._added_ids: dict[str, int] = {
            text: found for text in added if (found := _id_of(backend, text)) is not None
        }
        self._splitter = AddedTokenSplitter(added) if added else None
        self.piecewise = piecewise
        self.chunked = piecewise and chunked
        self._max_token_id: int | None = None
        self._pieces = _LRU(PIECE_MEMO_ENTRIES, PIECE_MEMO_TOKENS)
        self._texts = _LRU(TEXT_MEMO_ENTRIES, PIECE_MEMO_TOKENS)

    # -- loading ------------------------------------------------------------------------------

    @classmethod
    def from_dir(
        cls, directory: Path, *, chat_template_file: Path | None = None, name: str = ""
    ) -> ModelTokenizer:
        """Load `directory`'s tokenizer.json + tokenizer_config.json (+ a template file)."""
        file = directory / "tokenizer.json"
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
            spec = _spec_of(backend)
        except (OSError, ValueError, Exception) as exc:  # tokenizers raises Exception
            raise TokenizerLoadError(f"{file}: {exc}") from exc
        try:
            config = TokenizerConfig.from_dir(directory)
        except TokenizerConfigError as exc:
            raise TokenizerLoadError(str(exc)) from exc
        template = _read_template(chat_template_file)
        try:
            return cls(
                backend, config, name=name or str(directory), chat_template=template,
                piecewise=_piecewise(spec), chunked=_chunkable(spec),
            )
        except ChatTemplateError as exc:
            raise TokenizerLoadError(str(exc)) from exc

    def with_chat_template(self, chat_template_file: Path | None) -> ModelTokenizer:
        """The same vocabulary (shared, not reloaded: loading one holds the GIL for
        seconds) with another `--chat-template` file (None: the tokenizer's own)."""
        template = _read_template(chat_template_file)
        try:
            return ModelTokenizer(
                self._backend, self.config, name=self.name, chat_template=template,
                piecewise=self.piecewise, chunked=self.chunked,
            )
        except ChatTemplateError as exc:
            raise TokenizerLoadError(str(exc)) from exc

    @classmethod
    def load(
        cls,
        spec: str,
        *,
        revision: str | None = None,
        chat_template_file: str | Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ModelTokenizer:
        """Resolve `spec` offline (`source.resolve_tokenizer_dir`) and load it.

        Raises `TokenizerNotFound` or `TokenizerLoadError` (both name the spec).
        """
        directory = resolve_tokenizer_dir(spec, revision, env)
        template = None if chat_template_file is None else Path(chat_template_file)
        return cls.from_dir(directory, chat_template_file=template, name=spec)

    def _fix_special_tokens(self) -> None:
        backend, config = self._backend, self.config
        missing = [
            tokenizers.AddedToken(text, special=True, normalized=False)
            for text in config.special_tokens.values()
            if backend.token_to_id(text) is None
        ]
        if missing:
            backend.add_special_tokens(missing)

    # -- plain encode/decode --------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def max_token_id(self) -> int:
        """The largest id in the vocabulary, added tokens included (vLLM's
        `tokenizer.max_token_id`: ids need not be contiguous)."""
        if self._max_token_id is None:
            self._max_token_id = max(self._backend.get_vocab(with_added_tokens=True).values())
        return self._max_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        """Token ids of `text` (whole-text memo)."""
        key = (add_special_tokens, text)
        hit = self._texts.get(key)
        if hit is not None:
            return tuple(hit)
        ids = tuple(self._encode([text], add_special_tokens)[0])
        self._texts.put(key, ids, len(text))
        return ids

    def _encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """Token ids of each text, by `encode_batch_fast`: the ids `encode` gives, without
        the character offsets nobody here reads (about a fifth less CPU a chunk)."""
        encoded = self._backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        return [enc.ids for enc in encoded]

    def encode_chat_text(self, text: str) -> tuple[int, ...]:
        """Token ids of rendered chat text, no special tokens added (piece memo)."""
        pieces = self._chat_pieces(text)
        if pieces is None:
            return self.encode(text, add_special_tokens=False)
        out: list[Sequence[int] | None] = []
        misses: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:  # an added token (or an empty separator between chunks)
                out.append((self._added_ids[piece],) if piece else ())
                continue
            if not piece:
                out.append(())
                continue
            hit = self._pieces.get(piece) if len(piece) >= PIECE_MEMO_MIN_CHARS else None
            out.append(hit)
            if hit is None:
                misses.append(i)
        if misses:
            encoded = self._encode([pieces[i] for i in misses], False)
            for i, fresh in zip(misses, encoded, strict=True):
                out[i] = fresh
                if len(pieces[i]) >= PIECE_MEMO_MIN_CHARS:
                    self._pieces.put(pieces[i], fresh, len(pieces[i]))
        result: list[int] = []
        for piece_ids in out:
            if piece_ids:
                result.extend(piece_ids)
        return tuple(result)

    def _chat_pieces(self, text: str) -> list[str] | None:
        """`text` cut at added tokens (at odd positions; "" between the chunks of a long
        piece), or None when this tokenizer must encode whole texts (module docstring)."""
        if not self.piecewise or self._splitter is None:
            return None
        pieces = self._splitter.split(text)
        if not self.chunked:
            return pieces
        cut: list[str] = []
        for i, piece in enumerate(pieces):
            if i % 2 or len(piece) < 2 * CHUNK_CHARS:
                cut.append(piece)
            else:  # keep added tokens at odd positions: empty separators between chunks
                for j, chunk in enumerate(chunks(piece)):
                    if j:
                        cut.append("")
                    cut.append(chunk)
        return cut

    def _piece_ids(self, index: int, piece: str) -> Sequence[int]:
        """Ids of `_chat_pieces(...)[index]`: an added token's id, or the piece encoded
        (memoized)."""
        if index % 2:
            return (self._added_ids[piece],) if piece else ()
        if not piece:
            return ()
        memoize = len(piece) >= PIECE_MEMO_MIN_CHARS
        hit = self._pieces.get(piece) if memoize else None
        if hit is not None:
            return hit
        fresh = self._encode([piece], False)[0]
        if memoize:
            self._pieces.put(piece, fresh, len(piece))
        return fresh

    def vocab(self) -> dict[str, int]:
        """Token string -> id, added tokens included."""
        return dict(self._backend.get_vocab(with_added_tokens=True))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id's token string (transformers' `convert_ids_to_tokens`)."""
        backend = self._backend
        return [backend.id_to_token(i) or "" for i in ids]

    # -- chat -----------------------------------------------------------------------------------

    def template(self, tools: Any = None, request_template: str | None = None) -> ChatTemplate:
        """The template vLLM would use: the request's, else `--chat-template`, else the
        tokenizer's (`tool_use` when tools are given and it exists)."""
        if request_template is not None:
            return self._compiled(request_template)
        if self._override is not None:
            return self._override
        try:
            source = self.config.template_source(tools)
        except TokenizerConfigError as exc:
            raise ChatInputError(str(exc)) from exc
        if source is None:
            raise ChatInputError(
                "the tokenizer has no chat template and none was configured "
                "(--chat-template / pdgate.io/chat-template)"
            )
        return self._compiled(source)

    def _compiled(self, source: str) -> ChatTemplate:
        with self._templates_lock:
            found = self._templates.get(source)
            if found is not None:
                self._templates.move_to_end(source)
                return found
        try:
            compiled = ChatTemplate(source)
        except ChatTemplateError as exc:
            raise ChatInputError(str(exc)) from exc
        with self._templates_lock:
            self._templates[source] = compiled
            while len(self._templates) > TEMPLATE_CACHE_ENTRIES:
                self._templates.popitem(last=False)
        return compiled

    def render_chat(
        self,
        messages: Sequence[Any],
        *,
        tools: Any = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        documents: Any = None,
        chat_template: str | None = None,
    ) -> str:
        """The prompt text vLLM renders for these messages (raises `ChatInputError`)."""
        if not isinstance(messages, list) or not messages:
            raise ChatInputError("'messages' must be a non-empty list")
        schemas = tool_schemas(tools)
        template = self.template(schemas, chat_template)
        kwargs = dict(chat_template_kwargs or {})
        if {"chat_template", "tokenize"} & kwargs.keys():
            raise ChatInputError(
                "Found unexpected chat template kwargs from request: "
                f"{sorted({'chat_template', 'tokenize'} & kwargs.keys())}"
            )
        kwargs.pop("add_generation_prompt", None)
        kwargs.pop("continue_final_message", None)
        for name in ("messages", "tools", "documents"):
            kwargs.pop(name, None)
        chat = conversation(messages, template.content_format)
        try:
            return template.render(
                chat,
                tools=schemas,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                special_tokens=self.config.special_tokens,
                extra=kwargs,
            )
        except ChatTemplateError as exc:
            raise ChatInputError(str(exc)) from exc

    def chat_ids(
        self, body: Mapping[str, Any], *, allow_request_template: bool = False
    ) -> tuple[int, ...]:
        """Token ids of a chat request body (`messages`, `tools`, `add_generation_prompt`,
        `continue_final_message`, `chat_template_kwargs`, `documents`,
        `add_special_tokens`), as vLLM's chat and `/tokenize` compute them."""
        text = self._render_request(body, allow_request_template)
        if _flag(body, "add_special_tokens", False):
            return self.encode(text, add_special_tokens=True)
        return self.encode_chat_text(text)

    def _render_request(self, body: Mapping[str, Any], allow_request_template: bool) -> str:
        request_template = body.get("chat_template")
        if request_template is not None and not allow_request_template:
            raise ChatInputError(
                "a chat_template in the request is not trusted "
                "(vLLM: --trust-request-chat-template)"
            )
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise ChatInputError("'chat_template_kwargs' must be an object")
        merged = dict(kwargs or {})
        add_generation_prompt = _flag(body, "add_generation_prompt", True)
        continue_final = _flag(body, "continue_final_message", False)
        if add_generation_prompt and continue_final:
            raise ChatInputError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        return self.render_chat(
            body.get("messages"),  # type: ignore[arg-type]
            tools=body.get("tools"),
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final,
            chat_template_kwargs=merged,
            documents=body.get("documents"),
            chat_template=request_template if isinstance(request_template, str) else None,
        )

    # -- completions ----------------------------------------------------------------------------

    def completion_ids(
        self, prompt: Any, add_special_tokens: bool = True
    ) -> list[tuple[int, ...]]:
        """Token ids of each prompt of a completions `prompt` (a string, token ids, or a
        batch of either)."""
        if isinstance(prompt, str):
            return [self.encode(prompt, add_special_tokens)]
        if isinstance(prompt, list) and prompt:
            if all(_is_token(t) for t in prompt):
                return [tuple(prompt)]
            out: list[tuple[int, ...]] = []
            for item in prompt:
                if isinstance(item, str):
                    out.append(self.encode(item, add_special_tokens))
                elif isinstance(item, list) and item and all(_is_token(t) for t in item):
                    out.append(tuple(item))
                else:
                    raise ChatInputError(
                        "'prompt' must be a string, token ids, or a list of either"
                    )
            return out
        raise ChatInputError("'prompt' must be a non-empty string, token ids, or a list of either")

    def request_ids(self, endpoint: Endpoint, body: Mapping[str, Any]) -> list[tuple[int, ...]]:
        """Token ids of each prompt of a chat or completions request body."""
        if endpoint == "chat":
            return [self.chat_ids(body)]
        return self.completion_ids(body.get("prompt"), _flag(body, "add_special_tokens", True))

    def id_stream(self, endpoint: Endpoint, body: Mapping[str, Any]) -> IdStream:
        """The first prompt's token ids, encoded only as far as they are read: a chat
        prompt piece by piece where that is exact (module docstring), anything else whole.
        Raises what `request_ids` raises (`ChatInputError`), at once."""
        if endpoint == "chat" and not _flag(body, "add_special_tokens", False):
            text = self._render_request(body, False)
            pieces = self._chat_pieces(text)
            if pieces is not None:
                return IdStream(self, pieces, len(text))
            return IdStream.whole(self.encode(text, add_special_tokens=False))
        prompts = self.request_ids(endpoint, body)
        return IdStream.whole(prompts[0] if prompts else ())

    @property
    def memo_stats(self) -> dict[str, int]:
        p, t = self._pieces, self._texts
        return {
            "piece_entries": len(p), "piece_hits": p.hits, "piece_misses": p.misses,
            "text_entries": len(t), "text_hits": t.hits, "text_misses": t.misses,
            "piece_chars": p.chars, "text_chars": t.chars,
        }


class IdStream:
    """A prompt's token ids in order, one piece at a time, each encoded when it is reached
    (`ModelTokenizer.id_stream`): whoever stops reading early never pays for the rest.
    `chars` is the rendered prompt's length and `chars_read` how much of it has been
    encoded, so `estimate(tokens_read)` can size the remainder at the rate seen so far."""

    __slots__ = ("_ids", "_pieces", "_tokenizer", "chars", "chars_read")

    def __init__(
        self,
        tokenizer: ModelTokenizer | None,
        pieces: list[str],
        chars: int,
        ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._pieces = pieces
        self._ids = ids
        self.chars = chars
        self.chars_read = 0

    @classmethod
    def whole(cls, ids: Sequence[int]) -> IdStream:
        """A stream of ids already computed (nothing left to estimate)."""
        return cls(None, [], 0, ids)

    def __iter__(self) -> Iterator[Sequence[int]]:
        tokenizer = self._tokenizer
        if tokenizer is None:
            if self._ids:
                yield self._ids
            return
        for index, piece in enumerate(self._pieces):
            ids = tokenizer._piece_ids(index, piece)
            self.chars_read += len(piece)
            if ids:
                yield ids

    def estimate(self, tokens_read: int) -> int:
        """The prompt's token count: `tokens_read` plus the unread characters at the
        characters-per-token rate of what was read."""
        left = self.chars - self.chars_read
        if left <= 0 or tokens_read <= 0 or self.chars_read <= 0:
            return tokens_read + max(0, left) // 4  # nothing read yet: ~4 characters a token
        return tokens_read + round(left * tokens_read / self.chars_read)


def _id_of(backend: tokenizers.Tokenizer, token: str | None) -> int | None:
    if token is None:
        return None
    found = backend.token_to_id(token)
    return None if found is None else int(found)


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ChatInputError(f"'{name}' must be a boolean")
    return value


def _read_template(chat_template_file: Path | None) -> str | None:
    """A `--chat-template` file's text (None: none given, use the tokenizer's own)."""
    if chat_template_file is None:
        return None
    try:
        return chat_template_file.read_text(encoding="utf-8")
    except OSError as exc:
        raise TokenizerLoadError(f"chat template {chat_template_file}: {exc}") from exc
