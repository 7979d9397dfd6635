"""torch.compile's rounding in the model's RMSNorms and SiLU-and-mul
(`integration/model/compiled_numerics.py`), on real vLLM Qwen3 / Qwen3-MoE models built by vLLM
0.26's own classes on its CPU build, the kernels under Triton's interpreter: which modules take
it and why not, that an installed norm computes the compiled rounding in place as vLLM's fused
add-norm does, and that an input the kernels cannot take runs vLLM's forward."""

from __future__ import annotations

import pytest

from tests.serve_util import QWEN3_BUILD, run_on_tiny_qwen3_moe, run_result_script
from vllm_moe_graphs.config import PluginConfig

_PROBE = r"""
from vllm_moe_graphs.integration.model import compiled_numerics as cn

def probe(model, hidden, dtype=torch.bfloat16):
    installed = cn.install_compiled_numerics(model, hidden, dtype)
    mods = dict(model.named_modules())
    norm = next(m for n, m in mods.items() if n.endswith("post_attention_layernorm"))
    out = {"installed": installed,
           "patched": sorted(n for n, m in mods.items() if "forward" in m.__dict__)}
    if "forward" in norm.__dict__:
        g = torch.Generator().manual_seed(0)
        x = (torch.randn(3, hidden, generator=g) * 3).bfloat16()
        r = (torch.randn(3, hidden, generator=g) * 20).bfloat16()
        with torch.no_grad():
            norm.weight.copy_(1 + 0.2 * torch.randn(hidden, generator=g))
            xo, ro = x.clone(), r.clone()
            y, s = norm(xo, ro)
            h = x.float() + r.float()
            ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) \
                * norm.weight.float()
            step = 2 ** -7 * ref.abs().clamp_min(1e-3)
            out["in_place"] = y.data_ptr() == xo.data_ptr() and s.data_ptr() == ro.data_ptr()
            out["norm_ulps"] = float(((y.float() - ref).abs() / step).max())
            out["sum_ulps"] = float(((s.float() - h).abs() / (2 ** -7 * h.abs().clamp_min(1e-3))
                                     ).max())
            x3 = x.view(3, 1, hidden)  # another rank: vLLM's forward
            out["fallback_equal"] = bool(torch.equal(norm(x3), type(norm).forward(norm, x3)))
    return out
"""

_DENSE = QWEN3_BUILD + _PROBE + r"""
import os
port = int(sys.argv[1])
out = {"bf16": probe(build(64, "bfloat16", port=port), 128),
       "fp32": probe(build(64, "float32"), 128, torch.float32)}
os.environ["VLLM_BATCH_INVARIANT"] = "1"
out["batch_invariant"] = probe(build(64, "bfloat16"), 128)
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def dense(cpu_vllm) -> dict:
    return run_result_script(_DENSE, cpu_vllm, TRITON_INTERPRET="1")


def test_residual_norms_and_the_mlp_activation_take_the_compiled_rounding(dense) -> None:
    got = dense["bf16"]
    layers = [f"model.layers.{i}" for i in range(2)]
    expect = {f"{p}.{n}" for p in layers for n in ("input_layernorm", "post_attention_layernorm",
                                                   "mlp.act_fn")} | {"model.norm"}
    assert {n for n, v in got["installed"].items() if v == "installed"} == expect
    assert set(got["patched"]) == expect
    for p in layers:  # the q/k norms (head size 64) stay vLLM's: fused with RoPE elsewhere
        for n in ("q_norm", "k_norm"):
            assert got["installed"][f"{p}.self_attn.{n}"] == \
                "size (64,), not the hidden size 128 (q/k norm)"


def test_an_installed_norm_adds_in_place_and_rounds_once(dense) -> None:
    got = dense["bf16"]
    assert got["in_place"]  # as vLLM's fused_add_rms_norm: x <- norm, residual <- sum
    # within a bf16 step of the fp32-sum reference (the interpreter truncates instead of
    # rounding to nearest: up to one step)
    assert got["norm_ulps"] <= 1.0 and got["sum_ulps"] <= 1.0
    assert got["fallback_equal"]


def test_refused_models_keep_vllms_forward(dense) -> None:
    assert dense["fp32"]["patched"] == []
    assert set(dense["fp32"]["installed"].values()) == {"dtype torch.float32 (bf16 / fp16 only)"}
    assert dense["batch_invariant"]["patched"] == []
    assert set(dense["batch_invariant"]["installed"].values()) == {
        "VLLM_BATCH_INVARIANT: vLLM's batch-invariant kernels"}


def test_moe_model_norms_take_it_and_its_experts_keep_their_activation(cpu_vllm) -> None:
    got = run_on_tiny_qwen3_moe(_PROBE + 'print("RESULT " + json.dumps(probe(model, 64)))',
                                cpu_vllm, env={"TRITON_INTERPRET": "1"})
    assert {n for n, v in got["installed"].items() if v == "installed"} == {
        "model.norm", *(f"model.layers.{i}.{n}" for i in range(2)
                        for n in ("input_layernorm", "post_attention_layernorm"))}
    assert got["in_place"] and got["norm_ulps"] <= 1.0


def test_compiled_numerics_is_off_until_measured_and_parsed() -> None:
    assert PluginConfig().compiled_numerics is False
    assert PluginConfig.from_dict({"compiled_numerics": True}).compiled_numerics is True
