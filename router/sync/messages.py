"""The frames router processes exchange: one msgpack array per frame.

    [origin, host_id, seq, [message, ...]]

`seq` counts the origin's frames, so a receiver sees a gap when the transport dropped
some (ZMQ PUB drops at its high-water mark rather than block): `dropped` in the metrics.
A frame batches every message one event-loop turn produced. Messages, tagged by kind:

    (INFLIGHT, pod, count, backlog_s) the origin now has `count` requests on `pod`, and
                                      `backlog_s` seconds of prefill it sent there that
                                      it predicts are not done (`PrefillBacklog`)
    (ROUTE, pod, [hash, ...])         the origin sent a prompt with these approximate
                                      block hashes to `pod` (approximate prefix index)
    (EJECT, pod, backoff_s)           the origin ejected `pod` for `backoff_s` (0: readmitted)
    (ENGINE, pod, running, waiting, kv_usage, capacity_tokens, at)
                                      the origin scraped `pod`'s engine (same host only:
                                      `at` is the host's monotonic clock)
    (HEARTBEAT, {pod: count, ...}, {pod: backlog_s, ...})
                                      the origin is alive; its whole in-flight report:
                                      counts, and backlogs where not 0 (a receiver takes
                                      a heartbeat without the backlogs, from an older
                                      router, for the counts alone)
    (PLACE, leader, ask, server, model, path, flow, body)
                                      the origin asks `leader` to place a new prompt's
                                      request (`ask`: the origin's number for it)
    (PLACED, asker, ask, [pod, ...])  `leader`'s answer to `asker` (no pods: none)
    (PREFILLING, pod, [hash, ...], ready_in_s)
                                      the origin sent a prompt with these approximate
                                      block hashes to `pod` for the precise index, its
                                      prefill predicted to end in `ready_in_s` seconds
                                      (`InFlightPrefixes`: until the engine's KV events)
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

INFLIGHT: Final = 0
ROUTE: Final = 1
EJECT: Final = 2
ENGINE: Final = 3
HEARTBEAT: Final = 4
PLACE: Final = 5
PLACED: Final = 6
PREFILLING: Final = 7

Message = tuple[Any, ...]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(tuple[str, str, int, list[list[Any]]])


def encode(origin: str, host_id: str, seq: int, messages: list[Message]) -> bytes:
    return _encoder.encode((origin, host_id, seq, messages))


def decode(frame: bytes) -> tuple[str, str, int, list[list[Any]]]:
    """Raises `msgspec.DecodeError` (a `ValueError`) on a frame that is not ours."""
    return _decoder.decode(frame)
