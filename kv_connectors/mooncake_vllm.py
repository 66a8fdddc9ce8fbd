"""Upstream vLLM MooncakeConnector: a router-made transfer id, both engines at once.

Sources: vLLM's connector (vllm-project/vllm,
vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py:
`update_state_after_alloc`, `request_finished`, `_connect_to_prefiller_bootstrap`;
mooncake_utils.py: `MooncakeBootstrapServer`), vLLM's reference proxy
(examples/disaggregated/mooncake_connector/mooncake_connector_proxy.py) and
vllm-project/router (src/routers/http/vllm_pd_router.rs, `--kv-connector mooncake`).

The prefill engine's global rank 0 (with hybrid or external data-parallel load balancing:
each API server's first rank, for its own engines) runs a bootstrap server (FastAPI) on
`VLLM_MOONCAKE_BOOTSTRAP_PORT` (default 8998) where every prefill worker registers
(`POST /register {engine_id, dp_rank, tp_rank, pp_rank, addr}`). Prefill pushes KV to
decode (P-push): decode learns where the prefill workers are from that server, prefill
learns where to push from decode, and the two meet on the transfer id the router made
up. Prefill answers with no handle (`kv_transfer_params: null`): vLLM's
`request_finished` returns `(delay_free, None)`, and only for a prefill that stopped on
length (`FINISHED_LENGTH_CAPPED`).

Exchange, field by field, as pdgate sends it:

1. Router -> prefill bootstrap, `GET http://<prefill ip>:<port>/query` (port:
   annotation `pdgate.io/mooncake-bootstrap-port`, default 8998; IPv6 in
   brackets), no headers. Answer: `{"<dp_rank>": {"engine_id": str, "worker_addr":
   {"<tp_rank>": {"<pp_rank>": "tcp://<host>:<port>"}}}}`, one entry per
   data-parallel engine, `{}` until a worker registered (newer vLLM adds `tp_size`,
   `pp_size`, shard details; ignored). We need a non-empty object whose chosen entry
   has a non-empty string `engine_id` and a non-empty `worker_addr` object, under a
   decimal `dp_rank`; anything else, and any failed GET (refused, timeout, non-2xx,
   not JSON), is `UpstreamError(reason="bad_bootstrap", retryable=True)`: a problem of
   this prefill pod, so another pair is tried and the client never sees a 4xx for it.
   The rank is the one the router picked when the prefill target is one rank of a
   data-parallel pod (`pdgate.io/data-parallel-size`; an answer without it is
   `bad_bootstrap` too), named as vLLM registers it (`get_mooncake_dp_engine_index`): its
   global rank behind one API server for every rank, its local index where each pod
   (hybrid) has an API server and a bootstrap server of its own; an external rank's own
   servers (API port and bootstrap port + its index on the pod) list it as 0. Else the
   client's `X-data-parallel-rank` if the answer has it, else a random one.
2. Router -> prefill, `POST <call.path>`, headers `call.headers` plus
   `X-data-parallel-rank: <dp_rank>` (pins the prefill to the engine whose id
   decode is given; the reference proxy always sends it). Body is the client's body
   with `stream: false`, `stream_options` removed, `max_tokens: 1`,
   `max_completion_tokens: 1` if sent, `min_tokens: 1` (vLLM only sends the KV of a
   prefill that stopped on length), and
   `kv_transfer_params: {"do_remote_decode": true, "do_remote_prefill": false,
   "transfer_id": "<id>"}`. Launched as a task (`Handoff.prefill_task`).
3. Router -> decode, at once, headers `call.headers`: the client's body plus
   `kv_transfer_params: {"do_remote_decode": false, "do_remote_prefill": true,
   "transfer_id": "<id>", "remote_bootstrap_addr": "http://<prefill ip>:<port>",
   "remote_engine_id": "<engine_id of dp_rank>"}`. Decode needs all three of
   `transfer_id`, `remote_bootstrap_addr` (with `http://`: it GETs
   `remote_bootstrap_addr + "/query"` for an engine id it does not know) and
   `remote_engine_id`, or it silently prefills locally.

`transfer_id` is `xfer-<request id>-<8 hex chars>`: traceable in engine logs, fresh
per attempt so a retry on the same prefill never meets an earlier attempt's state.
If the prefill fails, decode waits for KV until vLLM's timeout: the router must
watch the prefill task and cancel decode (vLLM frees unclaimed prefill blocks after
`VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`, 480 s).

Other routers speak the same fields. vLLM's reference proxy: `/query` once at start,
`transfer_id` `xfer-<uuid4>`, prefill task and decode stream at once, prefill body
without `min_tokens`. vLLM Router 0.1.17 (`--kv-connector mooncake`, observed against
engine_sim): `/query` on every `--prefill URL BOOTSTRAP_PORT` at start (retrying; it
will not start without an answer) and engine ids cached per prefill URL and rank
(rank 0 unless `--intra-node-data-parallel-size` > 1); `transfer_id` `xfer-<uuid4>`;
prefill first and awaited (`max_tokens: 1`, `min_tokens: 1`, `stream: false`, its
`kv_transfer_params` exactly the three fields above), then decode with exactly the
five fields above; both carry `X-Request-Id:
___prefill_addr_<host:port>___decode_addr_<host:port>_<32 hex>` and `Authorization:
Bearer <$OPENAI_API_KEY>`, plus serialized defaults of its request schema
(`logprobs`, `ignore_eos`, `skip_special_tokens`, `separate_reasoning`, ...).

Limits: the bootstrap server is assumed to be on the prefill pod (vLLM's
`bootstrap_server_address` option can move it elsewhere; that is not supported).
`/query` is asked on every attempt rather than cached, so a restarted prefill
engine (new engine ids, same IP) is never addressed by a stale id.
"""

