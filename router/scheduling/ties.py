"""Drawing one of the tied candidates (step 5 of `pipeline`'s decision): at random with the
scheduler's `random.Random`, or by rendezvous hashing for a prompt no candidate holds a
block of, so that routers sharing state send the same new prompt to the same pod.

Compiled (router/build.py) with the pipeline.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Final

import xxhash

from router.scheduling.context import PickContext

_xxh3 = xxhash.xxh3_64_intdigest
#: A prompt's block hash as an xxh3 seed (an unsigned 64-bit integer).
_SEED_MASK: Final = (1 << 64) - 1
#: Draws one of the tied candidates: (tied indices, every candidate's label) -> index.
Draw = Callable[[list[int], Sequence[str | None]], int]


def draw_below(rng: random.Random) -> Callable[[int], int]:
    """`rng.randrange(n)` for n > 0: the same draws from the same stream, without
    `randrange`'s interpreted frames (two a draw, about 100 opcodes). CPython's `Random`
    draws `randrange(n)` as `getrandbits(n.bit_length())` until the value is below n
    (`_randbelow_with_getrandbits`); seeded schedulers, and the decisions pinned in
    `tests/fixtures/`, see the same picks (`test_draw_below_draws_what_randrange_draws`)."""
    getrandbits = rng.getrandbits

    def below(n: int) -> int:
        if n <= 0:
            raise ValueError("empty range for a draw")
        bits = n.bit_length()
        value = getrandbits(bits)
        while value >= n:
            value = getrandbits(bits)
        return value

    return below


def at_random(rng_index: Callable[[int], int]) -> Draw:
    """Ties drawn with the scheduler's `random.Random`."""
    return lambda ties, labels: ties[rng_index(len(ties))]


def tie_breaker(
    ctx: PickContext, depths: list[int] | None, rng_index: Callable[[int], int]
) -> Draw:
    """How ties are drawn: at random, except for a prompt no candidate holds a block of,
    which goes to the tied candidate ranked first for it by rendezvous hashing (highest
    xxh3 of the candidate's name, seeded with the prompt's first approximate block hash).

    Routers that share state through `router.sync` (workers, replicas) learn where a
    prompt went a few ms late: in the meantime each has placed its own requests, so their
    tied sets may differ by a pod one of them just made busy. A rendezvous ranking is the
    same whatever the set: both still send the prompt to the same pod unless the pod only
    one of them sees as tied is the prompt's first choice (an index drawn modulo the number
    of ties would agree only by chance once the sets differ). Different prompts rank the
    pods differently, so new prompts still spread. In one process the second request sees
    the first's record anyway."""
    if not depths or max(depths) > 0:
        return at_random(rng_index)
    hashes = ctx.prompt.approx_hashes()
    if not hashes:
        return at_random(rng_index)
    seed = hashes[0] & _SEED_MASK

    def rendezvous(ties: list[int], labels: Sequence[str | None]) -> int:
        best, top = ties[0], -1
        for i in ties:
            rank = _xxh3((labels[i] or "").encode(), seed)
            if rank > top:
                best, top = i, rank
        return best

    return rendezvous


def choose(
    draw: Draw, costs: Sequence[float], tolerance: float, labels: Sequence[str | None]
) -> int:
    """The candidate chosen among all: the cheapest, ties (within `tolerance`) drawn."""
    return _among(range(len(costs)), costs, tolerance, draw, labels)


def within(
    groups: list[str | None],
    costs: list[float],
    group: str | None,
    tolerance: float,
    draw: Draw,
    labels: Sequence[str | None],
) -> int:
    """The candidate chosen among `group`'s members (a PD pair's side), ties drawn."""
    members = [i for i, name in enumerate(groups) if name == group]
    return _among(members, costs, tolerance, draw, labels)


def _among(
    indices: Sequence[int], costs: Sequence[float], tolerance: float, draw: Draw,
    labels: Sequence[str | None],
) -> int:
    limit = min([costs[i] for i in indices]) + tolerance
    ties = [i for i in indices if costs[i] <= limit]
    return ties[0] if len(ties) == 1 else draw(ties, labels)
