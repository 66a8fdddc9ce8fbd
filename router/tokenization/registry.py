"""Per-ModelServer tokenizers, loaded when the view changes, never on the request path.

A ModelServer names its tokenizer with annotations (README, "Annotations"):

- `pdgate.io/tokenizer`: a local directory, `python:<package>`, or a Hugging Face repo id
  resolved offline from the HF cache (`source.py`);
- `pdgate.io/tokenizer-revision`: the repo id's revision (default `main`);
- `pdgate.io/chat-template`: a Jinja file that replaces the tokenizer's template (vLLM's
  `--chat-template`); a relative path is relative to the router's working directory.

`on_snapshot` (subscribed to the `ClusterView`) loads each new spec on one background
thread when an event loop runs (inline otherwise) and drops tokenizers no server uses.
One thread, one load at a time: parsing a 128k-entry `tokenizer.json` holds the GIL for
a second or more, and two at once starved the event loop for over five seconds on a
2-core machine. Specs that differ only in their chat template share one vocabulary
(`ModelTokenizer.with_chat_template`): loaded once.
At most `MAX_TOKENIZERS` distinct specs are held. A spec that fails to load is logged as
an error once, naming the ModelServer and the reason, and `get` answers None for it (the
precise scorer then falls back to the approximate index for that server,
`router.scheduling.fallback`: no crash, no guess); it is retried when the annotations
change. `state(server)` says which of none / loading / loaded / failed applies.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from router.resources import ModelServer
from router.tokenization.source import TokenizerNotFound
from router.tokenization.tokenizer import ModelTokenizer, TokenizerLoadError
from router.view import Snapshot

log = logging.getLogger("pdgate.tokenization")

TOKENIZER_ANNOTATION: Final = "pdgate.io/tokenizer"
REVISION_ANNOTATION: Final = "pdgate.io/tokenizer-revision"
CHAT_TEMPLATE_ANNOTATION: Final = "pdgate.io/chat-template"
TokenizerState = Literal["none", "loading", "loaded", "failed"]
#: Threads loading tokenizers (one: see the module docstring).
LOADER_THREADS: Final = 1
#: Distinct tokenizers held at once (each holds its vocabulary and memos).
MAX_TOKENIZERS: Final = 16


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """Where one ModelServer's tokenizer comes from."""

    source: str
    revision: str | None = None
    chat_template: str | None = None

    @classmethod
    def of(cls, server: ModelServer) -> TokenizerSpec | None:
        notes = server.meta.annotations
        source = (notes.get(TOKENIZER_ANNOTATION) or "").strip()
        if not source:
            return None
        return cls(
            source,
            (notes.get(REVISION_ANNOTATION) or "").strip() or None,
            (notes.get(CHAT_TEMPLATE_ANNOTATION) or "").strip() or None,
        )


Loader = Callable[[TokenizerSpec], ModelTokenizer]


def load_spec(spec: TokenizerSpec, env: Mapping[str, str] | None = None) -> ModelTokenizer:
    return ModelTokenizer.load(
        spec.source, revision=spec.revision, chat_template_file=spec.chat_template, env=env
    )


class TokenizerRegistry:
    """ModelServer -> its `ModelTokenizer` (see the module docstring)."""

    def __init__(self, loader: Loader = load_spec, max_tokenizers: int = MAX_TOKENIZERS) -> None:
        self._loader = loader
        self._max = max_tokenizers
        self._by_server: dict[tuple[str, str], TokenizerSpec] = {}
        self._loaded: dict[TokenizerSpec, ModelTokenizer] = {}
        self._failed: dict[TokenizerSpec, str] = {}
        self._loading: set[TokenizerSpec] = set()
        self._lock = threading.Lock()
        self._tasks: set[asyncio.Future[None]] = set()
        self._executor = ThreadPoolExecutor(LOADER_THREADS, thread_name_prefix="pdgate-tokenizer")

    def get(self, server: ModelServer) -> ModelTokenizer | None:
        """The server's tokenizer, or None (none configured, still loading, or broken)."""
        spec = self._by_server.get(server.meta.key)
        return None if spec is None else self._loaded.get(spec)

    def state(self, server: ModelServer) -> TokenizerState:
        """Where the server's tokenizer stands: `none` (no annotation), `loading`,
        `loaded` or `failed` (see `error`). A few dict lookups: fine per request."""
        spec = self._by_server.get(server.meta.key)
        if spec is None:
            return "none"
        if spec in self._loaded:
            return "loaded"
        return "failed" if spec in self._failed else "loading"

    def spec(self, server: ModelServer) -> TokenizerSpec | None:
        """The spec the server's annotations name, loaded or not."""
        return self._by_server.get(server.meta.key)

    def error(self, server: ModelServer) -> str | None:
        spec = self._by_server.get(server.meta.key)
        return None if spec is None else self._failed.get(spec)

    def on_snapshot(self, snapshot: Snapshot) -> None:
        wanted: dict[tuple[str, str], TokenizerSpec] = {}
        for key, pods in snapshot.servers.items():
            spec = TokenizerSpec.of(pods.server)
            if spec is not None:
                wanted[key] = spec
        self._by_server = wanted
        specs = set(wanted.values())
        with self._lock:
            for gone in set(self._loaded) - specs:
                del self._loaded[gone]
            for gone in set(self._failed) - specs:
                del self._failed[gone]
            todo = [
                s for s in specs
                if s not in self._loaded and s not in self._failed and s not in self._loading
            ]
        for spec in sorted(todo, key=lambda s: (s.source, s.revision or "", s.chat_template or "")):
            names = [f"{ns}/{name}" for (ns, name), s in wanted.items() if s == spec]
            if len(self._loaded) + len(self._loading) >= self._max:
                self._fail(spec, names, f"more than {self._max} distinct tokenizers configured")
                continue
            self._start(spec, names)

    def _start(self, spec: TokenizerSpec, names: list[str]) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._load(spec, names)
            return
        with self._lock:
            self._loading.add(spec)
        future = loop.run_in_executor(self._executor, self._load, spec, names)
        self._tasks.add(future)
        future.add_done_callback(self._tasks.discard)

    def _load(self, spec: TokenizerSpec, names: list[str]) -> None:
        try:
            sibling = self._sibling(spec) if self._loader is load_spec else None
            tokenizer = (
                self._loader(spec)
                if sibling is None
                else sibling.with_chat_template(
                    None if spec.chat_template is None else Path(spec.chat_template)
                )
            )
        except (TokenizerNotFound, TokenizerLoadError, OSError, ValueError) as exc:
            self._fail(spec, names, str(exc))
        else:
            with self._lock:
                self._loaded[spec] = tokenizer
            log.info("ModelServer %s: tokenizer %s loaded", ", ".join(names), spec.source)
        finally:
            with self._lock:
                self._loading.discard(spec)

    def _sibling(self, spec: TokenizerSpec) -> ModelTokenizer | None:
        """A loaded tokenizer of the same files (another chat template), if any."""
        with self._lock:
            for other, tokenizer in self._loaded.items():
                if (other.source, other.revision) == (spec.source, spec.revision):
                    return tokenizer
        return None

    def _fail(self, spec: TokenizerSpec, names: list[str], reason: str) -> None:
        with self._lock:
            self._failed[spec] = reason
        log.error(
            "ModelServer %s: tokenizer %r unavailable: %s; precise prefix-cache scoring "
            "falls back to the approximate index for it until this is fixed",
            ", ".join(names), spec.source, reason,
        )

    async def wait_loaded(self) -> None:
        """Until every load started so far has finished (tests, start-up)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
