"""Prompt -> block hashes: what the two prefix indexes key on.

Two hashes of one request's prompt, both computed at most once per request (see
`PromptInfo` in `context.py`) and only when a configured scorer needs them.

Approximate (`approximate_block_hashes`), for the `prefix-cache` scorer
-----------------------------------------------------------------------
The router never sees the engine's cache, so any deterministic function of the prompt
works as long as equal prefixes give equal leading hashes. The prompt is rendered to
bytes (`render_prompt_bytes`, below), cut into fixed-size blocks of `block_bytes` bytes
(only full blocks count, like an engine's cache), and chained with xxh3-64:

    seed_0 = xxh3_64(model utf-8 + b"\\0" + cache_salt utf-8)        (salt "" when absent)
    h_0    = xxh3_64(block_0, seed=seed_0)
    h_i    = xxh3_64(block_i, seed=h_{i-1})

so the model name and the `cache_salt` are mixed into the first block (two tenants or two
models never share a chain) and h_i identifies the whole prefix up to block i.

Rendering (`render_prompt_bytes`) is a canonical text form, not the engine's chat
template: chat `tools` (sorted JSON) first, then per message `"<|" role "|>\\n"`, its
content (a string; text parts' text; any other part as sorted JSON, so two images
differ), the sorted JSON of `name`/`tool_calls`/`tool_call_id` when present, and `"\\n"`.
Completions: a string prompt's UTF-8; token ids packed as 4-byte unsigned ints; of a
batch (a list of prompts) the first.

Precise (`PreciseHasher`), for the `precise-prefix-cache` scorer
-----------------------------------------------------------------
These must equal the keys the precise index holds for the engine's blocks, so the token
ids must be the engine's own:

- token ids: the ModelServer's own tokenizer and chat template
  (`router.tokenization`, configured by the `pdgate.io/tokenizer` annotations): chat
  rendered and encoded as vLLM does, completions `prompt` as given (a string, token ids,
  or the first of a batch); no tokenizer, no precise hashes (the scorer sees no blocks);
- block keys: the ModelServer's `router.kvhash.KeySpace`: vLLM's own block hashes
  (`hashes`: the event ints of vLLM's chained digests, with the server's hash algo,
  PYTHONHASHSEED and block size, `cache_salt` in the first block's extra keys) or the
  router's token keys (`tokens`), see `router.kvhash.keyspace`. The model name is NOT
  part of either (as in vLLM).

Two exact shortcuts keep the per-request cost down, and unit tests check both against
the reference functions:
- the tokenizer memoizes the pieces between added tokens where that is exact for the
  tokenizer (`router.tokenization.tokenizer`), so a shared system prompt is encoded once;
- the keys of a prefix's blocks are memoized under an xxh3-64 of (key space, salt, the
  prefix's token ids), at a few checkpoints (`PreciseHasher`), with the chain state after
  the prefix (vLLM's full digest in `hashes` mode), so only the blocks past the longest
  memoized prefix are hashed.

And one that skips work rather than repeating it (`PreciseHasher.leading_hashes`): a pod's
match is its run of leading blocks, so once a block is held by no pod and no pool, no
later block can change any score. The prompt is encoded piece by piece
(`ModelTokenizer.id_stream`) and hashed block by block up to that block; the rest is never
encoded, and its tokens are estimated at the rate of what was. On long prompts that share
little (Mooncake's traces: ~3.5k-token prompts, best possible hit under 20%) that skips
most of the encoding, which is almost all of the precise index's cost.
"""

from __future__ import annotations

import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson
import xxhash

from router.kvhash.keyspace import ChainState, KeySpace
from router.resources import ModelServer
from router.tokenization import ChatInputError, Endpoint, TokenizerRegistry
from router.tokenization.tokenizer import IdStream, ModelTokenizer

CHAT_PATH: Final = "/v1/chat/completions"

