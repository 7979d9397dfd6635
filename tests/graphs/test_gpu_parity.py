"""GPU tier for the graph runner inside real vLLM 0.26.0 (end to end): graphs against the kill
switch, token for token.

Each test runs engines through tests/graphs/engine_harness.py (`vllm.LLM` in its own
interpreter, the plugin loaded through its entry point, so it takes graphs over exactly as for
an operator). Parity is measured *within one engine*: the same prompts are generated with
graphs, then again with the kill file present (`MOE_GRAPHS_KILL_FILE`: every step eager at its
key's padded size, graphs kept), and the greedy tokens must be identical. Every batch size used
is a bucket, so the graph and the eager step run the same kernels on the same number of rows:
identity is the right bar, not closeness.

Models: the Qwen3-0.6B and Qwen3-30B-A3B shapes cut to NUM_LAYERS layers (every per-layer shape
real; depth only scales time), and a tiny real checkpoint built by tests/tiny_models.py.
Set MOE_GRAPHS_TEST_OUT=/dir to get one JSON summary per test there."""

from __future__ import annotations

import json
import re

import pytest

from tests.gpu_util import require_cuda_and_vllm
from tests.graphs.engine_harness import (NUM_LAYERS, NUM_PROMPTS, assert_parity, check_parity,
                                          cut_shape_dir, delta, engine_kwargs, metric,
                                          parity_phases, parity_prompts, report, run_engine,
                                          run_mixed)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda_and_vllm():
    require_cuda_and_vllm()


# The MoE shape's parity runs with the padding rows skipping the experts (`skip_moe_padding`):
# every graph and kill-switch step of theirs runs the rewrite.
SKIP_MOE_PADDING = {"qwen3-30b-a3b": {"additional_config": {"moe_graphs": {
    "skip_moe_padding": True}}}}


@pytest.mark.parametrize("shape", ["qwen3-0.6b", "qwen3-30b-a3b"])
def test_graphs_match_kill_switch_eager(shape, tmp_path):
    model, vocab = cut_shape_dir(tmp_path, shape)
    phases = parity_phases() + [{"batch": 8, "kill": False, "sleep": True},
                                {"batch": 8, "kill": True},
                                {"batch": 8, "kill": False, "swap_kv": True}]
    result = run_engine(tmp_path, shape, engine_kwargs(model, load_format="dummy",
                                                     enable_sleep_mode=True,
                                                     **SKIP_MOE_PADDING.get(shape, {})),
                        parity_prompts(vocab), phases)
    summary = check_parity(result)
    # sleep(level=1) + wake_up: graphs dropped and recaptured, output unchanged
    p = result["phases"]
    summary["sleep"] = {
        "identical_to_before_sleep": sum(a == b for a, b in zip(p[2]["tokens"], p[8]["tokens"],
                                                                strict=True)),
        "invalidations": delta(p, 8, "moe_graphs_invalidations_total"),
        "captures_after_wake": delta(p, 8, "moe_graphs_captures_total"),
        "replays_after_wake": delta(p, 8, "moe_graphs_replays_total"),
    }
    # a layer's KV tensor swapped behind the storage: caught before the next replay (graphs
    # dropped, fresh bind, recapture), output unchanged
    summary["kv_swap"] = {
        "swapped_ptrs": p[10].get("swapped_ptrs"),
        "identical_to_before": sum(a == b for a, b in zip(p[2]["tokens"], p[10]["tokens"],
                                                          strict=True)),
        "invalidations": delta(p, 10, "moe_graphs_invalidations_total"),
        "captures": delta(p, 10, "moe_graphs_captures_total"),
        "replays": delta(p, 10, "moe_graphs_replays_total"),
    }
    report(f"parity-{shape}", summary)
    assert_parity(summary)
    logs = summary["log_lines"]
    # profiling -> real bind: vLLM's profiling forward ran with no storage bound (the recorded
    # capability says so, and nothing can be captured without a bound storage); the first bind
    # is the serving one, generation 1, before any graph
    first_bind = next(i for i, ln in enumerate(logs) if "KV storage bound (serving phase" in ln)
    assert "generation 1)" in logs[first_bind], logs
    assert any("reasons=storage_unbound" in ln for ln in logs[:first_bind]), logs
    assert not any("captured" in ln for ln in logs[:first_bind]), logs
    # the default kernels around attention: small-M GEMM on o_proj/down_proj ("auto": dense
    # Qwen3 both, Qwen3-MoE o_proj only, its experts are fused MoE), fused q/k norm + RoPE
    picked = NUM_LAYERS * (2 if shape == "qwen3-0.6b" else 1)
    assert any(f"small-M GEMM on {picked} linear layers (auto" in ln for ln in logs), logs
    assert any(f"fused q/k norm + RoPE in {NUM_LAYERS} of {NUM_LAYERS}" in ln for ln in logs), logs
    # skip_moe_padding: the MoE shape's padding rows skip every layer's experts (128 experts,
    # vLLM's Triton experts); the dense shape has no MoE layer and no such line
    skip = [ln for ln in logs if "padding rows skip the experts" in ln]
    if shape == "qwen3-0.6b":
        assert skip == [], logs
    else:
        assert any(f"in {NUM_LAYERS} of {NUM_LAYERS} MoE layers" in ln for ln in skip), logs
    swap = summary["kv_swap"]
    assert swap["swapped_ptrs"] and swap["swapped_ptrs"][0] != swap["swapped_ptrs"][1], swap
    assert swap["identical_to_before"] == NUM_PROMPTS and swap["invalidations"] > 0, swap
    assert swap["captures"] > 0 and swap["replays"] > 0, swap
    assert summary["sleep"]["identical_to_before_sleep"] == NUM_PROMPTS, summary["sleep"]
    assert summary["sleep"]["invalidations"] > 0, summary["sleep"]
    assert summary["sleep"]["captures_after_wake"] > 0, summary["sleep"]


