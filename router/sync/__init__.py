"""One view of load and cache across router processes: workers of a host, replicas.

Every router process ("origin": a host id and a worker index) publishes the decisions
that change what another process should see: its in-flight count per pod (and with it
the seconds of prefill it sent there and predicts are not done), the prompt
block hashes it sent to a pod (the approximate prefix index, or the precise index's
record of a prompt still prefilling), pods it ejected or readmitted, and (worker 0 only)
the engines' scraped `/metrics`. The others apply them.
Where a prompt no pod holds starts is decided by one process, the leader (the lowest live
origin), which the others ask (`node.py`, "New prompts").

- `config.py`: `SyncConfig`, the knobs (TTL, heartbeat, ports, peers).
- `messages.py`: the frames on the wire (msgpack).
- `node.py`: `SyncNode`, the ZMQ sockets, the hooks into the router's state, peer
  liveness and the relay between a host's workers and its peer replicas.
- `peers.py`: where peers come from (a static list, a headless Service's EndpointSlices).
- `workers.py`: `--workers N`: the worker count and the process supervisor.
- `metrics.py`: `pdgate_peers{state}`, messages sent/received/dropped, last-heard age,
  new-prompt placements by outcome.

Nothing here is consensus: every fact has one owner (the origin that made it), is sent
as the owner's current value, and expires when the owner goes silent for `ttl_s`. The
leader is not elected either: each process takes the lowest origin it hears as live; two
that disagree for a moment (a peer just lost or back) both place new prompts, as every
process would without a leader, and an ask that gets no answer within
`place_timeout_s` is placed by the asker.
"""

from router.sync.config import SyncConfig
from router.sync.node import SyncNode

__all__ = ["SyncConfig", "SyncNode"]
