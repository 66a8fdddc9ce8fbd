"""When the precise prefix-cache scorer cannot trust its tokens, per ModelServer.

The precise index matches only on the engine's own token ids. For a ModelServer whose
tokens are not known to be the engine's, `precise-prefix-cache` scores with the
approximate `prefix-cache` index instead (and teaches it its decisions), so the server
keeps cache-aware routing instead of silently scoring every pod 0. Reasons (`REASONS`):

- `no-tokenizer`: the server names no tokenizer (`pdgate.io/tokenizer`);
- `tokenizer-error`: its tokenizer could not be loaded (the registry logged why);
- `tokenizer-loading`: its tokenizer is still being loaded (seconds at start-up);
- `parity-mismatch`: the engine's `/tokenize` disagrees with the router
  (`router.tokenization.parity`).

An injected token source (`build_scheduler(tokenize=...)`) is trusted: no fallback.
Parity `unknown` (an engine without `/tokenize`) is not a reason: it is logged, not
guessed at. `reason(server)` is a few dict lookups, asked once per scoring.

Visible in `/metrics` as `pdgate_precise_fallback{namespace,server,reason}`: while the
precise index is enabled, one sample per ModelServer of the view and reason, 1 for the
reason in force (at most one), 0 for the others; `sum by (server)` > 0 means the server
is on the approximate index. A server without a tokenizer is also logged as an error
once (per server, again after it was fixed and broke again).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Final

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from router.resources import ModelServer
from router.tokenization import TOKENIZER_ANNOTATION, TokenizerRegistry
from router.tokenization.parity import ParityProber
from router.view import Snapshot

log = logging.getLogger("pdgate.scheduling")

REASONS: Final = ("no-tokenizer", "tokenizer-error", "tokenizer-loading", "parity-mismatch")
_BY_STATE: Final = {
    "none": "no-tokenizer", "failed": "tokenizer-error", "loading": "tokenizer-loading",
}  # fmt: skip


class PreciseFallback:
    """Per-ModelServer "use the approximate index instead" (see the module docstring)."""

    def __init__(
        self,
        tokenizers: TokenizerRegistry,
        parity: ParityProber,
        registry: CollectorRegistry | None = None,
        *,
        injected: bool = False,
        enabled: Callable[[], bool] = lambda: True,
    ) -> None:
        self._tokenizers = tokenizers
        self._parity = parity
        self._injected = injected
        self._enabled = enabled
        self._snapshot = Snapshot()
        self._logged: set[tuple[str, str]] = set()
        if registry is not None:
            registry.register(_FallbackCollector(self))

    def reason(self, server: ModelServer) -> str | None:
        """Why `server` is scored with the approximate index, or None (precise)."""
        if self._injected:
            return None
        state = self._tokenizers.state(server)
        if state != "loaded":
            return _BY_STATE[state]
        if self._parity.mismatched(server.meta.key):
            return "parity-mismatch"
        return None

    def on_snapshot(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot
        self.check()

    def check(self) -> None:
        """Log (once) every server that asks for precise scoring without a tokenizer."""
        servers = self._snapshot.servers
        self._logged &= set(servers)
        if self._injected or not self._enabled():
            return
        for key, pods in servers.items():
            if self._tokenizers.state(pods.server) != "none":
                self._logged.discard(key)
                continue
            if key in self._logged:
                continue
            self._logged.add(key)
            log.error(
                "ModelServer %s/%s: the scheduler uses precise-prefix-cache scoring but the "
                "server names no tokenizer (annotation %s); its requests are scored with "
                "the approximate prefix-cache index", key[0], key[1], TOKENIZER_ANNOTATION,
            )

    def samples(self) -> Iterator[tuple[tuple[str, str], str, float]]:
        if not self._enabled():
            return
        for key, pods in self._snapshot.servers.items():
            current = self.reason(pods.server)
            for reason in REASONS:
                yield key, reason, 1.0 if reason == current else 0.0


class _FallbackCollector(Collector):
    def __init__(self, fallback: PreciseFallback) -> None:
        self._fallback = fallback

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "pdgate_precise_fallback",
            "1 when the precise-prefix-cache scorer uses the approximate index for a "
            "ModelServer, by reason (no-tokenizer, tokenizer-error, tokenizer-loading, "
            "parity-mismatch); present while the precise index is enabled.",
            labels=["namespace", "server", "reason"],
        )
        for key, reason, value in self._fallback.samples():
            family.add_metric([key[0], key[1], reason], value)
        yield family

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())