@pytest.mark.parametrize("shape", ["qwen3-0.6b", "qwen3-30b-a3b", "tiny"])
def test_mixed_graphs_match_kill_switch_eager(shape, tmp_path):
    """mixed_graphs (experimental): steps with prefill tokens are captured and replayed too.
    64 prompts arrive one every 4 steps (`run_mixed`): most steps carry prefill tokens, long
    prompts are chunked over many steps, shared prefixes hit the prefix cache. Graphs vs the
    kill switch token-identical, and steps with prefill tokens replayed."""
    summary = run_mixed(tmp_path, shape, f"mixed-{shape}",
                        {"skip_moe_padding": True} if shape == "qwen3-30b-a3b" else {})
    report(f"parity-mixed-{shape}", summary)
    steps = summary["steps_by_kind"]
    assert steps["mixed"] + steps["prefill"] > steps["decode"], steps  # mostly mixed steps
    (row,) = summary["rows"]
    assert row["identical_sequences"] == row["sequences"], row
    assert row["replays"] > 0 and row["replays_while_killed"] == 0, row
    assert summary["replays_by_kind"]["mixed"] > 0, summary["replays_by_kind"]
    assert summary["mixed_keys"], summary["graph_keys"]
    assert summary["mixed_batch_fallbacks"] == 0, summary  # every such step was planned


@pytest.mark.parametrize("shape", ["qwen3-0.6b", "qwen3-30b-a3b"])
def test_mixed_graphs_on_an_fp8_kv_cache_match_kill_switch_eager(shape, tmp_path):
    """`--kv-cache-dtype fp8` (taken over with MOE_GRAPHS_UNPROVEN=fp8_kv until proven): the KV
    write quantizes with the layers' per-tensor scales, decode and prefill kernels read the e4m3
    cache; the `run_mixed` traffic token-identical to the kill switch, every step kind
    replayed."""
    summary = run_mixed(tmp_path, shape, f"mixed-fp8-kv-{shape}",
                        {"skip_moe_padding": True} if shape == "qwen3-30b-a3b" else {},
                        llm_extra={"kv_cache_dtype": "fp8"},
                        env_extra={"MOE_GRAPHS_UNPROVEN": "fp8_kv"})
    report(f"parity-mixed-fp8-kv-{shape}", summary)
    assert any("kv_cache_dtype fp8:" in ln for ln in summary["log_lines"]), summary["log_lines"]
    (row,) = summary["rows"]
    assert row["identical_sequences"] == row["sequences"], row
    assert row["replays"] > 0 and row["replays_while_killed"] == 0, row
    assert summary["replays_by_kind"]["mixed"] > 0, summary["replays_by_kind"]
    assert summary["mixed_batch_fallbacks"] == 0, summary


