"""Bounds on the sampling fields of a request, checked before any pod is chosen.

The gateway refuses with a 400 naming the field (`param`) what no engine would serve,
and what would let one request multiply the work it asks for: `n: 1000` is a thousand
completions, `top_logprobs: 100000` a response the size of the vocabulary per token.

The bounds follow OpenAI's API and vLLM's checks (`SamplingParams._verify_args` and the
request models in vllm/entrypoints/openai/protocol.py), and take the stricter side only
where the value would be an amplification:

- `n`: 1..128 (OpenAI's maximum; vLLM allows up to VLLM_MAX_N_SEQUENCES, 16384);
- `best_of`: 1..20 (OpenAI's maximum) and at least `n`;
- `top_logprobs`, `prompt_logprobs` and a completion's `logprobs`: 0..20 (OpenAI's
  maximum, and vLLM's default `--max-logprobs`; vLLM's -1, "the whole vocabulary", is
  refused); a chat request's `logprobs` is a boolean;
- `temperature` >= 0; `top_p` in (0, 1]; `min_p` in [0, 1]; `top_k` >= -1 (-1 and 0:
  off); `presence_penalty` and `frequency_penalty` in [-2, 2]; `seed` a 64-bit signed
  integer. (`max_tokens` and `min_tokens` are token counts, checked by request.py.)

A field that is absent or null is the engine's default and is not checked. Fields not
listed pass through untouched (the engine checks them, and says so in its own 400).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

from router.errors import bad_request

#: Most completions one request may ask for (`n`): OpenAI's maximum.
MAX_N: Final = 128
#: Most candidates a completion may be drawn from (`best_of`): OpenAI's maximum.
MAX_BEST_OF: Final = 20
#: Most log-probabilities per token (`top_logprobs`, `logprobs`, `prompt_logprobs`).
MAX_LOGPROBS: Final = 20
_INT64: Final = (-(2**63), 2**63 - 1)


@dataclass(frozen=True, slots=True)
class Bound:
    """An integer or number in [lo, hi] (`lo_open`: lo itself excluded); None: unbounded."""

    integer: bool
    lo: int | float | None = None  # an int stays exact (mypyc would make a float a double)
    hi: int | float | None = None
    lo_open: bool = False

    def check(self, name: str, value: object) -> None:
        # Integers are compared as integers: a float holds 2**63 - 1 as 2**63. (Compiled,
        # a value typed `float` is a C double, so nothing here is typed `float` alone.)
        if isinstance(value, bool) or not isinstance(value, int | float) or (
            self.integer and not isinstance(value, int)
        ):
            ok = False
        elif isinstance(value, float) and not math.isfinite(value):
            ok = False
        else:
            lo, hi = self.lo, self.hi
            ok = (lo is None or (value > lo if self.lo_open else value >= lo)) and (
                hi is None or value <= hi
            )
        if not ok:
            kind = "an integer" if self.integer else "a number"
            raise bad_request(f"`{name}` must be {kind}{self.describe()}.", param=name)

    def describe(self) -> str:
        lo, hi = _text(self.lo), _text(self.hi)
        if self.lo is not None and self.hi is not None:
            if self.lo_open:
                return f" greater than {lo} and at most {hi}"
            return f" between {lo} and {hi}"
        if self.lo is not None:
            return f" greater than {lo}" if self.lo_open else f" of at least {lo}"
        if self.hi is not None:
            return f" of at most {hi}"
        return ""

    def schema(self) -> dict[str, Any]:
        """The JSON Schema of the bound (for the OpenAPI document)."""
        out: dict[str, Any] = {"type": "integer" if self.integer else "number"}
        if self.lo is not None:
            out["exclusiveMinimum" if self.lo_open else "minimum"] = self.lo
        if self.hi is not None:
            out["maximum"] = self.hi
        return out


def _text(value: int | float | None) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


#: Fields of both endpoints, by name.
BOUNDS: Final[dict[str, Bound]] = {
    "n": Bound(True, 1, MAX_N),
    "best_of": Bound(True, 1, MAX_BEST_OF),
    "top_logprobs": Bound(True, 0, MAX_LOGPROBS),
    "prompt_logprobs": Bound(True, 0, MAX_LOGPROBS),
    "temperature": Bound(False, 0),
    "top_p": Bound(False, 0, 1, lo_open=True),
    "min_p": Bound(False, 0, 1),
    "top_k": Bound(True, -1),
    "presence_penalty": Bound(False, -2, 2),
    "frequency_penalty": Bound(False, -2, 2),
    "seed": Bound(True, *_INT64),
}
#: A completion's `logprobs` counts log-probabilities; a chat request's is a boolean.
COMPLETION_LOGPROBS: Final = Bound(True, 0, MAX_LOGPROBS)


def check_sampling(body: dict[str, Any], chat: bool) -> None:
    """Raise a 400 naming the first field of `body` outside its bound."""
    for name, value in body.items():
        if value is None:
            continue
        bound = BOUNDS.get(name)
        if bound is not None:
            bound.check(name, value)
        elif name == "logprobs":
            if not chat:
                COMPLETION_LOGPROBS.check(name, value)
            elif not isinstance(value, bool):
                raise bad_request("`logprobs` must be a boolean.", param="logprobs")
    best_of = body.get("best_of")
    if best_of is not None:
        n = body.get("n")
        n = 1 if n is None else n
        if best_of < n:
            raise bad_request(f"`best_of` must be at least `n` ({n}).", param="best_of")


__all__ = [
    "BOUNDS", "COMPLETION_LOGPROBS", "MAX_BEST_OF", "MAX_LOGPROBS", "MAX_N", "Bound",
    "check_sampling",
]
