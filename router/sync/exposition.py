"""One `/metrics` for all the workers of a host (`--workers N`).

A scrape reaches whichever worker the kernel hands the connection to, and each worker
holds only its own counters. So every worker also serves its own exposition on a Unix
socket in the run directory (`SyncConfig.metrics_address`), and the worker that gets a
scrape reads the others' there and answers with all of them in one exposition, every
sample labelled `worker="<index>"`. A labelled series is one process's: it only grows
while that process lives, and a restarted worker is a counter reset of its own series,
which `rate()` handles (summing the workers' counters into one series would make a
restart look like the host's counter going backwards). Sum over the label for the host:
`sum without (worker) (rate(pdgate_requests_total[1m]))`.

Why not prometheus_client's multiprocess mode: every metric update would write an mmap
under a lock, its gauges lose `set_function` and custom collectors (the scheduler's
index gauges use both), and its files need cleaning per run. This costs nothing per
request; the price is paid per scrape (N-1 local reads, a text merge). A worker that does
not answer within `GATHER_TIMEOUT_S` is left out, and
`pdgate_metrics_workers{state="missing"}` says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from typing import Final

from router.sync.config import SyncConfig

log = logging.getLogger("pdgate.sync.exposition")

#: Seconds the scraped worker waits for each other worker's exposition.
GATHER_TIMEOUT_S: Final = 2.0
#: Largest exposition read from one worker (bytes); a larger one is cut off and left out.
MAX_EXPOSITION_BYTES: Final = 32 << 20
#: Bytes read from a worker's socket at a time.
READ_CHUNK_BYTES: Final = 1 << 16
#: The label every sample of a merged exposition carries.
WORKER_LABEL: Final = "worker"


def label_samples(text: str, worker: int) -> tuple[list[str], dict[str, list[str]]]:
    """Split an exposition into families: (order, name -> lines), samples labelled.

    Text format 0.0.4 as prometheus_client writes it: each family starts with its
    `# HELP` line, then `# TYPE`, then its samples. A label goes in right after `{`, or
    `{worker="i"}` before the value of a sample without labels.
    """
    order: list[str] = []
    families: dict[str, list[str]] = {}
    lines: list[str] = []
    label = f'{WORKER_LABEL}="{worker}"'
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# HELP "):
            name = line[7:].split(" ", 1)[0]
            order.append(name)
            lines = families[name] = [line]
        elif line.startswith("#"):
            lines.append(line)
        else:
            brace = line.find("{")
            space = line.find(" ")
            if brace != -1 and (space == -1 or brace < space):
                close = "" if line[brace + 1] == "}" else ","
                lines.append(f"{line[: brace + 1]}{label}{close}{line[brace + 1:]}")
            else:
                lines.append(f"{line[:space]}{{{label}}}{line[space:]}")
    return order, families


def merge(expositions: dict[int, str], missing: int) -> bytes:
    """The workers' expositions as one: families in order of first appearance, the
    header once, then every worker's samples (worker by worker)."""
    order: list[str] = []
    merged: dict[str, list[str]] = {}
    for worker in sorted(expositions):
        names, families = label_samples(expositions[worker], worker)
        for name in names:
            lines = families[name]
            if name in merged:
                merged[name].extend(line for line in lines if not line.startswith("#"))
            else:
                order.append(name)
                merged[name] = lines
    out = [line for name in order for line in merged[name]]
    out += [
        "# HELP pdgate_metrics_workers Workers of this host whose metrics this exposition "
        "holds (answered) or lacks (missing: no answer in time).",
        "# TYPE pdgate_metrics_workers gauge",
        f'pdgate_metrics_workers{{state="answered"}} {float(len(expositions))}',
        f'pdgate_metrics_workers{{state="missing"}} {float(missing)}',
    ]
    return ("\n".join(out) + "\n").encode()


class WorkerMetrics:
    """Serves this worker's exposition to its siblings; gathers theirs for a scrape."""

    def __init__(self, config: SyncConfig, render: Callable[[], bytes]) -> None:
        self.config = config
        self.render = render

    async def serve(self) -> None:
        """Answer each connection on this worker's socket with the exposition, until
        cancelled."""
        path = self.config.metrics_address(self.config.worker)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a predecessor's (a restarted worker)

        async def answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                writer.write(self.render())
                await writer.drain()
            except OSError:
                pass
            finally:
                writer.close()

        server = await asyncio.start_unix_server(answer, path=path)
        try:
            await server.serve_forever()
        finally:
            server.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    async def _read(self, worker: int) -> str | None:
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(GATHER_TIMEOUT_S):
                reader, writer = await asyncio.open_unix_connection(
                    self.config.metrics_address(worker)
                )
                try:
                    while chunk := await reader.read(READ_CHUNK_BYTES):
                        size += len(chunk)
                        if size > MAX_EXPOSITION_BYTES:
                            log.warning("metrics of worker %d larger than %d bytes: left out",
                                        worker, MAX_EXPOSITION_BYTES)
                            return None
                        chunks.append(chunk)
                finally:
                    writer.close()
        except (OSError, TimeoutError) as exc:
            log.warning("metrics of worker %d unavailable: %s", worker, exc)
            return None
        return b"".join(chunks).decode()

    async def gather(self) -> bytes:
        """This worker's exposition and every sibling's, merged (`merge`)."""
        config = self.config
        others = [w for w in range(config.workers) if w != config.worker]
        texts = await asyncio.gather(*(self._read(w) for w in others))
        expositions = {config.worker: self.render().decode()}
        expositions.update({w: t for w, t in zip(others, texts, strict=True) if t is not None})
        return merge(expositions, len(others) + 1 - len(expositions))