#: Default approximate block size, in bytes of rendered prompt (about 64 tokens, 4 engine blocks).
DEFAULT_APPROX_BLOCK_BYTES: Final = 256
#: Default bound on the blocks of one prompt that are hashed and looked up.
DEFAULT_MAX_PROMPT_BLOCKS: Final = 4096
#: Bounds of the approximate hasher's memo of leading messages: entries, hashes in all.
APPROX_HASH_MEMO_ENTRIES: Final = 4_096
APPROX_HASH_MEMO_HASHES: Final = 1_000_000
#: Leading blocks worth memoizing (fewer are hashed faster than looked up).
APPROX_MEMO_MIN_BLOCKS: Final = 4
#: Bounds of the precise hasher's prefix memo: entries, and block hashes stored in all.
PRECISE_HASH_MEMO_ENTRIES: Final = 8_192
PRECISE_HASH_MEMO_HASHES: Final = 2_000_000

_xxh3 = xxhash.xxh3_64_intdigest
_SORTED = orjson.OPT_SORT_KEYS
_MESSAGE_EXTRAS: Final = ("name", "tool_calls", "tool_call_id")
#: The rendered header of the usual roles, prebuilt (any other role is built per message).
_ROLE_HEADERS: Final = {
    role: b"<|" + role.encode() + b"|>\n" for role in ("system", "user", "assistant", "tool")
}


def _json(value: Any) -> bytes:
    try:
        return orjson.dumps(value, option=_SORTED)
    except TypeError:
        return repr(value).encode()


def _token_bytes(tokens: Sequence[Any]) -> bytes:
    try:
        return array.array("I", tokens).tobytes()
    except (TypeError, OverflowError):
        return _json(list(tokens))


def _render_chat_bytes(messages: Sequence[Any], tools: Any) -> tuple[bytes, int]:
    """The rendered messages, and the length of the part before the last message."""
    out: list[bytes] = []
    if tools is not None:
        out.append(_json(tools))
    lead = 0
    last = len(messages) - 1
    for i, message in enumerate(messages):
        if i == last:
            lead = sum(map(len, out))
        if type(message) is not dict and not isinstance(message, Mapping):  # dict: no ABC check
            out.append(_json(message))
            continue
        role = message.get("role", "")
        header = _ROLE_HEADERS.get(role) if type(role) is str else None
        out.append(header or b"<|" + str(role).encode() + b"|>\n")
        content = message.get("content")
        if isinstance(content, str):
            out.append(content.encode())
        elif isinstance(content, list):
            for part in content:
                if (type(part) is dict or isinstance(part, Mapping)) and part.get("type") == "text":
                    out.append(str(part.get("text", "")).encode())
                else:
                    out.append(_json(part))
        elif content is not None:
            out.append(_json(content))
        for extra in _MESSAGE_EXTRAS:
            if extra in message:
                out.append(_json({extra: message[extra]}))
        out.append(b"\n")
    return b"".join(out), lead


def render_prompt(path: str, body: Mapping[str, Any]) -> tuple[bytes, int] | None:
    """The canonical bytes of a request's prompt for approximate hashing, and how many
    of them come before its last chat message (0 for a completion); None: no prompt."""
    messages = body.get("messages")
    if path == CHAT_PATH or isinstance(messages, list):
        if not isinstance(messages, list):
            return None
        return _render_chat_bytes(messages, body.get("tools"))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch: key on its first prompt
    if isinstance(prompt, str):
        return prompt.encode(), 0
    if isinstance(prompt, list):
        return _token_bytes(prompt), 0
    return None


def render_prompt_bytes(path: str, body: Mapping[str, Any]) -> bytes | None:
    """The canonical bytes of a request's prompt for approximate hashing, or None."""
    rendered = render_prompt(path, body)
    return None if rendered is None else rendered[0]


