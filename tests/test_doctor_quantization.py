"""`moe-graphs doctor` on quantized weights: the FP8 scheme it reads from the flags and the
checkpoint, and the reason each gets (CPU machine: `no_cuda` beside it)."""

from __future__ import annotations

import json

import pytest

from tests.test_doctor import _config_dir, _reasons, _run, doctor_shape
from vllm_moe_graphs.cli import doctor


@pytest.mark.parametrize("flags,reason", [
    (["-q", "fp8"], "fp8_per_tensor_moe (quantization fp8: per-tensor FP8, dynamic activation "
                    "scales, on an MoE model: the fused MoE takes one activation scale over all "
                    "rows of a step, padding rows included)"),
    (["-q", "fp8_per_tensor"], "fp8_per_tensor_moe (quantization fp8_per_tensor: per-tensor FP8"),
    (["-q", "fp8_per_block"], "unsupported_quantization (quantization fp8_per_block: "
                              "block-quantized FP8, 128x128 weight blocks"),
    (["-q", "fp8_per_channel"], "unsupported_quantization (quantization fp8_per_channel: "
                                "per-channel FP8, activations quantized per token)"),
    (["-q", "online", "--quantization-config", '{"linear": "fp8_per_block", "moe": '
      '{"weight": "fp8_per_block_static"}}'],
     "unsupported_quantization (quantization online: block-quantized FP8"),
    (["-q", "online", "--quantization-config", '{"moe": "fp8_per_tensor"}'],
     "fp8_per_tensor_moe (quantization online: per-tensor FP8"),
])
def test_quantization_flags_map_to_reasons(capsys, flags, reason):
    code, out = _run(capsys, "qwen3-30b-a3b", *flags)
    assert code == doctor.EXIT_NOT_ELIGIBLE
    assert reason in out
    assert _reasons(out) == ["no_cuda", reason.split()[0]], out
    assert "not read" not in out  # --quantization-config is read


FP8_BLOCK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}


@pytest.mark.parametrize("edit,reason", [
    ({}, "unsupported_quantization (quantization fp8: block-quantized FP8, 128x128 weight "
         "blocks, activations quantized per token and 128-column group)"),
    ({"weight_block_size": None}, "fp8_per_tensor_moe (quantization fp8: per-tensor FP8, "
                                  "dynamic activation scales, on an MoE model"),
    ({"weight_block_size": None, "activation_scheme": "static"},
     "unsupported_quantization (quantization fp8: per-tensor FP8, static activation scales "
     "from the checkpoint)"),
    ({"weight_block_size": [64, 64]}, "unsupported_quantization (quantization fp8)\n"),
])
def test_quantized_checkpoint(capsys, tmp_path, edit, reason):
    hf = json.loads((doctor_shape("qwen3-30b-a3b") / "config.json").read_text())
    hf["quantization_config"] = {k: v for k, v in {**FP8_BLOCK_CONFIG, **edit}.items()
                                 if v is not None}
    code, out = _run(capsys, _config_dir(tmp_path, hf))
    assert code == doctor.EXIT_NOT_ELIGIBLE
    assert reason in out
    assert _reasons(out) == ["no_cuda", reason.split()[0]], out


def test_per_tensor_fp8_fix_names_the_row_independent_form(capsys):
    code, out = _run(capsys, "qwen3-30b-a3b", "-q", "fp8")
    fix = out[out.index("fp8_per_tensor_moe"):].splitlines()[1]
    assert "--quantization fp8_per_block" in fix and "weight_block_size [128, 128]" in fix, out
    # a dense model's linear layers quantize per token: unproven only, not the MoE's reason
    code, out = _run(capsys, "qwen3-0.6b", "-q", "fp8")
    assert _reasons(out) == ["no_cuda", "unsupported_quantization"], out
    assert "unsupported_quantization (quantization fp8: per-tensor FP8, dynamic activation " \
           "scales)" in out


def test_unproven_fp8_takes_over_block_fp8_only(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_GRAPHS_UNPROVEN", "fp8")
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "0")  # the proofs' kernels (see the next test)
    hf = json.loads((doctor_shape("qwen3-30b-a3b") / "config.json").read_text())
    hf["quantization_config"] = FP8_BLOCK_CONFIG
    for argv in ([_config_dir(tmp_path, hf)], ["qwen3-30b-a3b", "-q", "fp8_per_block"]):
        code, out = _run(capsys, *argv)
        assert _reasons(out) == ["no_cuda"], out
        assert "MOE_GRAPHS_UNPROVEN: FP8 weights (quantization fp8" in out
        assert "block-quantized FP8, 128x128 weight blocks" in out
    # per-tensor FP8 on an MoE model is never taken over
    code, out = _run(capsys, "qwen3-30b-a3b", "-q", "fp8")
    assert _reasons(out) == ["no_cuda", "fp8_per_tensor_moe"], out
    assert "MOE_GRAPHS_UNPROVEN" not in out


@pytest.mark.parametrize("env,moe_backend,kernels", [
    ({}, None, "DeepGEMM's JIT GEMM (installed, VLLM_USE_DEEP_GEMM on)"),
    ({"VLLM_USE_DEEP_GEMM": "0"}, "flashinfer_cutlass",
     "the fused MoE backend 'flashinfer_cutlass' (--moe-backend)"),
    ({"VLLM_USE_DEEP_GEMM": "0", "VLLM_TEST_FORCE_FP8_MARLIN": "1"}, None,
     "Marlin (VLLM_TEST_FORCE_FP8_MARLIN)"),
    ({"VLLM_USE_DEEP_GEMM": "0"}, "triton", None),
])
def test_block_fp8_only_on_the_proofs_kernels(capsys, monkeypatch, env, moe_backend, kernels):
    """vLLM 0.26 ships DeepGEMM (vllm/third_party/deep_gemm) and picks it first for block FP8
    while VLLM_USE_DEEP_GEMM is on (its default): a JIT GEMM that re-quantizes the weights'
    scales, not what the plugin's FP8 proofs ran on (vLLM's CUTLASS block GEMM, Triton
    experts). Even taken over unproven, block FP8 on other kernels runs stock vLLM."""
    monkeypatch.setenv("MOE_GRAPHS_UNPROVEN", "fp8")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    flags = ["--moe-backend", moe_backend] if moe_backend else []
    code, out = _run(capsys, "qwen3-30b-a3b", "-q", "fp8_per_block", *flags)
    if kernels is None:
        assert _reasons(out) == ["no_cuda"], out
        return
    assert _reasons(out) == ["no_cuda", "fp8_unproven_kernels"], out
    assert f"fp8_unproven_kernels (quantization fp8_per_block: block-quantized FP8" in out
    assert f"on {kernels})" in out
    assert "VLLM_USE_DEEP_GEMM=0" in out[out.index("fp8_unproven_kernels"):], out
