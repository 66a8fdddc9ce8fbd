"""What `/sim/stats` reports: counters a test can assert on, and a ring of recent requests."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Final, Literal

#: Default number of recent request records kept.
DEFAULT_RECENT_RECORDS: Final = 256

RecordKind = Literal["prefill", "decode", "both"]


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One finished (or failed) request.

    `kind`: prefill (exported KV), decode (came with a handle), both (plain request).
    `blocks`: KV blocks moved through the store (exported by prefill, read by decode).
    `rank`: the data-parallel rank that served it; None (left out of the JSON) when the
    server has one engine.
    """

    request_id: str
    kind: RecordKind
    kv_from_store: bool
    blocks: int
    prompt_tokens: int
    cached_tokens: int
    error: str | None = None
    rank: int | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if self.rank is None:
            del out["rank"]
        return out


class SimStats:
    """Counters and the recent-request ring (bounded by `recent_records`)."""

    def __init__(self, recent_records: int = DEFAULT_RECENT_RECORDS) -> None:
        self.requests: dict[RecordKind, int] = {"prefill": 0, "decode": 0, "both": 0}
        self.errors = 0
        self.kv_blocks_written = 0
        self.kv_blocks_write_skipped = 0
        self.kv_blocks_read = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._recent: deque[RequestRecord] = deque(maxlen=recent_records)

    def record(self, record: RequestRecord) -> None:
        if record.error is None:
            self.requests[record.kind] += 1
        else:
            self.errors += 1
        self._recent.append(record)

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": dict(self.requests),
            "errors": self.errors,
            "kv_blocks_written": self.kv_blocks_written,
            "kv_blocks_write_skipped": self.kv_blocks_write_skipped,
            "kv_blocks_read": self.kv_blocks_read,
            "prefix_cache": {
                "queries": self.prefix_cache_queries,
                "hits": self.prefix_cache_hits,
            },
            "recent": [record.to_json() for record in self._recent],
        }