def salt_of(body: Mapping[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    return salt if isinstance(salt, str) and salt else None


def approximate_block_hashes(
    data: bytes,
    model: str,
    cache_salt: str | None,
    block_bytes: int = DEFAULT_APPROX_BLOCK_BYTES,
    max_blocks: int = DEFAULT_MAX_PROMPT_BLOCKS,
) -> list[int]:
    """Chained xxh3-64 hashes of the full `block_bytes` blocks of `data` (module docstring)."""
    count = min(len(data) // block_bytes, max_blocks)
    if count <= 0:
        return []
    seed = _xxh3(model.encode() + b"\0" + (cache_salt or "").encode())
    view = memoryview(data)
    hashes = [0] * count
    start = 0
    for i in range(count):
        seed = _xxh3(view[start : start + block_bytes], seed)
        hashes[i] = seed
        start += block_bytes
    return hashes


class ApproximateHasher:
    """`approximate_block_hashes` with a memo of the blocks of a chat's leading messages.

    The messages before the last one (a shared system prompt, a conversation's earlier
    turns) repeat from request to request. The hashes of their full blocks are memoized
    under one xxh3-64 of those bytes (seeded with the chain's seed), so a request costs
    one hash over its leading messages plus one per block of its last message, instead
    of one per block. Exact: the result is `approximate_block_hashes`'s (unit test).
    Bounded by `APPROX_HASH_MEMO_ENTRIES` entries and `APPROX_HASH_MEMO_HASHES` stored
    hashes, least recently used first out. One per scheduler (`SchedulerDeps`).
    """

    def __init__(
        self,
        entries: int = APPROX_HASH_MEMO_ENTRIES,
        max_hashes: int = APPROX_HASH_MEMO_HASHES,
    ) -> None:
        self._memo: OrderedDict[tuple[int, int], tuple[int, ...]] = OrderedDict()
        self._entries = entries
        self._max_hashes = max_hashes
        self._stored = 0

    def hashes(
        self,
        data: bytes,
        lead: int,
        model: str,
        cache_salt: str | None,
        block_bytes: int = DEFAULT_APPROX_BLOCK_BYTES,
        max_blocks: int = DEFAULT_MAX_PROMPT_BLOCKS,
    ) -> list[int]:
        """The chained hashes of `data`'s full blocks; its first `lead` bytes are the
        leading messages (`render_prompt`), memoized."""
        count = min(len(data) // block_bytes, max_blocks)
        known = min(lead // block_bytes, count)
        if known < APPROX_MEMO_MIN_BLOCKS:
            return approximate_block_hashes(data, model, cache_salt, block_bytes, max_blocks)
        seed = _xxh3(model.encode() + b"\0" + (cache_salt or "").encode())
        view = memoryview(data)
        start = known * block_bytes
        key = (_xxh3(view[:start], seed), block_bytes)
        memo = self._memo
        prefix = memo.get(key)
        if prefix is None:
            hashes = approximate_block_hashes(data, model, cache_salt, block_bytes, max_blocks)
            self._remember(key, tuple(hashes[:known]))
            return hashes
        memo.move_to_end(key)
        hashes = [*prefix, *[0] * (count - known)]
        seed = prefix[-1]
        for i in range(known, count):
            seed = _xxh3(view[start : start + block_bytes], seed)
            hashes[i] = seed
            start += block_bytes
        return hashes

    def _remember(self, key: tuple[int, int], hashes: tuple[int, ...]) -> None:
        memo = self._memo
        memo[key] = hashes
        self._stored += len(hashes)
        while memo and (len(memo) > self._entries or self._stored > self._max_hashes):
            _, dropped = memo.popitem(last=False)
            self._stored -= len(dropped)

    def __len__(self) -> int:
        return len(self._memo)


TokenSource = Callable[[str, Mapping[str, Any]], Sequence[int] | None]


@dataclass(frozen=True, slots=True)
class PromptTokens:
    """A prompt's token ids, and where each chat message ends in them (token counts)."""

    ids: Sequence[int]
    message_ends: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class LeadingBlocks:
    """`PreciseHasher.leading_hashes`: the keys found, the prompt's token count (exact when
    `complete`, else estimated for the part never encoded), and whether it read it all."""

    keys: list[int]
    tokens: int
    complete: bool


class PreciseHasher:
    """Engine-exact block keys of a request (see the module docstring for the contract).

    `tokenize` may be injected (path, body -> token ids or None); by default the
    ModelServer's tokenizer from `tokenizers` is used. `space` is the key space used when a
    call names none (a ModelServer without settings of its own). One instance per
    scheduler: it owns its bounded caches, nothing is global.

    Memo: (key space, salt, token ids of a prefix) -> the keys of that prefix's full
    blocks and the chain state after them, stored at checkpoints (the end of the first
    message, of the last two messages, and every power-of-two block count) and probed
    from the longest checkpoint down, so a shared system prompt or a conversation's
    earlier turns cost one xxh3 call over their tokens instead of one hash per block.
    Bounded by `PRECISE_HASH_MEMO_ENTRIES` entries and `PRECISE_HASH_MEMO_HASHES` stored
    keys, oldest entries dropped first.
    """

    def __init__(
        self,
        space: KeySpace | None = None,
        tokenize: TokenSource | None = None,
        memo_entries: int = PRECISE_HASH_MEMO_ENTRIES,
        max_blocks: int = DEFAULT_MAX_PROMPT_BLOCKS,
        memo_hashes: int = PRECISE_HASH_MEMO_HASHES,
        tokenizers: TokenizerRegistry | None = None,
    ) -> None:
        self.space = space if space is not None else KeySpace.of()
        self.max_blocks = max_blocks
        #: prefix hash -> (its blocks' keys as 8-byte items, chain state after them)
        self._memo: OrderedDict[int, tuple[array.array[int], ChainState]] = OrderedDict()
        self._memo_entries = memo_entries
        self._memo_hashes = memo_hashes
        self._memo_stored = 0
        self._injected = tokenize
        self._tokenizers = tokenizers

    @property
    def block_size(self) -> int:
        """The default key space's block size."""
        return self.space.block_size

    def tokens(
        self, path: str, body: Mapping[str, Any], server: ModelServer | None = None
    ) -> PromptTokens | None:
        """The prompt's token ids as the server's engine computes them, or None if unknown
        (no tokenizer configured or loaded for `server`, or a prompt it cannot tokenize)."""
        if self._injected is not None:
            ids = self._injected(path, body)
            return None if ids is None else PromptTokens(ids)
        found = self._tokenizer(path, body, server)
        if found is None:
            return None
        tokenizer, endpoint = found
        try:
            prompts = tokenizer.request_ids(endpoint, body)
        except ChatInputError:
            return None
        return PromptTokens(prompts[0]) if prompts else None

    def id_stream(
        self, path: str, body: Mapping[str, Any], server: ModelServer | None = None
    ) -> IdStream | None:
        """`tokens`, encoded only as far as it is read (None where `tokens` is None)."""
        if self._injected is not None:
            ids = self._injected(path, body)
            return None if ids is None else IdStream.whole(ids)
        found = self._tokenizer(path, body, server)
        if found is None:
            return None
        tokenizer, endpoint = found
        try:
            return tokenizer.id_stream(endpoint, body)
        except ChatInputError:
            return None

    def _tokenizer(
        self, path: str, body: Mapping[str, Any], server: ModelServer | None
    ) -> tuple[ModelTokenizer, Endpoint] | None:
        """`server`'s loaded tokenizer and the request's endpoint kind, or None."""
        if server is None or self._tokenizers is None:
            return None
        tokenizer = self._tokenizers.get(server)
        if tokenizer is None:
            return None
        chat = path == CHAT_PATH or isinstance(body.get("messages"), list)
        return tokenizer, "chat" if chat else "completion"

    def leading_hashes(
        self,
        stream: IdStream,
        cache_salt: str | None,
        space: KeySpace,
        known: Callable[[int], bool],
        lora_name: str | None = None,
    ) -> LeadingBlocks:
        """Keys of the prompt's leading full blocks up to, not including, the first one
        `known` says nobody holds (the module docstring): exact for every pod's leading
        match, reading `stream` no further than that block."""
        size = space.block_size
        tokens: list[int] = []
        keys: list[int] = []
        state: ChainState = space.root
        done = 0
        for ids in stream:
            tokens.extend(ids)
            blocks = min(len(tokens) // size, self.max_blocks)
            if blocks <= done:
                continue
            more, state = space.extend(
                tokens, done, blocks, state, cache_salt=cache_salt, lora_name=lora_name
            )
            for key in more:
                if not known(key):
                    return LeadingBlocks(keys, stream.estimate(len(tokens)), False)
                keys.append(key)
            done = blocks
            if done >= self.max_blocks:
                return LeadingBlocks(keys, stream.estimate(len(tokens)), False)
        return LeadingBlocks(keys, len(tokens), True)

    def block_hashes(
        self,
        tokens: Sequence[int],
        cache_salt: str | None,
        message_ends: Sequence[int] = (),
        space: KeySpace | None = None,
        lora_name: str | None = None,
    ) -> list[int]:
        """Index keys of every full block of `tokens` in `space` (memoized; exact)."""
        space = space or self.space
        size = space.block_size
        count = min(len(tokens) // size, self.max_blocks)
        if count <= 0:
            return []
        limit = count * size
        try:
            packed = array.array("I", tokens[:limit]).tobytes()
        except (TypeError, OverflowError):
            return space.chain(tokens[:limit], cache_salt=cache_salt, lora_name=lora_name)
        salt = (cache_salt or "").encode() + b"\0" + (lora_name or "").encode()
        seed = _xxh3(salt, space.ident)
        checkpoints = self._checkpoints(count, size, limit, message_ends)
        memo = self._memo
        view = memoryview(packed)
        keys: list[tuple[int, int]] = []
        known: Sequence[int] = ()
        state: ChainState = space.root
        for point in checkpoints:  # longest first
            key = _xxh3(view[: point * 4], seed)
            hit = memo.get(key)
            if hit is not None:
                known, state = hit
                break
            keys.append((point, key))
        hashes = list(known)
        done = len(known)
        for point, key in reversed(keys):  # shortest first: one pass, states on the way
            blocks = point // size
            if blocks > done:
                more, state = space.extend(
                    tokens, done, blocks, state, cache_salt=cache_salt, lora_name=lora_name
                )
                hashes += more
                done = blocks
            self._remember(key, hashes[:blocks], state)
        if count > done:
            more, _ = space.extend(
                tokens, done, count, state, cache_salt=cache_salt, lora_name=lora_name
            )
            hashes += more
        return hashes

    @staticmethod
    def _checkpoints(
        count: int, size: int, limit: int, message_ends: Sequence[int]
    ) -> list[int]:
        """Token counts at which prefixes are memoized, longest first."""
        points = {limit}
        blocks = 1
        while blocks < count:
            points.add(blocks * size)
            blocks *= 2
        if message_ends:
            for end in (message_ends[0], *message_ends[-2:]):
                if size <= end <= limit:
                    points.add(end)
        return sorted(points, reverse=True)

    def _remember(self, key: int, hashes: Sequence[int], state: ChainState) -> None:
        if not hashes or key in self._memo:
            return
        self._memo[key] = (array.array("Q", hashes), state)
        self._memo_stored += len(hashes)
        while self._memo and (
            len(self._memo) > self._memo_entries or self._memo_stored > self._memo_hashes
        ):
            _, (dropped, _) = self._memo.popitem(last=False)
            self._memo_stored -= len(dropped)

    @property
    def memo_size(self) -> int:
        return len(self._memo)


__all__ = [
    "APPROX_HASH_MEMO_ENTRIES",
    "DEFAULT_APPROX_BLOCK_BYTES",
    "DEFAULT_MAX_PROMPT_BLOCKS",
    "PRECISE_HASH_MEMO_ENTRIES",
    "ApproximateHasher",
    "LeadingBlocks",
    "PreciseHasher",
    "PromptTokens",
    "approximate_block_hashes",
    "render_prompt",
    "render_prompt_bytes",
    "salt_of",
]
