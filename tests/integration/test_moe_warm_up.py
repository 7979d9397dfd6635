"""The fused-MoE part of the start-up warm-up (integration/moe_warm_up.py), against vLLM 0.26's
real config lookup (`try_get_optimal_moe_config`, its tuned H200 table and its defaults)."""

from __future__ import annotations

import pytest

from vllm_moe_graphs.integration.moe_warm_up import (
    MoeCall,
    moe_token_counts,
    recording_moe_configs,
)

# Qwen3-30B-A3B's experts at TP 1: w13 [E, 2 * 768, 2048], w2 [E, 2048, 768], top-k 8.
W1, W2, TOP_K = (128, 1536, 2048), (128, 2048, 768), 8


@pytest.fixture
def device_named(monkeypatch):
    """vLLM's config lookup reads the GPU's name (a tuned table per GPU); name one."""
    from vllm.platforms import current_platform

    def named(name: str) -> None:
        monkeypatch.setattr(type(current_platform), "get_device_name",
                            classmethod(lambda cls, device_id=0: name))
    return named


def _vllm_lookup():
    from vllm.model_executor.layers.fused_moe.experts import triton_moe

    return triton_moe


def test_recording_sees_vllms_lookup_and_puts_it_back(device_named):
    device_named("NVIDIA H200")
    module = _vllm_lookup()
    original = module.try_get_optimal_moe_config
    with recording_moe_configs() as calls:
        assert module.try_get_optimal_moe_config is not original
        got = module.try_get_optimal_moe_config(W1, W2, TOP_K, None, 5)
        module.try_get_optimal_moe_config(W1, W2, top_k=TOP_K, dtype=None, M=300)  # same layer
    assert module.try_get_optimal_moe_config is original
    assert len(calls) == 1 and (calls[0].num_experts, calls[0].top_k) == (128, TOP_K)
    assert got == original(W1, W2, TOP_K, None, 5) == calls[0].config_of(5)
    assert calls[0].config_of(3000) == original(W1, W2, TOP_K, None, 3000) != got


def _variants(call: MoeCall, m: int) -> tuple:
    """What vLLM 0.26's fused_moe_kernel launch specialises on for Qwen3-MoE's shapes: the
    config, the naive path, M * top_k divisible by 16 (the valid and, E * (BLOCK_M - 1) being
    a multiple of 16, the padded token counts), and M below BLOCK_SIZE_M."""
    cfg = call.config_of(m)
    return (repr(sorted(cfg.items())), m * call.top_k * 4 <= call.num_experts,
            m * call.top_k % 16 == 0, m < cfg["BLOCK_SIZE_M"])


@pytest.mark.parametrize("gpu", ["NVIDIA H200", "no tuned table"])
def test_token_counts_reach_every_kernel_variant(device_named, gpu):
    device_named(gpu)
    module = _vllm_lookup()
    with recording_moe_configs() as calls:
        module.try_get_optimal_moe_config(W1, W2, TOP_K, None, 1)
    limit, done = 8192, [1, 2, 4, 8, 16, 32, 64, 8191]
    counts = moe_token_counts(calls, limit, done)
    assert counts == sorted(set(counts)) and not set(counts) & set(done)
    assert all(1 <= m <= limit for m in counts)
    every = {_variants(calls[0], m) for m in range(1, limit + 1)}
    reached = {_variants(calls[0], m) for m in counts + done}
    assert reached == every
    assert len(counts) < 80  # a few per config group, not every token count


def test_nothing_recorded_nothing_added():
    assert moe_token_counts([], 8192, [1, 2]) == []
    with recording_moe_configs() as calls:
        pass  # a dense model: vLLM's MoE lookup is never called
    assert calls == []


def test_a_changed_lookup_is_left_alone(monkeypatch, caplog):
    module = _vllm_lookup()

    def drifted(w1_shape, w2_shape, top_k, dtype, num_tokens, block_shape=None):
        return {}

    monkeypatch.setattr(module, "try_get_optimal_moe_config", drifted)
    with recording_moe_configs() as calls:
        assert module.try_get_optimal_moe_config is drifted  # not wrapped
    assert calls == [] and "fused-MoE token counts are left out" in caplog.text