def test_mixed_graphs_with_fused_moe_routing_match_kill_switch_eager(tmp_path):
    """fuse_moe_padding_mask: every MoE layer of the Qwen3-30B-A3B shape routes through the
    plugin's top-k softmax, which writes the padding rows' sentinel ids in the same launch (no
    mask launch); the `run_mixed` traffic token-identical to the kill switch (whose steps route
    through the same kernel, unpadded), steps with prefill tokens replayed."""
    summary = run_mixed(tmp_path, "qwen3-30b-a3b", "mixed-fused-routing",
                        {"skip_moe_padding": True, "fuse_moe_padding_mask": True})
    report("parity-mixed-fused-routing", summary)
    assert any(f"{NUM_LAYERS} through the fused routing, 0 through the mask" in ln
               for ln in summary["log_lines"]), summary["log_lines"]
    (row,) = summary["rows"]
    assert row["identical_sequences"] == row["sequences"], row
    assert row["replays"] > 0 and row["replays_while_killed"] == 0, row
    assert summary["replays_by_kind"]["mixed"] > 0, summary["replays_by_kind"]
    # both of its variants (every row real, padding rows) compiled by the start-up warm-up
    assert "_topk_softmax_kernel" not in summary["jit_in_requests"], summary["jit_in_requests"]


def test_parallel_warm_up_compiles_keep_parity_and_compile_nothing_late(tmp_path):
    """warm_up_compile_threads (8, the default) on a fresh node (an empty Triton cache): the
    start-up warm-up records the fused-MoE kernel's variants from forwards that skip those
    launches and builds them on 8 threads before its own forwards, and vLLM's top-k/top-p
    sampling kernel compiles on a thread of its own from the start of model loading (the
    variant the profile run launches); the `run_mixed` traffic on the Qwen3-30B-A3B shape
    token-identical to the kill switch, and no fused-MoE variant compiled while serving."""
    summary = run_mixed(tmp_path, "qwen3-30b-a3b", "mixed-parallel-warm-up",
                        {"skip_moe_padding": True, "warm_up_compile_threads": 8},
                        env_extra={"TRITON_CACHE_DIR": str(tmp_path / "triton-cache")})
    report("parity-mixed-parallel-warm-up", summary)
    lines = "\n".join(summary["log_lines"])
    compiled = re.search(r"(\d+) fused-MoE kernel variants of (\d+) token counts \S+ compiled "
                         r"on 8 threads in [\d.]+ s, (\d+) built", lines)
    warmed = re.search(r"warmed up before serving \(.*?(\d+) fused-MoE token counts", lines)
    assert compiled and warmed, summary["log_lines"]
    variants, counts, built = map(int, compiled.groups())
    # every variant built, the warm-up's fused-MoE token counts recorded besides its batches
    assert built == variants > 0 and counts > int(warmed.group(1)) > 0, compiled.group(0)
    # vLLM's sampling kernel: compiled on its own thread, the variant its profile run launched
    assert re.search(r"top-k/top-p sampling kernel compiled on its own thread in [\d.]+ s",
                     lines) and "that its own thread did not compile" not in lines, lines
    (row,) = summary["rows"]
    assert row["identical_sequences"] == row["sequences"], row
    assert row["replays"] > 0 and row["replays_while_killed"] == 0, row
    assert "fused_moe_kernel" not in summary["jit_in_requests"], summary["jit_in_requests"]


