"""`StepPlan`: what one engine step does, decided once, before any of it runs.

An engine step moves through two phases. The plan phase sees host facts only (the scheduler's
token counts, the longest context, which path prepared the inputs) and produces one frozen
`StepPlan`; the run phase (attention metadata, the forward, the logits) reads that plan and
nothing else. Nothing the run phase does changes the plan: a capture that fails is reported in
the `Decision` `DecodeGraphRunner.run` returns, not written back.

A step's kind (`graphs/kinds.py`) is the label its replays and fallbacks are counted under.

No vLLM import: the integration layer builds plans from vLLM's arguments.
"""

from __future__ import annotations

import dataclasses

from vllm_moe_graphs.graphs.buckets import GraphKey
from vllm_moe_graphs.graphs.kinds import StepKind
from vllm_moe_graphs.graphs.decision import Decision


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
    def padding(self) -> tuple[int, int, bool] | None:
        """`key_padding` of the decision's key when the decision is `padded` (graph paths,
        warm-up, a graphable key's fallbacks); None: unpadded, vLLM's own sizes."""
        return key_padding(self.decision.key) if self.decision.padded else None


def key_padding(key: GraphKey) -> tuple[int, int, bool]:
    """(tokens, requests, uniform decode) vLLM pads a step of `key` to: the decode key's rows,
    or the token bucket and padded requests of a key with prefill tokens."""
    if key.decode:
        return key.batch_bucket, key.batch_bucket, True
    return key.batch_bucket, key.request_bucket, False


@dataclasses.dataclass(slots=True)
class StepScope:
    """The one engine step in flight (inside `execute_model`): which path prepared its inputs,
    then its plan until the forward takes it."""

    fast_inputs: bool = False
    plan: StepPlan | None = None
