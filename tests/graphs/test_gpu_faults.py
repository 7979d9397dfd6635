"""GPU tier for the graph runner inside real vLLM 0.26.0 (end to end): faults in one engine and the
off switch. A capture that fails is quarantined, a full graph-memory budget denies captures, the
kill file flips, and the output stays token-identical to the kill-switch phase; with
`MOE_GRAPHS_DISABLE=1` the engine is stock vLLM. Engines run through
tests/graphs/engine_harness.py; MOE_GRAPHS_TEST_OUT=/dir gets one JSON summary per test there."""

from __future__ import annotations

import pytest

from tests.gpu_util import require_cuda_and_vllm
from tests.graphs.engine_harness import (MIXED_FAULTS_PLUGIN, cut_shape_dir, engine_kwargs,
                                          metric, parity_prompts, report, run_engine, run_mixed)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda_and_vllm():
    require_cuda_and_vllm()


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
