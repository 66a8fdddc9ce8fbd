"""`SyncConfig`: how a router process shares its state with the others (see `router.sync`)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from typing import Final

#: Seconds between heartbeats; each carries the origin's whole in-flight report.
DEFAULT_HEARTBEAT_S: Final = 0.2
#: Longest that local changes which need not go at once are gathered before they go
#: out as one frame, when no pick sends them earlier (`node.py`).
DEFAULT_FLUSH_INTERVAL_S: Final = 0.005
#: Seconds without a frame after which an origin is lost and its contributions expire.
DEFAULT_TTL_S: Final = 1.0
#: TCP port of a host's peer channel (worker 0 binds it; peers connect to it).
DEFAULT_SYNC_PORT: Final = 8090
#: Seconds between reads of the peer Service's EndpointSlices.
DEFAULT_DISCOVERY_INTERVAL_S: Final = 5.0
#: Longest a worker leaves its siblings' state frames unread when it picks nothing
#: (`local.py`: a pick reads them first).
DEFAULT_CATCH_UP_S: Final = 0.02
#: Longest wait for the leader to place a new prompt before a process places it itself.
DEFAULT_PLACE_TIMEOUT_S: Final = 0.02


@dataclass(frozen=True, slots=True)
class SyncConfig:
    """Which process this is, where its siblings and peers are, how fast facts expire."""

    host_id: str
    worker: int = 0
    workers: int = 1
    #: Directory of the workers' sockets (one host).
    run_dir: str = field(default_factory=tempfile.gettempdir)
    #: This host's peer channel port; None: no peer replicas.
    sync_port: int | None = None
    sync_host: str = "0.0.0.0"
    #: Static peers, "host:port" each.
    peers: tuple[str, ...] = ()
    #: Headless Service whose EndpointSlices list the peers (Kubernetes).
    peer_service: str | None = None
    namespace: str | None = None
    kubeconfig: str | None = None
    #: This pod's own address, skipped among the discovered peers.
    own_address: str | None = None
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S
    catch_up_s: float = DEFAULT_CATCH_UP_S
    ttl_s: float = DEFAULT_TTL_S
    discovery_interval_s: float = DEFAULT_DISCOVERY_INTERVAL_S
    #: 0: every process places its new prompts itself (`node.py`, "New prompts").
    place_timeout_s: float = DEFAULT_PLACE_TIMEOUT_S

    @property
    def origin(self) -> str:
        return f"{self.host_id}.{self.worker}"

    @property
    def leader(self) -> bool:
        """Worker 0: scrapes engines for the host and relays to and from peer replicas."""
        return self.worker == 0

    @property
    def enabled(self) -> bool:
        return self.workers > 1 or self.sync_port is not None

    def local_address(self, worker: int) -> str:
        """Unix datagram socket path of a worker's state lane (`local.py`)."""
        return f"{self.run_dir}/pdgate-sync-{self.host_id}-{worker}.sock"

    def urgent_address(self, worker: int) -> str:
        """Unix datagram socket path of a worker's urgent lane (new-prompt placement)."""
        return f"{self.run_dir}/pdgate-sync-{self.host_id}-{worker}-urgent.sock"

    def metrics_address(self, worker: int) -> str:
        """Unix socket path on which a worker serves its own `/metrics` to its siblings."""
        return f"{self.run_dir}/pdgate-metrics-{self.host_id}-{worker}.sock"

    def validate(self) -> None:
        if self.workers < 1 or not 0 <= self.worker < self.workers:
            raise ValueError(f"worker {self.worker} of {self.workers}: out of range")
        if not 0 <= self.flush_interval_s < self.heartbeat_s:
            raise ValueError("the sync flush interval must be >= 0 and below the heartbeat")
        if self.catch_up_s <= 0:
            raise ValueError("the sync catch-up interval must be > 0")
        if self.heartbeat_s <= 0 or self.ttl_s <= self.heartbeat_s:
            raise ValueError("the sync TTL must exceed the heartbeat interval (both > 0)")
        if self.place_timeout_s < 0:
            raise ValueError("the new-prompt placement timeout must be >= 0")
        if (self.peers or self.peer_service) and self.sync_port is None:
            raise ValueError("peers need a --sync-port to listen on")
