"""GPU tier for the graph runner inside real vLLM 0.26.0 (end to end).

Each test runs engines through tests/graphs/engine_harness.py (`vllm.LLM` in its own
interpreter, the plugin loaded through its entry point, so it takes graphs over exactly as for
an operator) or a real `vllm serve`. Parity is measured *within one engine*: the same prompts
are generated with graphs, then again with the kill file present (`MOE_GRAPHS_KILL_FILE`: every
step eager at its key's padded size, graphs kept), and the greedy tokens must be identical.
Every batch size used is a bucket, so the graph and the eager step run the same kernels on the
same number of rows: identity is the right bar, not closeness.

Models: the Qwen3-0.6B and Qwen3-30B-A3B shapes cut to NUM_LAYERS layers (every per-layer shape
real; depth only scales time), and a tiny real checkpoint built by tests/tiny_models.py.
Set MOE_GRAPHS_TEST_OUT=/dir to get one JSON summary per test there.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
import json
import os
import random
import re
import time
import urllib.request

import pytest

from tests.gpu_util import require_cuda_and_vllm, serve_memory_args, sleep_or_wake
from tests.graphs.engine_harness import (FAIL_FIRST_MIXED_CAPTURE, NUM_LAYERS, NUM_PROMPTS,
                                          assert_parity, check_parity, cut_shape_dir, delta,
                                          engine_kwargs, metric, parity_phases, parity_prompts,
                                          report, run_engine, run_mixed)
from tests.serve_util import get, post_json, tail, vllm_serve

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


# The mixed-faults engine's settings: a 1 MiB pool budget, which the first capture overruns, and
# two warm-up steps per key, with which the first key of `run_mixed`'s Qwen3-0.6B traffic to
# reach its capture is one with prefill tokens (checked on vLLM's CPU build by
# tests/graphs/test_mixed_workload_schedule.py).
MIXED_FAULTS_PLUGIN = {"graph_memory_budget_mib": 1, "warmup_steps": 2}


def test_mixed_traffic_faults_keep_output_identical(tmp_path):
    """mixed_graphs under faults, in one engine, the `run_mixed` traffic: the first capture of
    a key with prefill tokens is invalidated by a host sync inside the region (quarantined;
    the first prompt's chunks make it the first key to reach its capture), the next capture
    overruns the 1 MiB pool budget, which denies every later one, and the kill file is
    created and removed every 24 steps. Token-identical to the kill-switch phase all the
    same: a fallback of a key runs at the key's shape, so no fault changes what a step
    computes. With one warm-up step per key (the default) the first key of this traffic to
    reach its capture is the one-request decode key, whose capture fills the budget before
    any key with prefill tokens gets one: hence `MIXED_FAULTS_PLUGIN`'s two."""
    summary = run_mixed(tmp_path, "qwen3-0.6b", "mixed-faults", MIXED_FAULTS_PLUGIN,
                        {"toggle_kill_every": 24},
                        env_extra={"MOE_GRAPHS_TEST_FAIL_MIXED_CAPTURE": "1"})
    report("faults-mixed", summary)
    (row,) = summary["rows"]
    assert row["identical_sequences"] == row["sequences"], row
    assert summary["capture_failures"] == 1 and summary["capture_failed_fallbacks"] > 0, summary
    assert summary["memory_budget_fallbacks"] > 0, summary
    assert summary["kill_switch_fallbacks"] > 0 and row["replays"] > 0, summary


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


def test_capture_failure_and_memory_budget_keep_serving(tmp_path):
    model, vocab = cut_shape_dir(tmp_path, "qwen3-0.6b")
    # batch 8's capture fails (a host sync inside the region invalidates it; quarantined);
    # batch 1's capture then fills the 1 MiB budget, so batch 2 is denied with memory_budget.
    # Each with graphs, then the same with the kill file; last, batch 8 again with random
    # sampling, which draws from the CUDA generator the failed capture had left marked as
    # capturing (the runner resets it: sampling must not raise). Decode keys only (mixed_graphs
    # off): the faults of keys with prefill tokens are test_mixed_traffic_faults_*.
    phases = [{"batch": b, "kill": k} for b in (8, 1, 2) for k in (False, True)]
    phases.append({"batch": 8, "kill": False, "temperature": 1.0})
    cfg = {"moe_graphs": {"graph_memory_budget_mib": 1, "mixed_graphs": False}}
    result = run_engine(tmp_path, "faults", engine_kwargs(model, load_format="dummy",
                                                        additional_config=cfg),
                        parity_prompts(vocab, 16), phases, max_tokens=64, fail_capture_bucket=8)
    last = result["phases"][-1]["metrics"]
    summary = {
        "identical": [sum(a == b for a, b in zip(result["phases"][i]["tokens"],
                                                  result["phases"][i + 1]["tokens"], strict=True))
                      for i in range(0, 6, 2)],
        "capture_failures": metric(last, "moe_graphs_capture_failures_total"),
        "capture_failed_fallbacks": metric(last, "moe_graphs_eager_fallbacks_total",
                                           reason="capture_failed"),
        "memory_budget_fallbacks": metric(last, "moe_graphs_eager_fallbacks_total",
                                          reason="memory_budget"),
        "captures": metric(last, "moe_graphs_captures_total"),
        "replays": metric(last, "moe_graphs_replays_total"),
        "sampled_tokens": sum(map(len, result["phases"][-1]["tokens"])),
        "log_lines": result["log_lines"],
    }
    report("faults", summary)
    assert summary["identical"] == [16, 16, 16], summary
    assert summary["sampled_tokens"] == 16 * 64, summary
    assert summary["capture_failures"] == 1 and summary["capture_failed_fallbacks"] > 0, summary
    assert summary["captures"] == 1 and summary["replays"] > 0, summary
    assert summary["memory_budget_fallbacks"] > 0, summary


def test_disable_env_runs_stock_vllm(tmp_path):
    model, vocab = cut_shape_dir(tmp_path, "qwen3-0.6b")
    # TRITON_ATTN: stock vLLM's default backend (FlashAttention) is not in the GPU bundle
    stock = engine_kwargs(model, load_format="dummy", attention_config={"backend": "TRITON_ATTN"})
    result = run_engine(tmp_path, "disabled", stock,
                        parity_prompts(vocab, 8), [{"batch": 8, "kill": False}], max_tokens=32,
                        env_extra={"MOE_GRAPHS_DISABLE": "1"})
    report("disabled", {"config": result["config"], "log_lines": result["log_lines"]})
    assert result["config"]["worker_cls"] == "vllm.v1.worker.gpu_worker.Worker"
    assert "FULL_AND_PIECEWISE" in result["config"]["cudagraph_mode"]
    assert "moe_graphs_" not in result["phases"][0]["metrics"]
    assert len(result["phases"][0]["tokens"]) == 8


def poll_metrics(base: str, what: str, ok: Callable[[str], bool], limit_s: float = 60.0) -> str:
    """The server's /metrics text once `ok` holds for it; fails after `limit_s` seconds."""
    end = time.monotonic() + limit_s
    while not ok(text := get(base + "/metrics")):
        assert time.monotonic() < end, f"no {what} within {limit_s:.0f} s"
        time.sleep(0.05)
    return text


def test_kill_file_under_load_through_vllm_serve(tmp_path):
    """200 concurrent requests through `vllm serve`; the kill file is created once graphs replay
    under that load and removed once /metrics shows the switch, while requests are still in
    flight. Zero failed requests; after removal a second wave replays again."""
    from tests.tiny_models import build_checkpoint

    path = build_checkpoint(str(tmp_path / "tiny-serve"), head_dim=64)
    kill_file = tmp_path / "serve.kill"
    log = str(tmp_path / "serve.log")
    fallbacks = "moe_graphs_eager_fallbacks_total"
    with vllm_serve(path, None, log, args=("--max-num-seqs", "64", *serve_memory_args(0.5)),
                    env_extra={"MOE_GRAPHS_KILL_FILE": str(kill_file)}) as base:
        def one(i: int, max_tokens: int = 200) -> int:
            body = {"model": path, "prompt": f"request {i} about graphs",
                    "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
            return len(post_json(base + "/v1/completions", body, timeout=300)["choices"][0]
                       ["text"])

        # NOTE: the switch is flipped on what /metrics shows, not on a timer: with no Triton
        # compile left to the first requests (start-up warm-up), the load can end within a
        # second, before a timed flip.
        with concurrent.futures.ThreadPoolExecutor(200) as pool:
            futures = [pool.submit(one, i) for i in range(200)]
            before = poll_metrics(base, "replay under load",
                                  lambda t: metric(t, "moe_graphs_replays_total") > 0)
            kill_file.touch()
            mid = poll_metrics(base, "kill-switch fallback",
                               lambda t: metric(t, fallbacks, reason="kill_switch") > 0)
            in_flight = sum(not f.done() for f in futures)
            kill_file.unlink()
            failures = [repr(f.exception()) for f in futures if f.exception() is not None]
            done = sum(f.result() >= 0 for f in futures if f.exception() is None)
        after_load = get(base + "/metrics")
        for i in range(8):  # a second wave, switch off: must replay again
            one(1000 + i, max_tokens=48)
        text = get(base + "/metrics")
    summary = {"failures": failures[:5], "failed": len(failures), "completed": done,
               "in_flight_when_switched": in_flight,
               "replays_before_switch": metric(before, "moe_graphs_replays_total"),
               "replays_after_load": metric(after_load, "moe_graphs_replays_total"),
               "replays": metric(text, "moe_graphs_replays_total"),
               "kill_switch_fallbacks": metric(text, fallbacks, reason="kill_switch"),
               "kill_switch_fallbacks_mid": metric(mid, fallbacks, reason="kill_switch"),
               "mode_graphs": metric(text, "moe_graphs_info", mode="graphs"),
               "log_tail": tail(log, 15)}
    report("serve-kill-switch", summary)
    assert summary["failed"] == 0 and done == 200, summary
    assert summary["mode_graphs"] == 1 and summary["replays_before_switch"] > 0, summary
    assert summary["kill_switch_fallbacks_mid"] > 0 and in_flight > 0, summary
    assert summary["replays"] > summary["replays_after_load"], summary  # switch off: replays


def test_mixed_traffic_faults_through_vllm_serve(tmp_path):
    """mixed_graphs through `vllm serve` (the tiny checkpoint, a 128-token step budget so long
    prompts chunk): 200 requests of 20-400 prompt tokens arriving over ~4 s; the first capture
    of a key with prefill tokens fails (quarantined), a 1 MiB pool budget denies every capture
    after the next one, and the kill file is created and removed twice under load. Zero failed
    requests, each with all its tokens. (Token identity under faults is the in-process test's:
    a server's batches depend on arrival timing, so two runs are not comparable token by
    token.)"""
    from tests.tiny_models import build_checkpoint

    path = build_checkpoint(str(tmp_path / "tiny-serve"), head_dim=64)
    vocab = json.loads((tmp_path / "tiny-serve" / "config.json").read_text())["vocab_size"]
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAIL_FIRST_MIXED_CAPTURE)
    kill_file = tmp_path / "serve.kill"
    log = str(tmp_path / "serve.log")
    fallbacks = "moe_graphs_eager_fallbacks_total"
    # lazy capture only (idle_capture false): the faults must meet the traffic, not the idle
    # engine before it
    cfg = {"moe_graphs": {"mixed_graphs": True, "graph_memory_budget_mib": 1,
                          "idle_capture": False}}
    rng = random.Random(2)
    # the first prompt is prefilled in four 128-token chunks: the first capture of a key with
    # prefill tokens (the one that fails) comes before any decode key's and the budget
    lengths = [400] + [rng.randrange(20, 400) for _ in range(199)]
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(n)] for n in lengths]
    env = {"MOE_GRAPHS_KILL_FILE": str(kill_file), "MOE_GRAPHS_TEST_FAIL_MIXED_CAPTURE": "1",
           "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    args = ("--max-num-seqs", "64", "--max-model-len", "512", "--max-num-batched-tokens",
            "128", "--enable-chunked-prefill", "--enable-prefix-caching",
            "--additional-config", json.dumps(cfg), *serve_memory_args(0.5))
    with vllm_serve(path, None, log, args=args, env_extra=env) as base:
        def one(i: int) -> int:
            time.sleep(i * 0.02)  # arrivals spread over ~4 s
            body = {"model": path, "prompt": prompts[i], "max_tokens": 512 - len(prompts[i]) - 8,
                    "temperature": 0.0, "ignore_eos": True}
            usage = post_json(base + "/v1/completions", body, timeout=300)["usage"]
            return usage["completion_tokens"] == body["max_tokens"]

        flips = []
        with concurrent.futures.ThreadPoolExecutor(200) as pool:
            futures = [pool.submit(one, i) for i in range(200)]
            for n in (1, 2):  # kill file on, seen, off, then replays again: twice
                poll_metrics(base, "replay under load",
                             lambda t: metric(t, "moe_graphs_replays_total") > 0)
                kill_file.touch()
                poll_metrics(base, "kill-switch fallback",
                             lambda t, n=n: metric(t, fallbacks, reason="kill_switch") >= n)
                flips.append(sum(not f.done() for f in futures))
                kill_file.unlink()
                time.sleep(0.5)
            failures = [repr(f.exception()) for f in futures if f.exception() is not None]
            complete = sum(bool(f.result()) for f in futures if f.exception() is None)
        text = get(base + "/metrics")
    summary = {"failures": failures[:5], "failed": len(failures), "complete": complete,
               "in_flight_at_flips": flips,
               "capture_failures": metric(text, "moe_graphs_capture_failures_total"),
               "captures": metric(text, "moe_graphs_captures_total"),
               **{f"replays_{k}": metric(text, "moe_graphs_replays_total", kind=k)
                  for k in ("decode", "mixed", "prefill")},
               **{f"{r}_fallbacks": metric(text, fallbacks, reason=r)
                  for r in ("kill_switch", "capture_failed", "memory_budget", "mixed_batch")},
               "mode_graphs": metric(text, "moe_graphs_info", mode="graphs"),
               "log_tail": tail(log, 15)}
    report("serve-mixed-faults", summary)
    assert summary["failed"] == 0 and complete == 200, summary
    assert summary["mode_graphs"] == 1 and min(flips) > 0, summary
    assert summary["capture_failures"] == 1 and summary["capture_failed_fallbacks"] > 0, summary
    assert summary["memory_budget_fallbacks"] > 0 and summary["kill_switch_fallbacks"] > 0, summary
    assert summary["mixed_batch_fallbacks"] == 0, summary  # every step with prefill planned


