"""Hot reload of the scheduler config: poll the file, apply a valid new version.

`SchedulerConfigWatcher.run()` checks the file's (inode, size, mtime) every
`interval_s` (config `reload.interval`, default 1 s). When it changed, the file is read
and validated; a valid config is handed to `apply` (the scheduler swaps its profiles in
one assignment, so a request in flight never sees half a config); an invalid one is
logged and counted (`pdgate_scheduler_config_reloads_total{result="error"}`) and the
running config stays. A file that disappears keeps the running config too.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path

from router.scheduling.config import SchedulerConfig, SchedulerConfigError, load_scheduler_config
from router.scheduling.metrics import SchedulerMetrics

log = logging.getLogger("pdgate.scheduling.config")

Signature = tuple[int, int, int] | None


def file_signature(path: Path) -> Signature:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return (stat.st_ino, stat.st_size, stat.st_mtime_ns)


class SchedulerConfigWatcher:
    def __init__(
        self,
        path: Path,
        apply: Callable[[SchedulerConfig], None],
        metrics: SchedulerMetrics,
        interval_s: float = 1.0,
    ) -> None:
        self.path = Path(path)
        self._apply = apply
        self._metrics = metrics
        self.interval_s = interval_s
        self._signature = file_signature(self.path)

    def check(self) -> bool:
        """Reload if the file changed; True when a new config was applied."""
        signature = file_signature(self.path)
        if signature == self._signature:
            return False
        self._signature = signature
        if signature is None:
            log.warning("scheduler config %s disappeared; keeping the running config", self.path)
            return False
        try:
            config = load_scheduler_config(self.path)
        except SchedulerConfigError as exc:
            self._metrics.config_reloads.labels(result="error").inc()
            log.error("scheduler config not reloaded: %s", exc)
            return False
        try:
            self._apply(config)
        except Exception:
            self._metrics.config_reloads.labels(result="error").inc()
            log.exception("scheduler config %s could not be applied", self.path)
            return False
        self.interval_s = config.reload.interval_s or self.interval_s
        self._metrics.config_reloads.labels(result="ok").inc()
        log.info("scheduler config reloaded from %s", self.path)
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.check()
