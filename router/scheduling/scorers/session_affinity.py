"""`session-affinity`: keep a conversation on the pod that served its previous turn.

    s_p = 1 if p is the pod the session's previous request was sent to (for this role)
          0 otherwise, and for every pod when the request has no session

- the session is the `x-session-id` request header;
- the session -> pod table is an LRU of at most `SessionTable.max_sessions` entries
  (config `sessions.maxSessions`), updated when a request is dispatched (`picked`).

ttft scale: T x `prefill_s_per_token` (T = prompt tokens): the previous turns sit in that
pod's cache, so at best the whole prompt is saved.
"""

from __future__ import annotations

from router.scheduling.context import Candidates, PickContext
from router.scheduling.scorers.base import Scorer


class SessionAffinityScorer(Scorer):
    type_name = "session-affinity"
    affinity = True

    def score(self, ctx: PickContext, cands: Candidates) -> list[float]:
        session = ctx.session_id()
        sticky = None if session is None else self.deps.sessions.get(ctx.role, session)
        if sticky is None:
            return [0.0] * len(cands)
        return [1.0 if key == sticky else 0.0 for key in cands.keys]

    def scale_s(self, ctx: PickContext, cands: Candidates) -> float:
        return ctx.prompt.token_count() * ctx.cost.prefill_s_per_token

    def picked(self, ctx: PickContext, cands: Candidates, index: int) -> None:
        session = ctx.session_id()
        if session is not None:
            self.deps.sessions.put(ctx.role, session, cands.keys[index])
