"""vLLM NixlConnector: prefill runs first and returns the handle decode reads from.

Sources: vLLM Router (vllm-project/router, src/routers/http/vllm_pd_router.rs,
`prepare_prefill_request` and `process_vllm_two_stage_request`), its wire capture
(vLLM Router 0.1.17, non-streaming chat), and Kthena's `NIXLConnector`
(volcano-sh/kthena, pkg/kthena-router/connectors/nixl.go). The same flow serves
vllm-ascend's MooncakeConnector (see `mooncake.py`).

Exchange, field by field:

1. Router -> prefill, `POST <call.path>`, headers `call.headers` (the same
   `X-Request-Id` as decode gets; vLLM appends its own suffix internally). Body is
   the client's body with:
   - `stream`: `false` (the handle only comes back in a JSON answer);
   - `stream_options`: removed;
   - `max_tokens`: `1`; `max_completion_tokens`: `1` if the client sent it;
   - `min_tokens`: `1` (so the one token cannot be EOS: vLLM only hands over KV
     blocks for a prefill that stopped on length);
   - `kv_transfer_params`: `{"do_remote_decode": true, "do_remote_prefill": false,
     "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
     "remote_port": null}`;
   - every other field unchanged.
2. Prefill -> router: a non-streaming completion whose top-level
   `kv_transfer_params` is the handle. NixlConnector sends `do_remote_prefill: true`,
   `do_remote_decode: false`, `remote_block_ids` (a list, one per KV group in
   hybrid models), `remote_engine_id`, `remote_request_id`, `remote_host`,
   `remote_port`, `tp_size`, and in newer versions `remote_num_tokens`.
3. Router -> decode: the client's body unchanged (its own `stream`, `max_tokens`)
   plus `kv_transfer_params` set to the prefill's dict verbatim, same headers.

vLLM Router and Kthena send decode off without a handle when prefill returned none;
vLLM's decode then recomputes the prompt locally and nobody notices. Here a prefill
answer whose `kv_transfer_params` is absent, not an object, or lacks a string
`remote_engine_id` or a list `remote_block_ids` is an
`UpstreamError(reason="missing_kv_params", retryable=True, phase="prefill")`.
An empty `remote_block_ids` is accepted: a prompt shorter than one block has no
full block to move, and vLLM answers exactly that.
"""

from __future__ import annotations

from typing import Any, ClassVar

from kv_connectors._common import vllm_prefill
from kv_connectors.base import Handoff, KVConnector, PDCall, PrefillClient, UpstreamError

#: What the prefill is told: produce KV for a remote decode, expect none from anyone.
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class NixlConnector(KVConnector):
    """Sequential handle: await prefill, forward its `kv_transfer_params` to decode."""

    name: ClassVar[str] = "nixl"

    async def start(self, call: PDCall, client: PrefillClient) -> Handoff:
        """Prefill to completion; decode gets the client's body plus the prefill's handle."""
        prefill = vllm_prefill(call.body, dict(PREFILL_KV_TRANSFER_PARAMS))
        answer = await client.post_json(
            call.prefill, call.path, prefill, call.headers, call.deadline
        )
        handle = answer.get("kv_transfer_params")
        if not _is_handle(handle):
            raise UpstreamError(
                "missing_kv_params",
                "The prefill engine returned no KV cache handle.",
                retryable=True,
                pod=call.prefill,
                phase="prefill",
            )
        decode = dict(call.body)
        decode["kv_transfer_params"] = handle
        return Handoff(decode_body=decode)


def _is_handle(value: object) -> bool:
    """Whether a prefill's `kv_transfer_params` lets decode find the KV blocks."""
    if not isinstance(value, dict):
        return False
    engine_id = value.get("remote_engine_id")
    return (
        isinstance(engine_id, str)
        and engine_id != ""
        and isinstance(value.get("remote_block_ids"), list)
    )
