"""The opt-in small-M GEMM wiring (`integration/linear.py`) on a real vLLM Qwen3 model (CPU
build of vLLM, kernels under the Triton interpreter, float32): which layers get it, that decode
sized inputs take the kernel and prefill sized ones vLLM's GEMM, with the same results."""

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
from vllm_moe_graphs.integration.linear import SmallMLinearMethod, install_small_m_gemm

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
    row["row_independent"] = bool(torch.equal(a[0], b[0]))
    out["layers"][name] = row
# fuse_silu_down_proj: SiLU * up inside down_proj's GEMM, against the unfused modules
from vllm_moe_graphs.integration.linear import install_silu_down_proj
out["silu_fused"] = install_silu_down_proj(model, methods)
out["silu"] = {}
for name, mlp in sorted((n, m) for n, m in model.named_modules() if n.endswith(".mlp")):
    down = methods[name + ".down_proj"]
    for m in (1, 7, 16, 20):
        x = torch.randn(m, 64, generator=gen)
        with torch.no_grad():
            gate_up, _ = mlp.gate_up_proj(x)
            ref, _ = mlp.down_proj(mlp.act_fn(gate_up))  # vLLM's activation, then the GEMM
            before = down.small_m_calls
            y = mlp(x)
        out["silu"][f"{name} m{m}"] = {"kernel": down.small_m_calls - before,
                                       "max_err": float((y - ref).abs().max()),
                                       "scale": float(ref.abs().max())}
# fuse_residual_norm: o_proj / down_proj split reduce inside the next residual add + RMSNorm
from vllm_moe_graphs.integration.linear import install_residual_norm
layers = model.model.layers
cases = []  # (name, projection call, consuming norm), reference taken before the install
for i, layer in enumerate(layers):
    nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.model.norm
    cases.append((f"{i}.o_proj", lambda x, a=layer.self_attn: a.o_proj(x)[0],
                  layer.post_attention_layernorm, layer.self_attn.o_proj.weight.shape[1]))
    cases.append((f"{i}.mlp", lambda x, mlp=layer.mlp: mlp(x), nxt, 64))
inputs = {}
ref = {}
with torch.no_grad():
    for name, proj, norm, k in cases:
        for m in (1, 5, 16, 20):
            x, res = torch.randn(m, k, generator=gen), torch.randn(m, 64, generator=gen)
            inputs[name, m] = (x, res)
            y, r = norm(proj(x).clone(), res.clone())
            ref[name, m] = (y.clone(), r.clone())
out["residual_deferred"], out["residual_why"] = install_residual_norm(model, methods)
handoff = model.moe_graphs_residual_handoff
out["residual"] = {}
with torch.no_grad():
    for name, proj, norm, k in cases:
        for m in (1, 5, 16, 20):
            x, res = inputs[name, m]
            fused_before = handoff.fused
            h = proj(x)
            deferred = handoff.pending is not None and handoff.pending[0] is h
            y, r = norm(h, res.clone())
            ry, rr = ref[name, m]
            out["residual"][f"{name} m{m}"] = {
                "deferred": deferred, "fused": handoff.fused - fused_before,
                "y_err": float((y - ry).abs().max()), "r_err": float((r - rr).abs().max()),
                "scale": float(ry.abs().max()), "pending_after": handoff.pending is not None}
    # a deferred output that reaches something else first is reduced before that runs
    x, _ = inputs["0.o_proj", 5]
    h = layers[0].self_attn.o_proj(x)[0]
    flushed = handoff.flushed
    layers[1].self_attn.qkv_proj(torch.randn(5, 64, generator=gen))  # a GEMM on the workspace
    o_ref = torch.nn.functional.linear(x, layers[0].self_attn.o_proj.weight)
    out["flush_by_gemm"] = {"flushed": handoff.flushed - flushed,
                            "err": float((h - o_ref).abs().max())}
    h = layers[0].self_attn.o_proj(x)[0]
    y, _ = layers[1].post_attention_layernorm(h.clone(), torch.zeros(5, 64))  # not h itself
    out["flush_by_norm"] = {"flushed": handoff.flushed - flushed - 1,
                            "err": float((h - o_ref).abs().max())}
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
        assert row["row_independent"], (name, row)


