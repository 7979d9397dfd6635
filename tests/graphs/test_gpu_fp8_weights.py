"""GPU proof of block-quantized FP8 weights under the plugin's graphs: graphs against the kill
switch, token for token, on real FP8 checkpoints.

Block FP8 (`weight_block_size [128, 128]`, dynamic activations) quantizes every activation per
token and 128-column group, in the dense linears (vLLM's CUTLASS block-scaled GEMM on Hopper)
and in the fused MoE (`TritonExperts`, block mode), so a padded step's real rows cannot depend
on its padding rows: the capability still denies it (`unsupported_quantization`) until this
test passes, and `MOE_GRAPHS_UNPROVEN=fp8` takes it over meanwhile. Per-tensor FP8 on an MoE
model never gets here (`fp8_per_tensor_moe`).

The checkpoints (tests/fp8_checkpoint.py, checked against vLLM's loader on the CPU) are the
Qwen3-0.6B and Qwen3-30B-A3B shapes cut to NUM_LAYERS layers, weights drawn N(0, 0.02) on the
GPU and quantized per 128x128 block, router gates and LM head in bf16: vLLM loads them through
its real FP8 path (no dummy weights, no re-draw). The traffic is `run_mixed`'s: staggered
arrivals, chunked long prompts and prefix-cache hits, so decode, mixed and prefill steps all
replay; then the same with the kill file (every step eager at its key's padded size).
Set MOE_GRAPHS_TEST_OUT=/dir to get one JSON summary per test there."""

from __future__ import annotations

import pytest

from tests.gpu_util import require_cuda_and_vllm
from tests.graphs.engine_harness import NUM_LAYERS, report, run_mixed

pytestmark = pytest.mark.gpu

UNPROVEN_FP8 = {"MOE_GRAPHS_UNPROVEN": "fp8"}


@pytest.fixture(autouse=True)
def _needs_cuda_and_vllm():
    require_cuda_and_vllm()


def fp8_checkpoint(tmp_path, shape: str) -> tuple[str, int]:
    """A block-FP8 checkpoint of `shape` cut to NUM_LAYERS layers, built on the GPU (this
    process's cached blocks freed after); returns (path, vocab size)."""
    import torch

    from tests.fp8_checkpoint import build_fp8_block_checkpoint
    from vllm_moe_graphs.model_configs import read_hf_config

    hf = {**read_hf_config(shape), "num_hidden_layers": NUM_LAYERS}
    path = build_fp8_block_checkpoint(str(tmp_path / f"{shape}-fp8-block"), hf, device="cuda")
    torch.cuda.empty_cache()
    return path, int(hf["vocab_size"])


@pytest.mark.parametrize("shape", ["qwen3-0.6b", "qwen3-30b-a3b"])
def test_mixed_graphs_on_block_fp8_weights_match_kill_switch_eager(shape, tmp_path):
    moe = shape == "qwen3-30b-a3b"
    summary = run_mixed(tmp_path, shape, f"mixed-fp8-block-{shape}",
                        {"skip_moe_padding": True} if moe else {}, env_extra=UNPROVEN_FP8,
                        checkpoint=fp8_checkpoint(tmp_path, shape))
    report(f"parity-mixed-fp8-block-{shape}", summary)
    logs = summary["log_lines"]
    # vLLM loaded FP8 weights, and the plugin took them over as block FP8 (unproven)
    assert summary["config"]["quantization"] == "fp8", summary["config"]
    assert any("MOE_GRAPHS_UNPROVEN: taking over FP8 weights (quantization fp8: block-quantized"
               in ln for ln in logs), logs
    assert summary["mode_graphs"] == 1, logs
    if moe:  # the experts are vLLM's TritonExperts in block mode: padding rows skip them
        assert any(f"in {NUM_LAYERS} of {NUM_LAYERS} MoE layers" in ln for ln in logs
                   if "padding rows skip the experts" in ln), logs
    (row,) = summary["rows"]
    assert row["identical_sequences"] == row["sequences"], row
    assert row["replays"] > 0 and row["replays_while_killed"] == 0, row
    assert row["mean_top1_logprob"] > -10.5, f"flat logits: comparison vacuous ({row})"
    assert summary["replays_by_kind"]["decode"] > 0, summary["replays_by_kind"]
    assert summary["replays_by_kind"]["mixed"] > 0, summary["replays_by_kind"]
    assert summary["mixed_batch_fallbacks"] == 0, summary
    assert summary["capture_failures"] == 0, summary
    # the start-up warm-up compiled the FP8 (block) variants of vLLM's fused-MoE kernel
    assert "fused_moe_kernel" not in summary["jit_in_requests"], summary["jit_in_requests"]
