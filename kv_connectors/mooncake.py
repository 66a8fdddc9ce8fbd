"""vllm-ascend MooncakeConnector: the NIXL-shaped sequential handle, under its own name.

vllm-ascend's MooncakeConnector (vllm-project/vllm-ascend,
vllm_ascend/distributed/mooncake_connector.py, `request_finished`) answers the same
prefill request as vLLM's NixlConnector with the same kind of handle, so the router
side is identical; Kthena says so and reuses its NIXL code
(volcano-sh/kthena, pkg/kthena-router/connectors: `NewMoonCakeConnector` returns a
`NIXLConnector` named "mooncake"). This is the default for `kvConnector.type:
mooncake`; annotation `pdgate.io/mooncake-protocol: vllm` selects upstream vLLM's
concurrent protocol instead (`mooncake_vllm.py`).

Exchange, field by field (see `nixl.py` for the shared details):

1. Router -> prefill: the client's body with `stream: false`, no `stream_options`,
   `max_tokens: 1` (`max_completion_tokens: 1` if sent), `min_tokens: 1`, and
   `kv_transfer_params: {"do_remote_decode": true, "do_remote_prefill": false,
   "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
   "remote_port": null}`; headers `call.headers`.
2. Prefill -> router: `kv_transfer_params` with `do_remote_prefill: true`,
   `do_remote_decode: false`, `remote_block_ids`, `remote_engine_id`, `remote_host`,
   `remote_port`, and fields of vllm-ascend's own that change between releases and
   forks (seen: `remote_request_id`, `remote_ptp_size`, `remote_pcp_size`,
   `remote_dcp_size`, `last_token_id`, `remote_multi_nodes_meta_mapping`,
   `num_prompt_blocks`). That is why the dict is forwarded verbatim, never rebuilt.
3. Router -> decode: the client's body plus that dict as `kv_transfer_params`.

A missing or incomplete handle is `UpstreamError(reason="missing_kv_params")`, as
for NIXL.
"""

from __future__ import annotations

from typing import ClassVar

from kv_connectors.nixl import NixlConnector


class MooncakeConnector(NixlConnector):
    """vllm-ascend Mooncake: NIXL's flow, named apart for metrics and logs."""

    name: ClassVar[str] = "mooncake"
