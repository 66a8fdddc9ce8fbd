"""Where a replica's peers are: a static list, or its own headless Service in Kubernetes.

Static (`--peers host:port,...`): connected once; ZMQ reconnects by itself to a peer
that is down or restarts. Kubernetes (`--peer-service NAME`): the EndpointSlices of that
Service (label `kubernetes.io/service-name`) in the router's namespace are read every
`discovery_interval_s`; every ready address but this pod's own is a peer on the
`sync_port` (the port named `sync` when the slice lists one). Discovery only adds and
removes connections: whether a peer is alive is decided by its heartbeats (`node.py`),
so a slow API server delays only the joining of new replicas, never a request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Final

import zmq

from router.sync.config import SyncConfig

log = logging.getLogger("pdgate.sync.peers")

#: Peer addresses connected at once (a Service with more endpoints is cut here, logged).
MAX_PEER_ADDRESSES: Final = 256
SERVICE_NAME_LABEL: Final = "kubernetes.io/service-name"
SYNC_PORT_NAME: Final = "sync"


def parse_peers(text: str) -> tuple[str, ...]:
    """`host:port,host:port` -> the addresses; raises ValueError on a bad one."""
    out = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"peer {item!r}: expected host:port")
        out.append(f"{host.strip('[]')}:{int(port)}")
    return tuple(out)


def slice_addresses(slices: list[dict[str, Any]], default_port: int, skip: str | None) -> set[str]:
    """`host:port` of every ready endpoint of these EndpointSlices, but `skip`'s.

    A dual-stack Service has a slice per address family, each naming every pod: only the
    family of `skip` (this pod's address) is read, or each peer would be connected twice,
    and this pod would connect to its own other address. Without `skip`, every family."""
    family = None if skip is None else "IPv6" if ":" in skip else "IPv4"
    out: set[str] = set()
    for item in slices:
        if family is not None and item.get("addressType", family) != family:
            continue
        port = default_port
        for entry in item.get("ports") or []:
            if entry.get("name") == SYNC_PORT_NAME and entry.get("port"):
                port = int(entry["port"])
        for endpoint in item.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready") is False:
                continue
            for address in endpoint.get("addresses") or []:
                if address != skip:
                    out.add(f"{address}:{port}")
    return out


def _tcp(address: str) -> str:
    host, _, port = address.rpartition(":")
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class PeerDiscovery:
    """Keeps a SUB socket connected to the current peers."""

    def __init__(
        self, config: SyncConfig, sub: zmq.Socket[Any],
        on_change: Callable[[], object] | None = None,
    ) -> None:
        self.config = config
        self.sub = sub
        #: Called after the socket connected or disconnected: the reader must look again
        #: (a ZMQ call can consume the edge of its `ZMQ_FD` that announced a frame).
        self.on_change = on_change
        self.connected: set[str] = set()

    def set_peers(self, addresses: set[str]) -> None:
        if len(addresses) > MAX_PEER_ADDRESSES:
            log.warning("sync: %d peers, keeping %d", len(addresses), MAX_PEER_ADDRESSES)
            addresses = set(sorted(addresses)[:MAX_PEER_ADDRESSES])
        for address in sorted(self.connected - addresses):
            self.sub.disconnect(_tcp(address))
            log.info("sync: peer %s left the peer list", address)
        for address in sorted(addresses - self.connected):
            self.sub.connect(_tcp(address))
            log.info("sync: connecting to peer %s", address)
        changed = addresses != self.connected
        self.connected = set(addresses)
        if changed and self.on_change is not None:
            self.on_change()

    async def run(self) -> None:
        config = self.config
        if config.peers:
            self.set_peers(set(config.peers))
        if config.peer_service is None:
            return
        from router.sources.kube_api import default_namespace, make_api_client

        namespace = config.namespace or default_namespace(config.kubeconfig)
        api_client = None
        while api_client is None:  # no client yet (no token, a bad kubeconfig): the
            try:  # static peers and this host's workers sync meanwhile; try again later
                api_client = await make_api_client(config.kubeconfig)
            except Exception as exc:
                log.warning("sync: no Kubernetes client to discover peers: %s", exc)
                await asyncio.sleep(config.discovery_interval_s)
        try:
            from kubernetes_asyncio import client

            discovery: Any = client.DiscoveryV1Api(api_client)
            selector = f"{SERVICE_NAME_LABEL}={config.peer_service}"
            assert config.sync_port is not None
            while True:
                try:
                    answer = await discovery.list_namespaced_endpoint_slice(
                        namespace, label_selector=selector, _preload_content=False
                    )
                    body = await answer.json()
                    found = slice_addresses(
                        body.get("items") or [], config.sync_port, config.own_address
                    )
                    self.set_peers(found | set(config.peers))
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # keep the peers we have; try again later
                    log.warning("sync: cannot list the EndpointSlices of %s: %s",
                                config.peer_service, exc)
                await asyncio.sleep(config.discovery_interval_s)
        finally:
            await api_client.close()
