"""`StepKind`: the fixed set of engine step kinds, the `kind` label of the plugin's replay and
fallback counters.

kind    | what the scheduler sent
------- | --------------------------------------------------------------------------------------
decode  | one query token per request (no draft tokens, no cascade attention, not forced eager)
prefill | every request brings more than one query token (a prompt or a chunk of one)
mixed   | anything else: prefill chunks next to decode rows
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np


class StepKind(str, enum.Enum):
    DECODE = "decode"
    MIXED = "mixed"
    PREFILL = "prefill"


def step_kind(num_tokens: int, num_reqs: int, max_query_len: int,
              query_lens: Sequence[int] | None = None) -> StepKind:
    """The kind of a step of `num_reqs` requests and `num_tokens` query tokens; `query_lens`
    (per request, at least `num_reqs` long) tells prefill from mixed (without: mixed)."""
    if max_query_len == 1 and num_tokens == num_reqs:
        return StepKind.DECODE
    if query_lens is not None and num_reqs and int(np.min(query_lens[:num_reqs])) > 1:
        return StepKind.PREFILL
    return StepKind.MIXED
