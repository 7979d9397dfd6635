"""`StepPlan`: what one engine step does, decided once, before any of it runs.

An engine step moves through two phases. The plan phase sees host facts only (the scheduler's
token counts, the longest context, which path prepared the inputs) and produces one frozen
`StepPlan`; the run phase (attention metadata, the forward, the logits) reads that plan and
nothing else. Nothing the run phase does changes the plan: a capture that fails is reported in
the `Decision` `DecodeGraphRunner.run` returns, not written back.

A step's kind is one of a fixed set, the label its replays and fallbacks are counted under:

kind    | what the scheduler sent
------- | --------------------------------------------------------------------------------------
decode  | one query token per request (no draft tokens, no cascade attention, not forced eager)
prefill | every request brings more than one query token (a prompt or a chunk of one)
mixed   | anything else: prefill chunks next to decode rows

No vLLM import: the integration layer builds plans from vLLM's arguments.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import numpy as np

from vllm_moe_graphs.graphs.runner import Action, Decision


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


@dataclasses.dataclass(frozen=True, slots=True)
class StepPlan:
    """One engine step, as planned (see the module docstring).

    `decision` is the graph runner's (replay, capture, warm-up or eager with a reason);
    `max_context` the longest sequence the step attends over (0 when not a decode step);
    `fast_inputs` whether the plugin prepared the inputs (`DecodeInputs`) rather than vLLM;
    `with_logits` whether the forward computes the logits (the LM head inside the graph);
    `lean` whether the step builds no attention metadata (a replay reads the persistent
    buffers in place)."""

    kind: StepKind
    decision: Decision
    max_context: int
    fast_inputs: bool = False
    with_logits: bool = False
    lean: bool = False

    @property
    def graph_path(self) -> bool:
        """The forward runs at the key's padded size: replay, capture or a warm-up step."""
        d = self.decision
        return d.key is not None and (d.action is not Action.EAGER or d.warming_up)

    @property
    def padding(self) -> tuple[int, int, bool] | None:
        """(tokens, requests, uniform decode) vLLM pads the step to on a graph path: the
        decode key's rows, or the token and request buckets of a key with prefill tokens.
        None: unpadded, vLLM's own sizes."""
        if not self.graph_path:
            return None
        key = self.decision.key
        if key.decode:
            return key.batch_bucket, key.batch_bucket, True
        return key.batch_bucket, key.request_bucket, False