IDLE_SERVE_ARGS = ("--max-num-seqs", "16", "--max-model-len", "512", "--max-num-batched-tokens",
                   "128", "--enable-chunked-prefill", "--no-enable-prefix-caching")


def tiny_prompts(tmp_path, name: str, seed: int, count: int,
                 max_len: int) -> tuple[str, list[list[int]]]:
    """A tiny real checkpoint under `tmp_path / name` and `count` prompts of 20..`max_len`
    random token ids."""
    from tests.tiny_models import build_checkpoint

    path = build_checkpoint(str(tmp_path / name), head_dim=64)
    vocab = json.loads((tmp_path / name / "config.json").read_text())["vocab_size"]
    rng = random.Random(seed)
    return path, [[rng.randrange(10, vocab - 10) for _ in range(rng.randrange(20, max_len))]
                  for _ in range(count)]


def logged_keys(log: str) -> tuple[int, int]:
    """(decode keys, token buckets) a server will capture, from its start-up lines."""
    lines = [ln for ln in open(log) if "moe_graphs: graphs on:" in ln
             or "graphed too (mixed_graphs)" in ln]
    return (int(re.search(r"\((\d+) decode keys", lines[0]).group(1)),
            len(re.search(r"token buckets \[([^\]]*)\]", lines[1]).group(1).split(",")))


