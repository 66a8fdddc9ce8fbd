"""What the sync layer exports: peers by state, messages, how long ago each peer spoke."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class SyncMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.peers = Gauge(
            "pdgate_peers",
            "Other router processes (workers, replicas) by state: live (heard within the "
            "TTL) or lost (silent longer; their contributions expired).",
            ["state"], registry=registry,
        )
        self.messages = Counter(
            "pdgate_sync_messages",
            "State-sync messages: sent, received, relayed (between this host's workers and "
            "peer replicas), dropped: frames this process could not send (a sibling absent "
            "or its backlog full) and frames missing from a peer's sequence (lost on the "
            "way; one frame carries one or more messages).",
            ["direction"], registry=registry,
        )
        self.last_heard = Gauge(
            "pdgate_peer_last_heard_seconds",
            "Seconds since each peer process was last heard from.",
            ["peer"], registry=registry,
        )
        self.seen_inflight = Gauge(
            "pdgate_sync_seen_inflight_requests",
            "Requests in flight per pod as this process's scheduler sees them (its own plus "
            "its live peers').",
            ["pod"], registry=registry,
        )
        self.placements = Counter(
            "pdgate_sync_placements",
            "New prompts this process asked the leader to place, by outcome: answered, "
            "timeout (placed here after `--sync-place-timeout`), none (the leader had no "
            "pod); and asks it answered as the leader (served).",
            ["outcome"], registry=registry,
        )
        self.info = Gauge(
            "pdgate_sync_info", "This process's identity in the state sync (value 1).",
            ["origin"], registry=registry,
        )
        # Children resolved once: `labels()` costs a lock and a tuple lookup per call, and
        # messages are counted on every frame.
        self.peer_state = {state: self.peers.labels(state=state) for state in ("live", "lost")}
        for child in self.peer_state.values():
            child.set(0)
        self.message = {
            direction: self.messages.labels(direction=direction)
            for direction in ("sent", "received", "dropped", "relayed", "duplicate")
        }
        self.placement = {
            outcome: self.placements.labels(outcome=outcome)
            for outcome in ("answered", "timeout", "none", "served")
        }
