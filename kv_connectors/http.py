"""Plain HTTP prefill-then-decode, with no KV handle passed between the two.

For KV stores that both engines reach by themselves (LMCache or Mooncake Store
backends, shared prefix caches): prefill writes the KV cache, decode finds it by its
own lookup. The router's only job is ordering. This is Kthena's `HTTPConnector`
(volcano-sh/kthena, pkg/kthena-router/connectors/http.go and `preparePrefillBody`
in transport.go), which Kthena also uses for `lmcache`.

Exchange, field by field:

1. Router -> prefill, `POST <call.path>`, headers `call.headers`; body is the
   client's body with:
   - `stream`: `false` (Kthena deletes the key; absent means false, we say it);
   - `stream_options`: removed;
   - `max_tokens`: `1`;
   - `max_completion_tokens`: `1`, only if the client sent the field;
   - `min_tokens`: `1`, only if the client sent more than 1 (vLLM rejects
     `min_tokens > max_tokens`; Kthena leaves it, and the prefill then fails);
   - every other field unchanged.
   The answer (a one-token completion) is read and dropped.
2. Router -> decode, once prefill answered 2xx: the client's body unchanged, same
   headers. (Kthena also adds `stream_options.include_usage` / `include_usage` for
   its token accounting; that is the router's business, not this protocol's.)

A failed prefill fails the attempt (the client's `UpstreamError` from `post_json`).
"""

from __future__ import annotations

from typing import ClassVar

from kv_connectors._common import one_token_prefill
from kv_connectors.base import Handoff, KVConnector, PDCall, PrefillClient


class HTTPConnector(KVConnector):
    """Prefill first, then decode the untouched request; the engines share the KV."""

    name: ClassVar[str] = "http"

    async def start(self, call: PDCall, client: PrefillClient) -> Handoff:
        """Run the one-token prefill to completion, then hand decode the client's body."""
        await client.post_json(
            call.prefill, call.path, one_token_prefill(call.body), call.headers, call.deadline
        )
        return Handoff(decode_body=dict(call.body))
