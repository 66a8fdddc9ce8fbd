"""Client API keys: who may call the API, read from a file or a mounted Kubernetes Secret.

`path` is either a file with one key per line (blank lines and `#` comments skipped) or a
directory whose every visible file holds keys the same way: a Secret mounted as a volume
(Kubernetes adds `..data` and other dot entries, which are skipped). Several keys may be
valid at once, so keys rotate without downtime; the files are re-read when they change.

A presented key is hashed and compared with every stored hash using
`hmac.compare_digest`, all of them every time, so neither the time taken nor an early exit
tells which key (or how much of one) matched.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter

from router.errors import APIError

log = logging.getLogger("pdgate.api_keys")

#: Bound on the keys kept (a mistaken mount of a huge directory cannot eat memory).
MAX_KEYS = 4096
#: Bound on one key file's size.
MAX_KEY_FILE_BYTES = 1024 * 1024
#: Bound on a presented Authorization header (longer ones are refused unhashed).
MAX_PRESENTED_BYTES = 4096


def unauthorized(message: str) -> APIError:
    return APIError(
        401, message, type="invalid_request_error", code="invalid_api_key",
        headers={"www-authenticate": 'Bearer realm="pdgate"'},
    )


class APIKeys:
    """The valid keys' SHA-256 digests, reloaded when the files change."""

    def __init__(self, path: Path, reload_s: float = 5.0,
                 registry: CollectorRegistry | None = None) -> None:
        self.path = path
        self.reload_s = reload_s
        self._digests: tuple[bytes, ...] = ()
        self._signature: tuple[tuple[str, int, int], ...] | None = None
        self._failures = (
            Counter("pdgate_auth_failures", "Requests refused for a missing or wrong API key.",
                    ["reason"], registry=registry)
            if registry is not None else None
        )
        self.reload()

    @property
    def count(self) -> int:
        return len(self._digests)

    def reload(self) -> bool:
        """Re-read the keys if the files changed; True when the key set was replaced.

        A read that fails keeps the keys already loaded (a Secret being rewritten must not
        lock everyone out); a first read that fails raises.
        """
        try:
            signature = self._stat()
            if signature == self._signature:
                return False
            keys = self._read()
        except OSError as exc:
            if self._signature is None:
                raise
            log.error("cannot re-read API keys from %s (keeping the old ones): %s",
                      self.path, exc)
            return False
        if not keys:
            log.error("no API keys in %s: every request will be refused", self.path)
        self._digests = tuple(hashlib.sha256(key.encode()).digest() for key in keys)
        self._signature = signature
        log.info("loaded %d API key(s) from %s", len(keys), self.path)
        return True

    def _files(self) -> list[Path]:
        if self.path.is_dir():
            return sorted(
                p for p in self.path.iterdir() if not p.name.startswith(".") and p.is_file()
            )
        return [self.path]

    def _stat(self) -> tuple[tuple[str, int, int], ...]:
        out = []
        for file in self._files():
            info = file.stat()  # follows the Secret's symlinks
            out.append((file.name, info.st_mtime_ns, info.st_size))
        return tuple(out)

    def _read(self) -> list[str]:
        keys: list[str] = []
        for file in self._files():
            with file.open("rb") as handle:
                text = handle.read(MAX_KEY_FILE_BYTES).decode("utf-8", errors="replace")
            for line in text.splitlines():
                key = line.strip()
                if key and not key.startswith("#") and len(keys) < MAX_KEYS:
                    keys.append(key)
        return keys

    def check(self, authorization: str | None) -> None:
        """Raise a 401 `APIError` unless `authorization` is `Bearer <a valid key>`."""
        if authorization is None:
            self._fail("missing")
            raise unauthorized(
                "You didn't provide an API key: send it as `Authorization: Bearer <key>`."
            )
        scheme, _, key = authorization.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key or len(key) > MAX_PRESENTED_BYTES:
            self._fail("invalid")
            raise unauthorized("Incorrect API key provided.")
        digest = hashlib.sha256(key.encode("utf-8", errors="surrogateescape")).digest()
        matched = False
        for stored in self._digests:
            matched |= hmac.compare_digest(stored, digest)
        if not matched:
            self._fail("invalid")
            raise unauthorized("Incorrect API key provided.")

    def _fail(self, reason: str) -> None:
        if self._failures is not None:
            self._failures.labels(reason=reason).inc()

    async def run(self) -> None:
        """Poll the files for changes until cancelled."""
        while True:
            await asyncio.sleep(self.reload_s)
            try:
                await asyncio.to_thread(self.reload)
            except Exception:  # keep the keys we have and keep watching
                log.exception("reloading API keys from %s failed", self.path)