def test_idle_capture_captures_while_idle_then_serves_without_capture(tmp_path):
    """idle_capture through `vllm serve` (the tiny checkpoint, 16 sequences, a 128-token step
    budget, no prefix cache): ready as with lazy capture; then, with no request, the engine core
    captures every key (the token buckets, then the decode keys) one at a time; then 64
    requests arriving over ~2 s all complete, every step replayed, with no capture while
    serving; then 8 requests one at a time (the same steps each time) give the same greedy text
    from the idle-captured graphs as with the kill file present."""
    path, prompts = tiny_prompts(tmp_path, "tiny-idle", seed=3, count=64, max_len=300)
    log = str(tmp_path / "serve.log")
    kill_file = tmp_path / "serve.kill"
    args = (*IDLE_SERVE_ARGS,
            "--additional-config", json.dumps({"moe_graphs": {"idle_capture": True}}),
            *serve_memory_args(0.5))
    with vllm_serve(path, None, log, args=args,
                    env_extra={"MOE_GRAPHS_KILL_FILE": str(kill_file)}) as base:
        decode, tokens = logged_keys(log)
        t0 = time.monotonic()
        idle = poll_metrics(base, "every key captured while idle",
                            lambda t: metric(t, "moe_graphs_captures_total") >= decode + tokens)
        idle_s = time.monotonic() - t0

        def one(i: int) -> bool:
            time.sleep(i * 0.03)
            body = {"model": path, "prompt": prompts[i], "max_tokens": 64, "temperature": 0.0,
                    "ignore_eos": True}
            return post_json(base + "/v1/completions", body, timeout=300)["usage"][
                "completion_tokens"] == 64

        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            done = list(pool.map(one, range(64)))
        text = get(base + "/metrics")

        def sequential() -> list[str]:
            return [post_json(base + "/v1/completions",
                              {"model": path, "prompt": prompts[i], "max_tokens": 32,
                               "temperature": 0.0, "ignore_eos": True},
                              timeout=300)["choices"][0]["text"] for i in range(8)]

        graphed = sequential()
        kill_file.touch()
        time.sleep(0.5)  # the switch is re-read at most every 100 ms
        killed = sequential()
        kill_file.unlink()
        after = get(base + "/metrics")
    summary = {"keys": decode + tokens, "decode_keys": decode, "token_keys": tokens,
               "captured_while_idle": metric(idle, "moe_graphs_captures_total"),
               "idle_capture_s": round(idle_s, 1),
               "captures_after_traffic": metric(text, "moe_graphs_captures_total"),
               "complete": sum(done), "fallbacks": metric(text, "moe_graphs_eager_fallbacks_total"),
               **{f"replays_{k}": metric(text, "moe_graphs_replays_total", kind=k)
                  for k in ("decode", "mixed", "prefill")},
               "idle_capture_off": any("idle_capture off" in ln for ln in open(log)),
               "done_logged": sum("idle capture done: no key left" in ln for ln in open(log)),
               "sequential_identical": sum(a == b for a, b in zip(graphed, killed, strict=True)),
               "captures_at_end": metric(after, "moe_graphs_captures_total"),
               "step_captures_at_end": metric(after, "moe_graphs_step_captures_total"),
               "kill_switch_fallbacks": metric(after, "moe_graphs_eager_fallbacks_total",
                                               reason="kill_switch"),
               "log_tail": tail(log, 15)}
    report("serve-idle-capture", summary)
    assert summary["captured_while_idle"] == summary["keys"], summary
    assert summary["complete"] == 64 and not summary["idle_capture_off"], summary
    assert summary["done_logged"] == 1, summary  # the line the serving benchmark waits for
    assert summary["captures_after_traffic"] == summary["keys"], summary  # none while serving
    assert summary["fallbacks"] == 0 and summary["replays_decode"] > 0, summary
    assert summary["replays_mixed"] + summary["replays_prefill"] > 0, summary
    # the idle-captured graphs compute what eager steps of the same keys compute
    assert summary["sequential_identical"] == 8 and summary["kill_switch_fallbacks"] > 0, summary
    assert summary["captures_at_end"] == summary["keys"], summary
    assert summary["step_captures_at_end"] == 0, summary  # no step ever waited for a capture


