"""The knobs of the security layer, filled from `pdgate serve` flags."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: Defaults of the request limits (see `limits.py`).
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_HEADER_BYTES = 32 * 1024
DEFAULT_MAX_HEADERS = 100


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    #: A file of keys (one a line) or a directory of key files (a mounted Secret); None
    #: leaves the API open.
    api_keys: Path | None = None
    api_keys_reload_s: float = 5.0
    #: Serve `/metrics`, `/healthz` and `/readyz` on this port instead of the API port.
    admin_port: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_headers: int = DEFAULT_MAX_HEADERS
    #: How long a Redis rate-limit call may take before the request goes through unlimited.
    redis_timeout_s: float = 0.25

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_header_bytes", "max_headers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.api_keys_reload_s <= 0 or self.redis_timeout_s <= 0:
            raise ValueError("api_keys_reload_s and redis_timeout_s must be positive")
