"""Run a Mooncake master (with its HTTP metadata server) on free loopback ports.

Tests, benchmarks and local runs need one master per run; this finds the `mooncake_master`
binary that the mooncake wheel ships, starts it, and waits until clients can connect.
`python -m engine_sim.mooncake_master` runs one in the foreground and prints its addresses.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

from engine_sim.ports import accepts, free_ports

BINARY_NAME = "mooncake_master"
#: Attempts when ports we picked turn out to be taken by the time the master binds them.
START_ATTEMPTS = 3
_LOG_TAIL_BYTES = 4000
#: How long a new master must stay alive once its ports accept before they are believed
#: to be its own.
_SETTLE_S = 0.3


class MooncakeMasterError(RuntimeError):
    """The master could not be found or did not come up."""


def find_master_binary() -> Path:
    """The mooncake wheel's binary, else one next to this Python, else one on PATH."""
    candidates: list[Path] = []
    spec = importlib.util.find_spec("mooncake")  # locates the package without importing it
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / BINARY_NAME for p in spec.submodule_search_locations]
    candidates.append(Path(sys.executable).parent / BINARY_NAME)
    on_path = shutil.which(BINARY_NAME)
    if on_path:
        candidates.append(Path(on_path))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise MooncakeMasterError(
        f"no {BINARY_NAME} binary found (looked at {', '.join(map(str, candidates))}); "
        "install mooncake-transfer-engine-non-cuda"
    )


class MooncakeMaster:
    """One master process. Ports left at 0 are picked free at start."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        rpc_port: int = 0,
        metadata_port: int = 0,
        metrics_port: int = 0,
        binary: Path | None = None,
        log_path: Path | None = None,
        extra_args: Sequence[str] = (),
        preexec_fn: Callable[[], None] | None = None,
    ) -> None:
        """`preexec_fn` runs in the child before exec (a launcher that must own the
        master passes one that sets its process group and parent-death signal)."""
        self.host = host
        self._want = (rpc_port, metadata_port, metrics_port)
        self.rpc_port = rpc_port
        self.metadata_port = metadata_port
        self.metrics_port = metrics_port
        self.binary = binary
        self.log_path = log_path
        self.extra_args = tuple(extra_args)
        self.preexec_fn = preexec_fn
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def rpc_address(self) -> str:
        """What clients pass as `master_server_addr` (engine_sim's --mooncake-master)."""
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        """What clients pass as `metadata_server` (engine_sim's --metadata-server)."""
        return f"http://{self.host}:{self.metadata_port}/metadata"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def start(self, timeout_s: float = 20.0) -> MooncakeMaster:
        """Start and wait until the RPC and metadata ports accept connections."""
        if self.process is not None:
            raise MooncakeMasterError("already started")
        binary = self.binary or find_master_binary()
        if self.log_path is None:
            handle, name = tempfile.mkstemp(prefix="mooncake-master-", suffix=".log")
            os.close(handle)
            self.log_path = Path(name)
        picked_any = 0 in self._want
        last_error = ""
        for _ in range(START_ATTEMPTS if picked_any else 1):
            self._pick_ports()
            try:
                self._launch(binary, timeout_s)
                return self
            except MooncakeMasterError as exc:
                last_error = str(exc)
                self.stop()
                if "libibverbs" in last_error:
                    break
        raise MooncakeMasterError(last_error)

    def _pick_ports(self) -> None:
        """Free ports for those not given, distinct: a master whose RPC and metrics ports
        were one port served its admin page there, passed the readiness check on it and
        shut down a second later, when its RPC server could not bind."""
        rpc, metadata, metrics = self._want
        # Six distinct, so that three remain that are none of the ports given.
        fresh = (p for p in free_ports(6, self.host) if p not in self._want)
        self.rpc_port = rpc or next(fresh)
        self.metadata_port = metadata or next(fresh)
        self.metrics_port = metrics or next(fresh)

    def _launch(self, binary: Path, timeout_s: float) -> None:
        assert self.log_path is not None
        args = [
            str(binary),
            f"-rpc_address={self.host}",
            f"-rpc_port={self.rpc_port}",
            "-enable_http_metadata_server=true",
            f"-http_metadata_server_host={self.host}",
            f"-http_metadata_server_port={self.metadata_port}",
            f"-metrics_host={self.host}",
            f"-metrics_port={self.metrics_port}",
            "-enable_metric_reporting=false",
            *self.extra_args,
        ]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=self.preexec_fn,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise MooncakeMasterError(self._failure(f"exited with {self.process.returncode}"))
            if accepts(self.host, self.rpc_port) and accepts(self.host, self.metadata_port):
                # Another process may hold a port we picked: then ours dies on bind, soon
                # after its first ports open (it opens them one server at a time).
                time.sleep(_SETTLE_S)
                if self.process.poll() is None:
                    return
                continue
            time.sleep(0.05)
        raise MooncakeMasterError(self._failure(f"not accepting after {timeout_s:.0f} s"))

    def _failure(self, what: str) -> str:
        tail = ""
        if self.log_path is not None and self.log_path.exists():
            tail = self.log_path.read_bytes()[-_LOG_TAIL_BYTES:].decode(errors="replace")
        hint = " (run `apt-get install libibverbs1`)" if "libibverbs" in tail else ""
        return f"mooncake_master {what}{hint}; log {self.log_path}:\n{tail}"

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate and wait (kill after `timeout_s`)."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> MooncakeMaster:
        return self if self.process is not None else self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """Run a master in the foreground until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(prog="python -m engine_sim.mooncake_master")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--rpc-port", type=int, default=0)
    parser.add_argument("--metadata-port", type=int, default=0)
    parser.add_argument("--metrics-port", type=int, default=0)
    parser.add_argument("--log", type=Path, help="master log file (default: a temp file)")
    args = parser.parse_args(argv)
    master = MooncakeMaster(
        args.host, args.rpc_port, args.metadata_port, args.metrics_port, log_path=args.log
    )
    stopping = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        master.start()
    except MooncakeMasterError as exc:
        print(f"mooncake_master: {exc}", file=sys.stderr)
        return 1
    print(f"--mooncake-master {master.rpc_address}", flush=True)
    print(f"--metadata-server {master.metadata_url}", flush=True)
    print(f"metrics {master.metrics_url}; log {master.log_path}", flush=True)
    try:
        while not stopping and master.process is not None and master.process.poll() is None:
            time.sleep(0.2)
    finally:
        master.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
