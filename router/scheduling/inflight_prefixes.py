"""Prompts on their way into a pod's cache: what the precise index cannot know yet.

The precise index learns what a pod holds from the engine's KV events, and an engine
publishes a block once its prefill has stored it (vLLM's `BlockStored`, sent after the
step that computed the block). A prompt routed while an earlier one with the same prefix
is still queued or prefilling on pod X finds nothing on X, so it is placed as a miss: on
an idle pod, where its prefix is computed a second time and its group now occupies two
caches. On the scheduling tests' shared-prefix workload (8 system prompts of ~1,100
tokens, 12 questions each, 6 at a time on 3 prefill pods holding ~3.5 system prompts)
this split groups in every run and cost 2-15 points of hit rate (0.74-0.87 of a best
0.88). The approximate index never had the gap: it records a prompt at dispatch.

So the `precise-prefix-cache` scorer records each prompt it places here, by its
approximate block hashes (`block_hash.approximate_block_hashes`: rendered bytes, no
tokenizer, already chained so that equal keys at a position mean an equal prefix), for
the chosen pod, until the prefill is predicted to end plus `EVENT_GRACE_S`. A later
prompt's in-flight depth on pod p is the longest leading run of its approximate hashes
that one of p's live records shares; the scorer counts max(depth from events, in-flight
depth) for p. Once the engine's events arrive they are the truth again (exact, evictions
included), and the record lapses.

Records are kept per (first block, pod), the newest `PER_POD` of each: a lookup costs the
candidates x `PER_POD` comparisons whatever else is in flight (at a thousand requests a
second behind one system prompt, a thousand records would share the first block). Bound:
`MAX_RECORDS` records and `MAX_RECORDED_BLOCKS` block hashes in all (the oldest records
are dropped first; a prompt's hashes number up to the approximate index's
`maxPromptBlocks`); lapsed ones are dropped as new ones arrive and skipped by lookups.

With several router processes (`router.sync`), `listener` hears every local record and
the others apply it (`apply_remote`): a prompt one worker or replica sent is in flight to
that pod in every process's view until its events come, as in one process. Without it a
sibling saw the pod busy with that prompt (its in-flight count is shared) and nothing of
its prefix, and sent the next prompt of the group to another pod. What a pod has stored
needs no sync: every process reads the engines' own events.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Final

#: Bound on the prompts recorded at once (one per dispatched request until its prefill's
#: predicted end + `EVENT_GRACE_S`: thousands only at thousands of prefills in flight).
MAX_RECORDS: Final = 4096
#: Bound on the block hashes those records hold together (about 36 bytes each).
MAX_RECORDED_BLOCKS: Final = 1 << 20
#: Records kept per pod for one opening block, the newest: prompts behind one system prompt
#: share it with all of them, and a conversation's next turn rarely leaves within a second.
PER_POD: Final = 4
#: How long a record outlives its prefill's predicted end: the engine's KV events for the
#: blocks (published when the step that computed them ends), the router reading them, and
#: a prediction that was short.
EVENT_GRACE_S: Final = 1.0


class _Record:
    __slots__ = ("expires", "hashes", "pod")

    def __init__(self, pod: str, hashes: list[int], expires: float) -> None:
        self.pod = pod
        self.hashes = hashes
        self.expires = expires


class InFlightPrefixes:
    """Per dispatched prompt: (pod, approximate block hashes, expiry)."""

    __slots__ = ("_blocks", "_by_first", "_order", "listener")

    def __init__(self) -> None:
        self._by_first: dict[int, dict[str, deque[_Record]]] = {}
        self._order: deque[_Record] = deque()
        self._blocks = 0  # hashes held by the records in `_order`
        #: Hears each local record: (pod, hashes, seconds until its prefill's predicted end).
        self.listener: Callable[[str, list[int], float], None] | None = None

    def record(self, pod: str, hashes: list[int], ready_at: float, now: float,
               share: bool = True) -> None:
        """The prompt of `hashes` was sent to `pod`; its prefill is predicted to end at
        `ready_at`. `share`: tell `listener` (the other router processes); not for the
        pick made for another process, which records it itself when it sends the request."""
        if not hashes:
            return
        self.apply_remote(pod, hashes, ready_at - now, now)
        if share and self.listener is not None:
            self.listener(pod, hashes, max(0.0, ready_at - now))

    def apply_remote(self, pod: str, hashes: list[int], ready_in_s: float, now: float) -> None:
        """Another router process sent this prompt to `pod`, its prefill predicted to end
        `ready_in_s` from now (`record` without telling `listener`; a duration, not a
        time, because the sender's clock may be another host's)."""
        if not hashes:
            return
        ready_at = now + ready_in_s
        self._expire(now)
        if len(hashes) > MAX_RECORDED_BLOCKS:
            hashes = hashes[:MAX_RECORDED_BLOCKS]
        order = self._order
        while order and (len(order) >= MAX_RECORDS
                         or self._blocks + len(hashes) > MAX_RECORDED_BLOCKS):
            self._drop(order.popleft())
        rec = _Record(pod, hashes, max(ready_at, now) + EVENT_GRACE_S)
        order.append(rec)
        self._blocks += len(hashes)
        pods = self._by_first.get(hashes[0])
        if pods is None:
            pods = self._by_first[hashes[0]] = {}
        recent = pods.get(pod)
        if recent is None:
            recent = pods[pod] = deque()
        elif len(recent) >= PER_POD:
            recent.popleft()  # still in `_order`, where `_drop` finds it gone already
        recent.append(rec)

    def depths(self, pods: Sequence[str], hashes: list[int], now: float) -> list[int] | None:
        """Per pod in `pods`: the leading blocks of `hashes` one of its live records
        shares; None when none shares even the first block (the common case, one dict
        lookup)."""
        if not hashes:
            return None
        by_pod = self._by_first.get(hashes[0])
        if by_pod is None:
            return None
        out: list[int] = []
        found = False
        for pod in pods:
            best = 0
            recent = by_pod.get(pod)
            if recent is not None:
                for rec in recent:
                    if rec.expires > now:
                        depth = _common(rec.hashes, hashes)
                        if depth > best:
                            best = depth
            out.append(best)
            if best:
                found = True
        return out if found else None

    def _expire(self, now: float) -> None:
        order = self._order
        while order and order[0].expires <= now:
            self._drop(order.popleft())

    def _drop(self, rec: _Record) -> None:
        """Forget `rec`, just taken out of `_order`."""
        self._blocks -= len(rec.hashes)
        first = rec.hashes[0]
        by_pod = self._by_first.get(first)
        if by_pod is None:
            return
        recent = by_pod.get(rec.pod)
        if recent is None or rec not in recent:
            return
        recent.remove(rec)
        if not recent:
            del by_pod[rec.pod]
            if not by_pod:
                del self._by_first[first]

    def __len__(self) -> int:
        return len(self._order)

    @property
    def blocks(self) -> int:
        """Block hashes the records hold (bounded by `MAX_RECORDED_BLOCKS`)."""
        return self._blocks


def _common(a: list[int], b: list[int]) -> int:
    """Length of the common leading run of two chained hash lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
