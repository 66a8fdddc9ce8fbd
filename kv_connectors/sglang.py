"""SGLang PD disaggregation: both engines meet in a router-chosen bootstrap room.

Sources: SGLang's router (sgl-project/sglang, sgl-router/src/routers/http/pd_router.rs
`inject_bootstrap_into_value` / `execute_dual_dispatch_internal`,
sgl-router/src/routers/http/pd_types.rs `get_hostname` / `generate_room_id`,
sgl-router/src/routers/bootstrap_injector.rs) and Kthena's `SGLangConnector`
(volcano-sh/kthena, pkg/kthena-router/connectors/sglang.go).

The prefill engine runs a bootstrap HTTP server (`--disaggregation-bootstrap-port`,
default 8998). The decode engine, once it has the request, connects to it at
`bootstrap_host:bootstrap_port` and registers its KV destination under
`bootstrap_room`; prefill then pushes the KV there. Both requests must be in flight
together: a prefill sent alone waits for a receiver that never comes and aborts.

Exchange, field by field (the same three fields go to both engines):

- `bootstrap_host`: the prefill pod's IP, bare (SGLang's router strips IPv6
  brackets; SGLang adds its own);
- `bootstrap_port`: annotation `pdgate.io/sglang-bootstrap-port`, default 8998
  (SGLang's router sends its configured port, or null for the engine default);
- `bootstrap_room`: a fresh random integer in [0, 2**63) per attempt
  (`secrets.randbits(63)`, as SGLang draws `random.randint(0, 2**63 - 1)`), so a
  retry never meets state an earlier pair left behind.

For a batch (`n > 1`, or a `prompt` / `text` / `input_ids` that is a list of
prompts) each field becomes a list with one entry per sample, each with its own
room, as SGLang's router does: one room serves one sample.

1. Router -> prefill, `POST <call.path>`, headers `call.headers`: the client's
   body plus the three fields, with `stream: false` and `stream_options` removed
   (we read prefill as one JSON object; SGLang's router sends the client's `stream`
   and drains whatever comes). `max_tokens` is left alone, as SGLang's router does:
   an SGLang prefill server stops after the prefill whatever it says. Launched as a
   task (`Handoff.prefill_task`) that the router watches beside decode.
2. Router -> decode, at once: the client's body plus the three fields, unchanged
   otherwise, same headers. Decode's answer is the client's answer.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Mapping
from typing import Any, ClassVar

from kv_connectors._common import (
    DEFAULT_BOOTSTRAP_PORT,
    SGLANG_BOOTSTRAP_PORT_ANNOTATION,
    call_port,
)
from kv_connectors.base import Handoff, KVConnector, PDCall, PrefillClient


class SGLangConnector(KVConnector):
    """Concurrent rendezvous: same room to both engines, prefill runs beside decode."""

    name: ClassVar[str] = "sglang"

    def __init__(self, bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT) -> None:
        self.bootstrap_port = bootstrap_port

    async def start(self, call: PDCall, client: PrefillClient) -> Handoff:
        """Launch prefill with the bootstrap fields and return decode's body at once."""
        port = call_port(call.annotations, SGLANG_BOOTSTRAP_PORT_ANNOTATION, self.bootstrap_port)
        fields = bootstrap_fields(call.body, call.prefill.ip, port)
        prefill = dict(call.body)
        prefill.update(fields)
        prefill["stream"] = False
        prefill.pop("stream_options", None)
        task = asyncio.create_task(
            client.post_json(call.prefill, call.path, prefill, call.headers, call.deadline),
            name=f"sglang-prefill-{call.request_id}",
        )
        decode = dict(call.body)
        decode.update(fields)
        return Handoff(decode_body=decode, prefill_task=task)


def bootstrap_fields(body: Mapping[str, Any], host: str, port: int) -> dict[str, Any]:
    """`bootstrap_host`/`_port`/`_room` for one request, as lists for a batch."""
    size = batch_size(body)
    if size is None:
        return {
            "bootstrap_host": host,
            "bootstrap_port": port,
            "bootstrap_room": secrets.randbits(63),
        }
    return {
        "bootstrap_host": [host] * size,
        "bootstrap_port": [port] * size,
        "bootstrap_room": [secrets.randbits(63) for _ in range(size)],
    }


def batch_size(body: Mapping[str, Any]) -> int | None:
    """How many samples SGLang will run for this body, or None for a single one.

    Follows SGLang's router: `n > 1` first, then a list of prompts. A list of token
    ids is one prompt, a list of strings or of token-id lists is a batch.
    """
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        return n
    for key in ("prompt", "text", "input_ids"):
        value = body.get(key)
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            return len(value)
    return None
