"""`patch/model_layer_range.py`: the start-up warm-up's fused-MoE token counts run only the
layers up to the first MoE layer, against vLLM 0.26's real Qwen3 / Qwen3-MoE models (CPU
build) and their real decoder-stack classes."""

from __future__ import annotations

import pytest
import torch

from tests.serve_util import run_on_tiny_qwen3_moe
from vllm_moe_graphs.integration.patch.model_layer_range import (
    decoder_stack,
    first_moe_layer_only,
)


def _stack(cls: type, moe_at: tuple[int, ...], layers: int = 3) -> torch.nn.Module:
    """An instance of vLLM's decoder-stack class `cls` (its real `forward`), built without its
    engine-bound `__init__`: `layers` layers, a vLLM `MoERunner` in those at `moe_at`."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    def layer(moe: bool) -> torch.nn.Module:
        module = torch.nn.Module()
        if moe:
            runner = MoERunner.__new__(MoERunner)
            torch.nn.Module.__init__(runner)
            module.experts = runner
        return module

    stack = cls.__new__(cls)
    torch.nn.Module.__init__(stack)
    stack.layers = torch.nn.ModuleList(layer(i in moe_at) for i in range(layers))
    stack.start_layer, stack.end_layer = 0, layers
    return stack


def test_the_range_is_cut_after_the_first_moe_layer_and_restored():
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeModel

    model = torch.nn.Module()
    model.model = _stack(Qwen3MoeModel, moe_at=(1, 2))
    assert decoder_stack(model) is model.model
    with first_moe_layer_only(model) as depth:
        assert depth == 2 and model.model.end_layer == 2
    assert model.model.end_layer == 3
    with pytest.raises(ValueError, match="inside"):
        with first_moe_layer_only(model):
            raise ValueError("inside")
    assert model.model.end_layer == 3


def test_nothing_is_cut_without_an_moe_layer_or_a_decoder_stack():
    from vllm.model_executor.models.qwen3 import Qwen3Model

    dense = _stack(Qwen3Model, moe_at=())
    for model in (dense, torch.nn.Linear(2, 2), lambda input_ids, **_: input_ids):
        with first_moe_layer_only(model) as depth:
            assert depth is None
    assert dense.end_layer == 3


def test_a_stack_whose_forward_does_not_read_end_layer_is_left_alone():
    """A decoder stack of another layout (its forward runs every layer whatever `end_layer`
    says) is not taken for one that honours the cut."""

    class EveryLayer(torch.nn.Module):
        def forward(self, hidden):
            for layer in self.layers:
                hidden = layer(hidden)
            return hidden

    stack = _stack(EveryLayer, moe_at=(0,))
    assert decoder_stack(stack) is None
    with first_moe_layer_only(stack) as depth:
        assert depth is None and stack.end_layer == 3


def test_a_torch_compiled_stack_is_left_alone():
    """vLLM's `@support_torch_compile` stack with compilation on runs its compiled forward,
    which does not see `end_layer` change: no cut."""
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeModel

    stack = _stack(Qwen3MoeModel, moe_at=(0,))
    stack.do_not_compile = False
    with first_moe_layer_only(stack) as depth:
        assert depth is None and stack.end_layer == 3
    stack.do_not_compile = True  # compilation mode NONE, as the plugin's take-over sets
    with first_moe_layer_only(stack) as depth:
        assert depth == 1 and stack.end_layer == 1


def test_prefetch_offload_keeps_every_layer(monkeypatch):
    """vLLM's prefetch offloader hooks every layer of a forward in turn: no cut there."""
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeModel
    from vllm.model_executor.offloader import base
    from vllm.model_executor.offloader.prefetch import PrefetchOffloader

    stack = _stack(Qwen3MoeModel, moe_at=(0, 1, 2))
    monkeypatch.setattr(base, "_instance", PrefetchOffloader.__new__(PrefetchOffloader))
    with first_moe_layer_only(stack) as depth:
        assert depth is None and stack.end_layer == 3


_FORWARD = r"""
from vllm_moe_graphs.integration.patch.model_layer_range import first_moe_layer_only

ran = []
for i, layer in enumerate(model.model.layers):  # a spy in place of each layer's forward
    layer.forward = lambda positions, hidden, residual, i=i: (
        ran.append(i), (hidden, hidden if residual is None else residual))[1]
ids = torch.arange(5)
runs = {}
with set_current_vllm_config(vc):
    model.model(ids, ids)
    runs["full"], ran[:] = list(ran), []
    with first_moe_layer_only(model) as depth:
        model.model(ids, ids)
    runs["cut"], ran[:] = list(ran), []
    model.model(ids, ids)
    runs["after"] = list(ran)
print("RESULT " + json.dumps({"runs": runs, "depth": depth, "end_layer": model.model.end_layer,
                              "do_not_compile": model.model.do_not_compile}))
"""


def test_vllms_qwen3_moe_forward_runs_up_to_the_first_moe_layer_only(cpu_vllm) -> None:
    """vLLM's own Qwen3-MoE model (4 layers, layer 0 dense through `mlp_only_layers`): inside
    the block its forward runs layers 0 and 1 (the first MoE layer), and every layer again
    after it."""
    # 4 layers, layer 0 dense; compilation mode NONE, as the take-over sets it
    result = run_on_tiny_qwen3_moe(_FORWARD, cpu_vllm, compilation_mode="NONE",
                                   num_hidden_layers=4, mlp_only_layers=[0], num_experts=8,
                                   num_experts_per_tok=2)
    assert result == {"runs": {"full": [0, 1, 2, 3], "cut": [0, 1], "after": [0, 1, 2, 3]},
                      "depth": 2, "end_layer": 4, "do_not_compile": True}, result
