"""The one check of client-sent token ids: the completion prompt, embeddings input and
detokenize tokens all take arrays of them.

An id is an `int` (not a bool, not a float) in 0..`MAX_TOKEN_ID`: vLLM keeps ids as
int32, so nothing larger can name a token of any vocabulary. An id inside that range but
past the model's vocabulary is the engine's own 400 ("Token id N is out of vocabulary");
one outside it is answered by the router, so it never reaches an engine as a prefill to
fail and retry on every pod. Compiled with the request path (router/build.py): a prompt
may carry a hundred thousand ids.
"""

from __future__ import annotations

from typing import Any, Final

MAX_TOKEN_ID: Final = 2**31 - 1


def are_token_ids(values: list[Any]) -> bool:
    """True when every item is a token id (an empty list passes: callers bound length)."""
    for value in values:
        if type(value) is not int or not 0 <= value <= MAX_TOKEN_ID:
            return False
    return True