from __future__ import annotations

import asyncio
import random
import secrets
from collections.abc import Mapping
from typing import Any, ClassVar, Final

from kv_connectors._common import (
    DEFAULT_BOOTSTRAP_PORT,
    MOONCAKE_BOOTSTRAP_PORT_ANNOTATION,
    call_port,
    url_host,
    vllm_prefill,
)
from kv_connectors.base import (
    Handoff,
    KVConnector,
    PDCall,
    PodAddress,
    PrefillClient,
    UpstreamError,
)

#: vLLM's header that pins a request to one data-parallel engine.
DP_RANK_HEADER: Final = "X-data-parallel-rank"
#: Longest wait for `/query`: a hung bootstrap server must not eat the whole deadline.
BOOTSTRAP_QUERY_TIMEOUT_S: Final = 5.0


class MooncakeVllmConnector(KVConnector):
    """Concurrent rendezvous on a transfer id, engine ids read from the bootstrap server."""

    name: ClassVar[str] = "mooncake-vllm"

    def __init__(self, bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT) -> None:
        self.bootstrap_port = bootstrap_port

    async def start(self, call: PDCall, client: PrefillClient) -> Handoff:
        """Ask the bootstrap server, launch prefill, return decode's body with the rendezvous."""
        port = call_port(call.annotations, MOONCAKE_BOOTSTRAP_PORT_ANNOTATION, self.bootstrap_port)
        if _own_server(call.prefill):  # an external rank's bootstrap server, as its API's
            port += call.prefill.local_index or 0
        bootstrap_addr = f"http://{url_host(call.prefill.ip)}:{port}"
        answer = await _query(client, call, bootstrap_addr + "/query")
        dp_rank, engine_id = _pick_engine(answer, call)
        transfer_id = f"xfer-{call.request_id}-{secrets.token_hex(4)}"

        prefill = vllm_prefill(
            call.body,
            {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id},
        )
        headers = {k: v for k, v in call.headers.items() if k.lower() != DP_RANK_HEADER.lower()}
        headers[DP_RANK_HEADER] = dp_rank
        task = asyncio.create_task(
            client.post_json(call.prefill, call.path, prefill, headers, call.deadline),
            name=f"mooncake-prefill-{call.request_id}",
        )
        decode = dict(call.body)
        decode["kv_transfer_params"] = {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "transfer_id": transfer_id,
            "remote_bootstrap_addr": bootstrap_addr,
            "remote_engine_id": engine_id,
        }
        return Handoff(decode_body=decode, prefill_task=task)


async def _query(client: PrefillClient, call: PDCall, url: str) -> Any:
    """GET `/query`, with transport failures reported as a bootstrap problem of this pod."""
    deadline = min(call.deadline, asyncio.get_running_loop().time() + BOOTSTRAP_QUERY_TIMEOUT_S)
    try:
        return await client.get_json(url, {}, deadline)
    except UpstreamError as exc:
        # Even a 4xx is this pod's fault (the client sent no part of the GET): retry elsewhere.
        raise UpstreamError(
            "bad_bootstrap",
            "The prefill engine's KV bootstrap server could not be queried.",
            retryable=True,
            status=exc.status,
            pod=call.prefill,
            phase="prefill",
        ) from exc


def _pick_engine(answer: Any, call: PDCall) -> tuple[str, str]:
    """Choose the data-parallel rank to pin, and its engine id, from a `/query` answer:
    the rank the router picked (a target that is one rank of its pod; the answer must
    list it), else the client's, else any."""
    if not isinstance(answer, dict) or not answer:
        raise _bad_bootstrap(call)
    picked = call.prefill.dp_rank
    # vLLM registers a rank under its index among its API server's engines (the rank pin;
    # an external rank's server has one engine, its 0).
    own_index = "0" if _own_server(call.prefill) else call.prefill.rank_pin
    wanted = own_index if picked is not None else _header(call.headers, DP_RANK_HEADER)
    if wanted is not None and wanted.strip() in answer:
        rank = wanted.strip()
    elif picked is not None:
        raise _bad_bootstrap(call)
    else:
        rank = random.choice(sorted(answer))
    entry = answer[rank]
    if not (isinstance(rank, str) and rank.isdecimal() and isinstance(entry, dict)):
        raise _bad_bootstrap(call)
    engine_id = entry.get("engine_id")
    workers = entry.get("worker_addr")
    if not (isinstance(engine_id, str) and engine_id and isinstance(workers, dict) and workers):
        raise _bad_bootstrap(call)
    return rank, engine_id


def _own_server(pod: PodAddress) -> bool:
    """A data-parallel rank with an API server (and a bootstrap server) of its own:
    vLLM's external load balancing, where no header pins it."""
    return pod.dp_rank is not None and pod.rank_pin is None


def _header(headers: Mapping[str, str], name: str) -> str | None:
    """A header's value, whatever case the client spelled it in."""
    lowered = name.lower()
    for key, value in headers.items():
        if key.lower() == lowered:
            return value
    return None


def _bad_bootstrap(call: PDCall) -> UpstreamError:
    return UpstreamError(
        "bad_bootstrap",
        "The prefill engine's KV bootstrap server gave no usable engine.",
        retryable=True,
        pod=call.prefill,
        phase="prefill",
    )
