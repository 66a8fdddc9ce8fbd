"""KV connectors: how a prefill request is tied to its decode request, per protocol.

`get_connector` (in `factory.py`) picks one from a ModelServer's `kvConnector.type`,
`inferenceEngine` and annotations; `base.py` holds the interface they implement.
"""

from __future__ import annotations

from kv_connectors._common import (
    DEFAULT_BOOTSTRAP_PORT,
    MOONCAKE_BOOTSTRAP_PORT_ANNOTATION,
    MOONCAKE_PROTOCOL_ANNOTATION,
    SGLANG_BOOTSTRAP_PORT_ANNOTATION,
)
from kv_connectors.base import (
    Handoff,
    KVConnector,
    PDCall,
    PodAddress,
    PrefillClient,
    UpstreamError,
)
from kv_connectors.factory import get_connector
from kv_connectors.http import HTTPConnector
from kv_connectors.mooncake import MooncakeConnector
from kv_connectors.mooncake_vllm import MooncakeVllmConnector
from kv_connectors.nixl import NixlConnector
from kv_connectors.sglang import SGLangConnector

__all__ = [
    "DEFAULT_BOOTSTRAP_PORT",
    "MOONCAKE_BOOTSTRAP_PORT_ANNOTATION",
    "MOONCAKE_PROTOCOL_ANNOTATION",
    "SGLANG_BOOTSTRAP_PORT_ANNOTATION",
    "HTTPConnector",
    "Handoff",
    "KVConnector",
    "MooncakeConnector",
    "MooncakeVllmConnector",
    "NixlConnector",
    "PDCall",
    "PodAddress",
    "PrefillClient",
    "SGLangConnector",
    "UpstreamError",
    "get_connector",
]