@pytest.mark.parametrize("mixed_requests", [None, 640])
def test_wide_batches_replay_and_match_kill_switch(mixed_requests, tmp_path):
    """Steps of more than 256 requests, as a saturated `vllm serve` runs them (max_num_seqs is
    1024 on the H200): 640 prompts submitted at once, an 8192-token step budget. The steps that
    prefill the later prompts next to the earlier ones' decode rows carry more than 256
    requests (keys padded to a power of two: 512, then max_num_seqs 640), the decode steps
    take the buckets past 256; `warmup_steps: 0` captures each key at first sight, so even a
    key met once replays. With `mixed_requests` 640 every step with prefill tokens pads to its
    token bucket's one key of min(bucket, 640) requests instead. Graphs vs the kill switch:
    token-identical."""
    model, vocab = cut_shape_dir(tmp_path, "qwen3-0.6b")
    plugin = {"warmup_steps": 0, **({"mixed_requests": mixed_requests} if mixed_requests else {})}
    kwargs = engine_kwargs(model, load_format="dummy", max_num_seqs=640,
                           max_num_batched_tokens=8192, additional_config={"moe_graphs": plugin})
    result = run_engine(tmp_path, "wide", kwargs, parity_prompts(vocab, 640),
                        parity_phases((640,)), max_tokens=32)
    summary = check_parity(result)
    keys = result["graph_keys"]
    summary["wide_decode_buckets"] = sorted({b for b, _, r in keys if r == 0 and b > 256})
    summary["mixed_keys"] = sorted([b, r] for b, _, r in keys if r > 0)
    summary["mixed_replays"] = delta(result["phases"], 0, "moe_graphs_replays_total",
                                     kind="mixed")
    report("parity-wide-batches" + (f"-mixed-requests-{mixed_requests}" if mixed_requests
                                    else ""), summary)
    (row,) = summary["rows"]
    assert summary["mode_graphs"] == 1, summary["log_lines"]
    assert row["identical_sequences"] == row["sequences"] == 640, row
    assert row["replays"] > 0 and row["replays_while_killed"] == 0, row
    assert row["kill_switch_fallbacks"] > 0, row
    assert row["mean_top1_logprob"] > -10.5, f"flat logits: comparison vacuous ({row})"
    assert 640 in summary["wide_decode_buckets"], keys
    assert summary["mixed_replays"] > 0, summary
    if mixed_requests:  # one key per token bucket, whatever its steps' requests
        assert all(r == min(b, mixed_requests) for b, r in summary["mixed_keys"]), keys
    else:
        assert any(r > 256 for _, r in summary["mixed_keys"]), keys


def test_mixed_graphs_with_flash_attn_prefill_match_kill_switch_eager(tmp_path):
    """prefill_attention flash_attn (experimental): steps with prefill tokens attend through
    vLLM's FlashAttention 3 with its schedule planned outside the graph; the `run_mixed`
    traffic token-identical to the kill switch, steps with prefill tokens replayed."""
    summary = run_mixed(tmp_path, "qwen3-0.6b", "mixed-fa3", {"prefill_attention": "flash_attn"})
    report("parity-mixed-flash-attn", summary)
    assert any("use FlashAttention 3" in ln for ln in summary["log_lines"]), summary["log_lines"]
    (row,) = summary["rows"]
    assert row["identical_sequences"] == row["sequences"], row
    assert summary["replays_by_kind"]["mixed"] > 0, summary["replays_by_kind"]


def test_mixed_precapture_serves_mixed_traffic_without_capture(tmp_path):
    """precapture with mixed_graphs: every token bucket's key (and every decode key) captured
    while the engine starts; the `run_mixed` traffic then replays steps with prefill tokens
    with no capture while serving, token-identical to the kill switch."""
    summary = run_mixed(tmp_path, "qwen3-0.6b", "mixed-precapture", {"precapture": True})
    report("parity-mixed-precapture", summary)
    (row,) = summary["rows"]
    assert row["identical_sequences"] == row["sequences"], row
    # max_num_batched_tokens 256: token buckets 16..256, five keys, then the decode keys
    assert len(summary["mixed_keys"]) == 5, summary["graph_keys"]
    assert summary["captures"] == summary["startup_captures"] > 5, summary
    assert summary["replays_by_kind"]["mixed"] > 0, summary["replays_by_kind"]


def test_uva_expert_offload_graphs_match_kill_switch_eager(tmp_path):
    """The Qwen3-30B-A3B shape with experts in pinned host memory through vLLM's UVA offloader
    (`--cpu-offload-gb 2 --cpu-offload-params experts`): the capability check allows it, decode
    graphs are captured over the host-resident experts and replayed, token-identical to the
    kill switch (the experts are read over PCIe by the same kernels in both), with the padding
    rows skipping the experts (`skip_moe_padding`)."""
    model, vocab = cut_shape_dir(tmp_path, "qwen3-30b-a3b")
    kwargs = engine_kwargs(model, load_format="dummy", cpu_offload_gb=2,
                         cpu_offload_params=["experts"], **SKIP_MOE_PADDING["qwen3-30b-a3b"])
    result = run_engine(tmp_path, "uva-offload", kwargs, parity_prompts(vocab, 16),
                        parity_phases((1, 8, 16)), max_tokens=64)
    summary = check_parity(result)
    summary["uva_offloaded"] = result["uva_offloaded"]
    report("parity-uva-expert-offload", summary)
    # 2 GiB of expert weights really live in host memory (only expert weights), and the
    # plugin's capability check saw UVA offload and still took decode graphs over
    off = result["uva_offloaded"]
    assert off["bytes"] >= 2 * 2**30 and off["names"] == ["w13_weight", "w2_weight"], off
    assert summary["config"]["offload"] == "uva", summary["config"]
    assert_parity(summary)


