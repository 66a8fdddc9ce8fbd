"""Helpers the connectors share: prefill body shaping, annotations, pod addresses.

Private to the package: each connector module documents its own exchange and only
borrows these small pieces, so a change here is a change to several wire formats.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Any, Final

from kv_connectors.base import UpstreamError

#: Which MooncakeConnector the engines run: `vllm-ascend` (default, sequential handle)
#: or `vllm` (upstream vLLM, concurrent rendezvous through the bootstrap server).
MOONCAKE_PROTOCOL_ANNOTATION: Final = "pdgate.io/mooncake-protocol"
#: Port of the prefill engine's Mooncake bootstrap server (upstream vLLM protocol).
MOONCAKE_BOOTSTRAP_PORT_ANNOTATION: Final = "pdgate.io/mooncake-bootstrap-port"
#: Port of the prefill engine's SGLang disaggregation bootstrap server.
SGLANG_BOOTSTRAP_PORT_ANNOTATION: Final = "pdgate.io/sglang-bootstrap-port"

#: Both vLLM (`VLLM_MOONCAKE_BOOTSTRAP_PORT`) and SGLang
#: (`--disaggregation-bootstrap-port`) default their bootstrap server to 8998.
DEFAULT_BOOTSTRAP_PORT: Final = 8998


def parse_port(value: str, annotation: str) -> int:
    """Read a TCP port from an annotation; a bad value is a configuration error."""
    text = value.strip()
    if not text.isdecimal() or not 0 < int(text) < 65536:
        raise ValueError(f"annotation {annotation}={value!r} is not a TCP port (1-65535)")
    return int(text)


def port_annotation(annotations: Mapping[str, str], annotation: str, default: int) -> int:
    """The port an annotation names, or `default` when the annotation is absent."""
    value = annotations.get(annotation)
    return default if value is None else parse_port(value, annotation)


def call_port(annotations: Mapping[str, str], annotation: str, default: int) -> int:
    """Like `port_annotation`, for a request: a bad value fails the call, not the process.

    `get_connector` already validated the server's annotations, so this only trips when
    a call carries annotations the connector was never built from.
    """
    try:
        return port_annotation(annotations, annotation, default)
    except ValueError:
        raise UpstreamError(
            "bad_config",
            "The model server's PD configuration is invalid.",
            retryable=False,
            phase="prefill",
        ) from None


def url_host(ip: str) -> str:
    """An address as it goes into a URL authority: IPv6 literals in brackets."""
    try:
        ipaddress.IPv6Address(ip)
    except ValueError:
        return ip
    return f"[{ip}]"


def one_token_prefill(body: Mapping[str, Any]) -> dict[str, Any]:
    """The client's body cut down to a one-token, non-streaming prefill request.

    Prefill only has to fill the KV cache: one token is the least an engine will run,
    and a JSON answer (not SSE) is what a handle can come back in. `stream_options`
    goes because vLLM rejects it without `stream: true`. A `min_tokens` above 1 is
    lowered because vLLM rejects `min_tokens > max_tokens`.
    """
    prefill = dict(body)
    prefill["stream"] = False
    prefill.pop("stream_options", None)
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    min_tokens = prefill.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens > 1:
        prefill["min_tokens"] = 1
    return prefill


def vllm_prefill(body: Mapping[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """A vLLM KV-producer prefill: one token, `min_tokens: 1`, and the connector's params.

    `min_tokens: 1` keeps vLLM from stopping on EOS or a stop string at the one token
    it makes: only a prefill that stopped on length hands its KV blocks over (vLLM's
    `request_finished` checks `FINISHED_LENGTH_CAPPED`). vLLM Router sends the same.
    """
    prefill = one_token_prefill(body)
    prefill["min_tokens"] = 1
    prefill["kv_transfer_params"] = kv_transfer_params
    return prefill
