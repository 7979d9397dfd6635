"""StepPlan and step kinds: what the plan phase hands the run phase (CPU, no vLLM)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from vllm_moe_graphs.capability import Reason
from vllm_moe_graphs.graphs import Action, Decision, GraphKey
from vllm_moe_graphs.graphs.kinds import StepKind, step_kind
from vllm_moe_graphs.graphs.plan import StepPlan


@pytest.mark.parametrize("tokens,reqs,max_q,lens,kind", [
    (4, 4, 1, [1, 1, 1, 1], StepKind.DECODE),
    (4, 4, 1, None, StepKind.DECODE),
    (12, 2, 8, [8, 4], StepKind.PREFILL),
    (9, 2, 8, [8, 1], StepKind.MIXED),
    (9, 2, 8, None, StepKind.MIXED),  # lengths unknown: not provably prefill
    (5, 1, 5, np.array([5, 0, 0], dtype=np.int32), StepKind.PREFILL),  # padded array
])
def test_step_kind(tokens, reqs, max_q, lens, kind):
    assert step_kind(tokens, reqs, max_q, lens) is kind


def test_plan_pads_graph_paths_and_kept_shape_fallbacks():
    key, mixed = GraphKey(4, 16), GraphKey(64, 0, 8)
    cases = [
        (Decision(Action.REPLAY, key, Reason.ELIGIBLE, 3), (4, 4, True)),
        (Decision(Action.CAPTURE, key, Reason.ELIGIBLE, 3), (4, 4, True)),
        (Decision(Action.EAGER, key, Reason.ELIGIBLE, 3), (4, 4, True)),  # warm-up, padded
        # fallbacks of a graphable key keep its shape: they compute what its graph would
        (Decision(Action.EAGER, key, Reason.MEMORY_BUDGET, 4), (4, 4, True)),
        (Decision(Action.EAGER, key, Reason.KILL_SWITCH, 3), (4, 4, True)),
        (Decision(Action.EAGER, None, Reason.KILL_SWITCH, 3), None),  # no key: unpadded
        # storage and capability fallbacks: vLLM's own unpadded step
        (Decision(Action.EAGER, key, Reason.STORAGE_IDENTITY_CHANGED, 3), None),
        (Decision(Action.EAGER, key, Reason.NO_CUDA, 3), None),
        (Decision(Action.EAGER, None, Reason.MIXED_BATCH, 7), None),
        # a key with prefill tokens: its token bucket and padded requests, not a uniform decode
        (Decision(Action.REPLAY, mixed, Reason.ELIGIBLE, 50), (64, 8, False)),
        (Decision(Action.EAGER, mixed, Reason.CAPTURE_FAILED, 50), (64, 8, False)),
    ]
    for decision, padding in cases:
        plan = StepPlan(StepKind.DECODE, decision, max_context=10)
        assert plan.padding == padding, decision
        assert decision.padded is (padding is not None)
        assert decision.batch_size == (padding[0] if padding else decision.num_reqs), decision


def test_plan_is_frozen():
    plan = StepPlan(StepKind.MIXED, Decision(Action.EAGER, None, Reason.MIXED_BATCH, 2), 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.lean = True  # type: ignore[misc]