def test_tiny_checkpoint_graphs_match_kill_switch_eager(tmp_path):
    from tests.tiny_models import build_checkpoint

    path = build_checkpoint(str(tmp_path / "tiny-qwen3"), head_dim=64)
    vocab = json.loads((tmp_path / "tiny-qwen3" / "config.json").read_text())["vocab_size"]
    # last: batch 8 eager again, the attention metadata copied into the builder's own buffers
    # (the path of vLLM's runners) instead of read from vLLM's in place, and the inputs prepared
    # by vLLM's _prepare_inputs instead of DecodeInputs: the same tokens show both right, not
    # only graph and eager alike
    phases = parity_phases() + [{"batch": 8, "kill": True, "metadata_copies": True}]
    result = run_engine(tmp_path, "tiny", engine_kwargs(path), parity_prompts(vocab), phases,
                        redraw=False)
    summary = check_parity(result)
    p = result["phases"]
    summary["metadata_copies"] = {
        "builders_reset": p[-1]["in_place_builders_reset"],
        "fast_input_steps_before": p[-1]["fast_input_steps_before"],
        "identical_to_in_place": sum(a == b for a, b in zip(p[3]["tokens"], p[-1]["tokens"],
                                                            strict=True))}
    report("parity-tiny-checkpoint", summary)
    assert_parity(summary)
    assert p[3]["batch"] == 8 and p[3]["kill"], p[3]
    assert summary["metadata_copies"]["builders_reset"] > 0, summary["metadata_copies"]
    assert summary["metadata_copies"]["fast_input_steps_before"] > 0, summary["metadata_copies"]
    assert summary["metadata_copies"]["identical_to_in_place"] == NUM_PROMPTS, summary


def test_experimental_kernels_keep_parity(tmp_path):
    """small_m_gemm on every eligible layer (default "auto": o_proj/down_proj only) + fused q/k
    norm + RoPE: every linear layer and attention module really switched, and graphs vs kill
    switch still token-identical."""
    model, vocab = cut_shape_dir(tmp_path, "qwen3-0.6b")
    cfg = {"moe_graphs": {"small_m_gemm": True, "fuse_qk_norm_rope": True}}
    result = run_engine(tmp_path, "experimental",
                        engine_kwargs(model, load_format="dummy", additional_config=cfg),
                        parity_prompts(vocab), parity_phases((1, 8, 32)))
    summary = check_parity(result)
    report("parity-experimental-kernels", summary)
    logs = "\n".join(summary["log_lines"])
    assert f"small-M GEMM on {4 * NUM_LAYERS} linear layers" in logs, logs
    assert f"fused q/k norm + RoPE in {NUM_LAYERS} of {NUM_LAYERS} attention layers" in logs, logs
    assert_parity(summary)


def test_precapture_serves_from_start_up_graphs(tmp_path):
    """precapture=true: every key captured while the engine starts (before any request), then
    decode replays them with no further capture, token-identical to the kill switch."""
    model, vocab = cut_shape_dir(tmp_path, "qwen3-0.6b")
    cfg = {"moe_graphs": {"precapture": True}}
    result = run_engine(tmp_path, "precapture",
                        engine_kwargs(model, load_format="dummy", additional_config=cfg),
                        parity_prompts(vocab), parity_phases((1, 8, 32)), max_tokens=64)
    summary = check_parity(result)
    summary["startup_captures"] = metric(result["startup_metrics"], "moe_graphs_captures_total")
    summary["startup_pool_bytes"] = metric(result["startup_metrics"], "moe_graphs_pool_bytes")
    report("precapture", summary)
    logs = summary["log_lines"]
    planned = next((ln for ln in logs if "pre-capturing" in ln), None)
    assert planned is not None, logs
    keys = int(re.search(r"pre-capturing (\d+) graphs", planned).group(1))
    assert any(f"pre-captured {keys}/{keys}" in ln for ln in logs), logs
    # max_num_seqs 64, max_model_len 512: batch buckets up to 64, one context bucket (512),
    # and (mixed_graphs, the default) the token buckets fitted to max_num_batched_tokens
    assert summary["startup_captures"] == keys and summary["captures"] == keys, summary
    assert summary["startup_pool_bytes"] > 0, summary
    assert_parity(summary)