def test_idle_capture_recaptures_after_wake_up_through_vllm_serve(tmp_path):
    """idle_capture across sleep mode through `vllm serve` (the tiny checkpoint; vLLM's dev API
    /sleep and /wake_up): every key captured while idle after start-up; a level-1 sleep and the
    wake-up drop the graphs; the wake-up, a client call the engine core handles while idle,
    resumes idle capture, which captures every key again and says it is done a second time, all
    before any request; then 4 requests one at a time give the same greedy text as before the
    sleep, every step replayed, with no capture while serving."""
    path, prompts = tiny_prompts(tmp_path, "tiny-wake", seed=4, count=4, max_len=200)
    log = str(tmp_path / "serve.log")
    args = (*IDLE_SERVE_ARGS, "--enable-sleep-mode",
            "--additional-config", json.dumps({"moe_graphs": {"idle_capture": True}}),
            *serve_memory_args(0.5))

    def sequential(base: str) -> list[str]:
        return [post_json(base + "/v1/completions",
                          {"model": path, "prompt": p, "max_tokens": 32, "temperature": 0.0,
                           "ignore_eos": True}, timeout=300)["choices"][0]["text"]
                for p in prompts]

    def post(url: str) -> None:
        urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"),
                               timeout=120).read()

    def done_lines() -> int:
        return sum("idle capture done: no key left" in ln for ln in open(log))

    with vllm_serve(path, None, log, args=args, env_extra={"VLLM_SERVER_DEV_MODE": "1"}) as base:
        keys = sum(logged_keys(log))
        poll_metrics(base, "every key captured while idle",
                     lambda t: metric(t, "moe_graphs_captures_total") >= keys)
        before = sequential(base)
        captured = metric(get(base + "/metrics"), "moe_graphs_captures_total")
        with sleep_or_wake():
            post(base + "/sleep?level=1")
            asleep = json.loads(get(base + "/is_sleeping"))["is_sleeping"]
            post(base + "/wake_up")
        t0 = time.monotonic()
        woken = poll_metrics(base, "every key captured again after the wake-up",
                             lambda t: metric(t, "moe_graphs_captures_total") >= captured + keys)
        recapture_s = time.monotonic() - t0
        deadline = time.monotonic() + 10  # the done line follows the last capture's metrics
        while done_lines() < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        after = sequential(base)
        text = get(base + "/metrics")
    summary = {"keys": keys, "captured_before_sleep": captured, "asleep": asleep,
               "captures_after_wake": metric(woken, "moe_graphs_captures_total") - captured,
               "recapture_s": round(recapture_s, 1),
               "invalidations": metric(text, "moe_graphs_invalidations_total"),
               "done_logged": done_lines(),
               "identical_after_wake": sum(a == b for a, b in zip(before, after, strict=True)),
               "captures_while_serving": metric(text, "moe_graphs_captures_total")
               - metric(woken, "moe_graphs_captures_total"),
               "step_captures": metric(text, "moe_graphs_step_captures_total"),
               "fallbacks": metric(text, "moe_graphs_eager_fallbacks_total"),
               "replays_decode": metric(text, "moe_graphs_replays_total", kind="decode"),
               "log_tail": tail(log, 15)}
    report("serve-idle-capture-wake-up", summary)
    assert summary["asleep"] is True and summary["invalidations"] > 0, summary
    assert summary["captured_before_sleep"] == keys, summary  # every key, none while serving
    assert summary["captures_after_wake"] == keys and summary["done_logged"] == 2, summary
    assert summary["identical_after_wake"] == 4, summary
    assert summary["captures_while_serving"] == 0 and summary["fallbacks"] == 0, summary
    assert summary["replays_decode"] > 0 and summary["step_captures"] == 0, summary
