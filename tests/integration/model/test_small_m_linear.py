"""The opt-in small-M GEMM wiring (`integration/model/small_m_linear.py`) on a real vLLM Qwen3
model (CPU build of vLLM, kernels under the Triton interpreter, float32): which layers get it,
that decode sized inputs take the kernel and prefill sized ones vLLM's GEMM, with the same
results."""

from __future__ import annotations

import pytest

from tests.serve_util import run_result_script
from vllm_moe_graphs.config import PluginConfig

_BUILD = r"""
import json, os, sys, tempfile
import torch
from transformers import Qwen3Config
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm_moe_graphs.integration.model.small_m_linear import (
    SmallMLinearMethod, install_small_m_gemm)

path = tempfile.mkdtemp()
Qwen3Config(architectures=["Qwen3ForCausalLM"], vocab_size=128, hidden_size=64,
            intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=256).save_pretrained(path)
vc = VllmConfig(model_config=ModelConfig(model=path, skip_tokenizer_init=True, dtype="float32"))
with set_current_vllm_config(vc):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{sys.argv[1]}")
    initialize_model_parallel(1, 1)
    model = Qwen3ForCausalLM(vllm_config=vc, prefix="")
gen = torch.Generator().manual_seed(0)
with torch.no_grad():
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
# What vLLM's CPU loader does after loading, keeping the weight (its default drops it into a
# packed kernel, which the small-M GEMM rightly refuses): the real CPU GEMM for the fallback.
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
for m in model.modules():
    if isinstance(m, LinearBase):
        dispatch_cpu_unquantized_gemm(m, remove_weight=False)
methods = install_small_m_gemm(model)
out = {"names": sorted(methods), "workspace": None, "layers": {}}
shared = {id(m.workspace) for m in methods.values()}
out["one_workspace"] = len(shared) == 1
modules = dict(model.named_modules())
for name, method in sorted(methods.items()):
    layer = modules[name]
    k = layer.weight.shape[1]
    row = {"is_unquantized": isinstance(layer.quant_method, UnquantizedLinearMethod),
           "splits": method.small_m_config.num_splits}
    for m in (1, 3, 16, 20):
        x = torch.randn(m, k, generator=gen)
        before = method.small_m_calls
        with torch.no_grad():
            y = layer(x)
        y = y[0] if isinstance(y, tuple) else y
        ref = torch.nn.functional.linear(x, layer.weight)
        row[f"m{m}"] = {"kernel": method.small_m_calls - before,
                        "max_err": float((y - ref).abs().max())}
    # a row's result does not depend on the rows that came with it
    x = torch.randn(16, k, generator=gen)
    with torch.no_grad():
        a = layer(x[:1])
        b = layer(x)
    a = a[0] if isinstance(a, tuple) else a
    b = b[0] if isinstance(b, tuple) else b
    # bit for bit on the GPU (tests/ops/test_small_m_gemm.py); under the interpreter tl.dot is
    # numpy's BLAS, whose blocking depends on M, so only rounding may differ here
    row["row_diff"] = float((a[0] - b[0]).abs().max())
    row["row_scale"] = float(b[0].abs().max())
    out["layers"][name] = row
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def built(cpu_vllm) -> dict:
    return run_result_script(_BUILD, cpu_vllm, TRITON_INTERPRET="1")


def test_every_dense_projection_and_nothing_else(built) -> None:
    expected = sorted(f"model.layers.{i}.{p}" for i in range(2) for p in (
        "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"))
    assert built["names"] == expected  # not the LM head, not the embeddings
    assert built["one_workspace"]


def test_decode_rows_take_the_kernel_prefill_rows_vllms_gemm(built) -> None:
    assert len(built["layers"]) == 8, built["names"]
    assert any(row["splits"] > 1 for row in built["layers"].values())  # split-K exercised too
    for name, row in built["layers"].items():
        assert row["is_unquantized"], name  # vLLM's isinstance checks still hold
        for m in (1, 3, 16):
            assert row[f"m{m}"]["kernel"] == 1, (name, m, row)
            assert row[f"m{m}"]["max_err"] < 1e-4, (name, m, row)
        assert row["m20"]["kernel"] == 0 and row["m20"]["max_err"] < 1e-4, (name, row)
        assert row["row_diff"] <= 1e-6 * max(row["row_scale"], 1.0), (name, row)


def test_small_m_gemm_is_auto_by_default_and_parsed() -> None:
    assert PluginConfig().small_m_gemm == "auto"
    assert PluginConfig.from_dict({"small_m_gemm": True}).small_m_gemm is True
    assert PluginConfig.from_dict({"small_m_gemm": False}).small_m_gemm is False
    with pytest.raises(ValueError, match="small_m_gemm='yes' must be true, false or \"auto\""):
        PluginConfig.from_dict({"small_m_gemm": "yes"})


@pytest.mark.parametrize(("n", "k", "picked"), [
    # (outputs, inputs) of the real decode linears (benchmarks/kernels/gemm.py shapes)
    (1024, 2048, True), (1024, 3072, True),      # Qwen3-0.6B o_proj, down_proj
    (4096, 1024, False), (6144, 1024, False),    # Qwen3-0.6B qkv_proj, gate_up_proj
    (4096, 4096, True), (4096, 12288, True),     # Qwen3-8B o_proj, down_proj
    (6144, 4096, False), (24576, 4096, False),   # Qwen3-8B qkv_proj, gate_up_proj
    (2048, 4096, True), (5120, 2048, False),     # Qwen3-30B-A3B o_proj, qkv_proj
    (128, 2048, False),                          # Qwen3-30B-A3B router gate: not measured
])
def test_auto_takes_the_layers_measured_faster(n, k, picked) -> None:
    from vllm_moe_graphs.integration.model.small_m_linear import auto_selects

    assert auto_selects(n, k) is picked
