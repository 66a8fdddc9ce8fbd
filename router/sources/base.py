"""The interface every discovery source implements."""

from __future__ import annotations

from typing import Protocol

from router.view import ClusterView


class Source(Protocol):
    """Feeds a ClusterView until cancelled.

    `run` first loads everything (then `synced` returns True) and then follows changes
    until the task is cancelled. A failure to read or parse one object never stops it.
    """

    async def run(self, view: ClusterView) -> None: ...

    @property
    def synced(self) -> bool: ...
