"""Which connector serves a ModelServer: `get_connector`.

`get_connector` maps a ModelServer's `kvConnector.type`, `inferenceEngine` and
annotations to a connector:

| engine | type       | annotation                               | connector              |
| ------ | ---------- | ---------------------------------------- | ---------------------- |
| SGLang | any        | `pdgate.io/sglang-bootstrap-port`        | `SGLangConnector`      |
| vLLM   | `http`     |                                          | `HTTPConnector`        |
| vLLM   | `lmcache`  |                                          | `HTTPConnector`        |
| vLLM   | `nixl`     |                                          | `NixlConnector`        |
| vLLM   | `mooncake` | `pdgate.io/mooncake-protocol` absent or  | `MooncakeConnector`    |
|        |            | `vllm-ascend`                            | (vllm-ascend)          |
| vLLM   | `mooncake` | `pdgate.io/mooncake-protocol: vllm`,     | `MooncakeVllmConnector`|
|        |            | `pdgate.io/mooncake-bootstrap-port`      | (upstream vLLM)        |

`lmcache` takes the plain HTTP flow, as Kthena does: LMCache's own PD mode is a
different protocol (a `disagg_spec` naming the decoder's ZMQ ports, a proxy that
tokenizes and waits for a ZMQ "KV ready" message; LMCache/LMCache,
examples/disagg_prefill/disagg_proxy_server.py) and returns no NIXL-style handle,
so the NIXL flow would fail every request. Unknown types, engines or annotation
values raise `ValueError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

from kv_connectors._common import (
    DEFAULT_BOOTSTRAP_PORT,
    MOONCAKE_BOOTSTRAP_PORT_ANNOTATION,
    MOONCAKE_PROTOCOL_ANNOTATION,
    SGLANG_BOOTSTRAP_PORT_ANNOTATION,
    parse_port,
)
from kv_connectors.base import KVConnector
from kv_connectors.http import HTTPConnector
from kv_connectors.mooncake import MooncakeConnector
from kv_connectors.mooncake_vllm import MooncakeVllmConnector
from kv_connectors.nixl import NixlConnector
from kv_connectors.sglang import SGLangConnector

CONNECTOR_TYPES = frozenset({"http", "nixl", "mooncake", "lmcache"})
MOONCAKE_PROTOCOLS = frozenset({"vllm", "vllm-ascend"})


def get_connector(
    kv_connector_type: str, inference_engine: str, annotations: Mapping[str, str]
) -> KVConnector:
    """The connector for one ModelServer. Cheap: instances are shared and cached.

    Raises `ValueError` for an unknown type, engine, Mooncake protocol or a port
    annotation that is not a port.
    """
    return _connector(
        kv_connector_type,
        inference_engine,
        annotations.get(MOONCAKE_PROTOCOL_ANNOTATION),
        annotations.get(MOONCAKE_BOOTSTRAP_PORT_ANNOTATION),
        annotations.get(SGLANG_BOOTSTRAP_PORT_ANNOTATION),
    )


@lru_cache(maxsize=256)
def _connector(
    kind: str,
    engine: str,
    mooncake_protocol: str | None,
    mooncake_port: str | None,
    sglang_port: str | None,
) -> KVConnector:
    """Build (once per distinct configuration) the connector `get_connector` returns."""
    if kind not in CONNECTOR_TYPES:
        raise ValueError(f"unknown kvConnector type {kind!r}")
    if engine == "SGLang":
        port = DEFAULT_BOOTSTRAP_PORT
        if sglang_port is not None:
            port = parse_port(sglang_port, SGLANG_BOOTSTRAP_PORT_ANNOTATION)
        return SGLangConnector(bootstrap_port=port)
    if engine != "vLLM":
        raise ValueError(f"unknown inferenceEngine {engine!r}")
    if kind in ("http", "lmcache"):
        return HTTPConnector()
    if kind == "nixl":
        return NixlConnector()
    protocol = "vllm-ascend" if mooncake_protocol is None else mooncake_protocol.strip()
    if protocol not in MOONCAKE_PROTOCOLS:
        raise ValueError(
            f"annotation {MOONCAKE_PROTOCOL_ANNOTATION}={mooncake_protocol!r} "
            f"is not one of {sorted(MOONCAKE_PROTOCOLS)}"
        )
    if protocol == "vllm-ascend":
        return MooncakeConnector()
    port = DEFAULT_BOOTSTRAP_PORT
    if mooncake_port is not None:
        port = parse_port(mooncake_port, MOONCAKE_BOOTSTRAP_PORT_ANNOTATION)
    return MooncakeVllmConnector(bootstrap_port=port)