def test_silu_fused_into_down_proj_matches_vllms_activation(built) -> None:
    assert built["silu_fused"] == 2, built["silu_fused"]  # both layers' MLPs
    for key, row in built["silu"].items():
        m = int(key.rsplit("m", 1)[1])
        # decode rows: one fused GEMM call (the unfused reference made one more); prefill rows:
        # vLLM's activation and GEMM, bitwise the reference
        assert row["kernel"] == (1 if m <= 16 else 0), (key, row)
        assert row["scale"] > 1e-3, (key, row)  # a vacuous all-zero output would pass anything
        assert row["max_err"] <= (1e-5 * row["scale"] if m <= 16 else 0.0), (key, row)


def test_residual_norm_fused_after_o_proj_and_down_proj(built) -> None:
    assert built["residual_deferred"] == 4, built["residual_why"]  # 2 layers x (o_proj, down)
    for key, row in built["residual"].items():
        m = int(key.rsplit("m", 1)[1])
        decode = m <= 16
        # decode rows: the projection's reduce is deferred and the norm fuses it; prefill rows:
        # vLLM's GEMM and vLLM's norm, bitwise the reference
        assert row["deferred"] == decode and row["fused"] == int(decode), (key, row)
        assert not row["pending_after"], (key, row)
        assert row["scale"] > 0.05, (key, row)  # not a vacuous all-zero comparison
        assert row["y_err"] <= (1e-5 * row["scale"] if decode else 0.0), (key, row)
        assert row["r_err"] <= (1e-5 if decode else 0.0), (key, row)
    # a deferred output is reduced before another GEMM overwrites the workspace, and when a
    # norm receives some other tensor
    for case in ("flush_by_gemm", "flush_by_norm"):
        assert built[case]["flushed"] == 1 and built[case]["err"] < 1e-4, (case, built[case])


def test_fuse_silu_down_proj_is_off_by_default() -> None:
    assert PluginConfig().fuse_silu_down_proj is False
    assert PluginConfig.from_dict({"fuse_silu_down_proj": True}).fuse_silu_down_proj is True
    assert PluginConfig().fuse_residual_norm is False
    assert PluginConfig.from_dict({"fuse_residual_norm": True}).fuse_residual_norm is True


def test_small_m_gemm_is_auto_by_default_and_parsed() -> None:
    assert PluginConfig().small_m_gemm == "auto"
    assert PluginConfig.from_dict({"small_m_gemm": True}).small_m_gemm is True
    assert PluginConfig.from_dict({"small_m_gemm": False}).small_m_gemm is False
    with pytest.raises(ValueError, match="small_m_gemm='yes' must be true, false or \"auto\""):
        PluginConfig.from_dict({"small_m_gemm": "yes"})


@pytest.mark.parametrize(("n", "k", "picked"), [
    # (outputs, inputs) of the real decode linears (benchmarks/gemm_kernels.py shapes)
    (1024, 2048, True), (1024, 3072, True),      # Qwen3-0.6B o_proj, down_proj
    (4096, 1024, False), (6144, 1024, False),    # Qwen3-0.6B qkv_proj, gate_up_proj
    (4096, 4096, True), (4096, 12288, True),     # Qwen3-8B o_proj, down_proj
    (6144, 4096, False), (24576, 4096, False),   # Qwen3-8B qkv_proj, gate_up_proj
    (2048, 4096, True), (5120, 2048, False),     # Qwen3-30B-A3B o_proj, qkv_proj
    (128, 2048, False),                          # Qwen3-30B-A3B router gate: not measured
])
def test_auto_takes_the_layers_measured_faster(n, k, picked) -> None:
    from vllm_moe_graphs.integration.linear import auto_selects

    assert auto_selects(n, k) is picked
