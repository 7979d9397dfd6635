from __future__ import annotations

import dataclasses
import re

import pytest

from vllm_moe_graphs.capability import (
    CONFIG_PROOFS,
    REMEDY,
    ConfigFacts,
    DecodeGraphCapability,
    Fp8Scheme,
    Proof,
    Reason,
    WeightQuantization,
    config_capability,
    runtime_capability,
)

ELIGIBLE_FACTS = ConfigFacts(
    architectures=("Qwen3MoeForCausalLM",), model_type="qwen3_moe", has_mla=False,
    dtype="bfloat16", kv_cache_dtype="auto", is_cuda=True, enforce_eager=False,
    tensor_parallel_size=1, pipeline_parallel_size=1, speculative=False, lora=False,
    offload="uva", is_moe=True)
# FP8 weights as integration/config_facts.py reads them
BLOCK_FP8 = WeightQuantization("fp8", Fp8Scheme.BLOCK)  # a block checkpoint
ONLINE_FP8 = WeightQuantization("fp8", Fp8Scheme.PER_TENSOR)  # --quantization fp8


def test_eligible_config():
    report = config_capability(ELIGIBLE_FACTS)
    assert report.eligible
    assert report.reasons == (Reason.ELIGIBLE,)
    assert [p.name for p in report.proofs] == list(CONFIG_PROOFS)
    assert report.render().startswith("eligible")


@pytest.mark.parametrize("change,reason", [
    (dict(disabled_by_env=True), Reason.DISABLED_BY_ENV),
    (dict(plugin_enabled=False), Reason.DISABLED_BY_CONFIG),
    (dict(is_cuda=False), Reason.NO_CUDA),
    (dict(architectures=("LlamaForCausalLM",), model_type="llama"),
     Reason.UNSUPPORTED_ARCHITECTURE),
    (dict(architectures=(),), Reason.UNSUPPORTED_ARCHITECTURE),
    (dict(architectures=("Qwen3ForCausalLM", "LlamaForCausalLM")),
     Reason.UNSUPPORTED_ARCHITECTURE),
    (dict(architectures=("DeepseekV2ForCausalLM",), model_type="deepseek_v2"),
     Reason.MLA_LAYOUT_UNSUPPORTED),
    (dict(has_mla=True), Reason.MLA_LAYOUT_UNSUPPORTED),
    (dict(head_size=32), Reason.UNSUPPORTED_ARCHITECTURE),
    (dict(dtype="float32"), Reason.UNSUPPORTED_DTYPE),
    (dict(kv_cache_dtype="fp8"), Reason.UNSUPPORTED_DTYPE),
    (dict(enforce_eager=True), Reason.ENFORCE_EAGER),
    (dict(pipeline_parallel_size=2), Reason.PIPELINE_PARALLEL),
    (dict(pipeline_parallel_size=2, tensor_parallel_size=2), Reason.PIPELINE_PARALLEL),
    (dict(tensor_parallel_size=2), Reason.TENSOR_PARALLEL),
    (dict(speculative=True), Reason.SPECULATIVE_DECODING),
    (dict(lora=True), Reason.LORA),
    (dict(offload="uva_disabled"), Reason.OFFLOAD_NOT_GRAPH_SAFE),
    (dict(offload="prefetch"), Reason.OFFLOAD_NOT_GRAPH_SAFE),
    (dict(offload="something_new"), Reason.OFFLOAD_NOT_GRAPH_SAFE),
    (dict(quantization=BLOCK_FP8), Reason.UNSUPPORTED_QUANTIZATION),
    (dict(quantization=WeightQuantization("fp8_per_block", Fp8Scheme.BLOCK)),
     Reason.UNSUPPORTED_QUANTIZATION),
    (dict(quantization=WeightQuantization("fp8", Fp8Scheme.STATIC)),
     Reason.UNSUPPORTED_QUANTIZATION),
    (dict(quantization=WeightQuantization("fp8_per_channel", Fp8Scheme.PER_CHANNEL)),
     Reason.UNSUPPORTED_QUANTIZATION),
    (dict(quantization=WeightQuantization("fp8")), Reason.UNSUPPORTED_QUANTIZATION),  # unknown
    (dict(quantization=WeightQuantization("awq")), Reason.UNSUPPORTED_QUANTIZATION),
    # per-tensor FP8: the MoE's one activation scale per step makes it its own reason; a dense
    # model's linear layers quantize per token (unproven only)
    (dict(quantization=ONLINE_FP8), Reason.FP8_PER_TENSOR_MOE),
    (dict(quantization=WeightQuantization("fp8_per_tensor", Fp8Scheme.PER_TENSOR)),
     Reason.FP8_PER_TENSOR_MOE),
    (dict(quantization=ONLINE_FP8, is_moe=False), Reason.UNSUPPORTED_QUANTIZATION),
    (dict(sliding_window=4096), Reason.SLIDING_WINDOW),
    (dict(runner_type="pooling"), Reason.POOLING_RUNNER),
    (dict(data_parallel_size=2, is_moe=True), Reason.DATA_PARALLEL),
    (dict(user_compilation="-O3"), Reason.USER_COMPILATION),
    (dict(user_compilation="-cc.cudagraph_mode=FULL_DECODE_ONLY"), Reason.USER_COMPILATION),
    (dict(enforce_eager=True, user_compilation="-O3"), Reason.ENFORCE_EAGER),
])
def test_each_config_deny(change, reason):
    report = config_capability(dataclasses.replace(ELIGIBLE_FACTS, **change))
    assert not report.eligible
    assert report.reasons == (reason,)
    assert reason.value in report.render() and REMEDY[reason] in report.render()


@pytest.mark.parametrize("change", [
    dict(data_parallel_size=2, is_moe=False),  # a dense model's DP ranks are independent engines
    dict(sliding_window=0),  # 0 is vLLM's "no window"
    dict(quantization=None, user_compilation=""),
])
def test_settings_that_stay_eligible(change):
    assert config_capability(dataclasses.replace(ELIGIBLE_FACTS, **change)).eligible


def test_no_quantization_is_proven_yet():
    # deny by default: a method joins PROVEN_QUANTIZATION only with its GPU parity test
    from vllm_moe_graphs.capability import PROVEN_QUANTIZATION

    assert PROVEN_QUANTIZATION == frozenset()


def test_block_fp8_on_other_kernels_is_refused_even_when_taken_over():
    deep_gemm = "DeepGEMM's JIT GEMM (installed, VLLM_USE_DEEP_GEMM on)"
    taken = dataclasses.replace(ELIGIBLE_FACTS, quantization=BLOCK_FP8, is_moe=True,
                                unproven=frozenset({"fp8"}))
    assert config_capability(taken).eligible
    report = config_capability(dataclasses.replace(taken, fp8_kernels=deep_gemm))
    assert report.reasons == (Reason.FP8_UNPROVEN_KERNELS,)
    assert deep_gemm in report.render()
    # not taken over: the method itself is unproven, whatever kernels would run
    refused = dataclasses.replace(taken, unproven=frozenset(), fp8_kernels=deep_gemm)
    assert config_capability(refused).reasons == (Reason.UNSUPPORTED_QUANTIZATION,)


def test_mla_wins_over_architecture_even_with_qwen_name():
    # a latent-KV config is classified MLA before anything else is read about its heads
    facts = dataclasses.replace(ELIGIBLE_FACTS, has_mla=True)
    assert config_capability(facts).reasons == (Reason.MLA_LAYOUT_UNSUPPORTED,)


def test_reasons_accumulate_in_proof_order():
    facts = dataclasses.replace(ELIGIBLE_FACTS, is_cuda=False, lora=True, enforce_eager=True)
    assert config_capability(facts).reasons == (Reason.NO_CUDA, Reason.ENFORCE_EAGER, Reason.LORA)


def test_runtime_capability_requires_storage_proof():
    config = config_capability(ELIGIBLE_FACTS)
    without = runtime_capability(config)
    assert not without.eligible and without.reasons == (Reason.UNPROVEN,)
    assert without.missing == ("storage",)
    assert "proof 'storage' missing" in without.render()
    unbound = runtime_capability(config, Proof("storage", Reason.STORAGE_UNBOUND))
    assert unbound.reasons == (Reason.STORAGE_UNBOUND,)
    bound = runtime_capability(config, Proof("storage", Reason.ELIGIBLE))
    assert bound.eligible


def test_empty_report_is_a_deny():
    report = DecodeGraphCapability.compose([])
    assert not report.eligible and report.reasons == (Reason.UNPROVEN,)


def test_with_proofs_replaces_by_name():
    report = DecodeGraphCapability.compose([Proof("storage", Reason.STORAGE_UNBOUND)],
                                           required=["storage"])
    assert report.with_proofs(Proof("storage", Reason.ELIGIBLE)).eligible
    changed = report.with_proofs(Proof("storage", Reason.STORAGE_IDENTITY_CHANGED))
    assert changed.reasons == (Reason.STORAGE_IDENTITY_CHANGED,)


def test_duplicate_proof_names_rejected():
    with pytest.raises(AssertionError, match="duplicate"):
        DecodeGraphCapability.compose([Proof("a", Reason.ELIGIBLE), Proof("a", Reason.LORA)])


def test_report_is_frozen():
    report = config_capability(ELIGIBLE_FACTS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.proofs = ()  # type: ignore[misc]


def test_reason_values_are_unique_snake_case():
    values = [r.value for r in Reason]
    assert len(values) == len(set(values))
    assert all(re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", v) for v in values), values


def test_every_reason_documented():
    import pathlib

    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "capability.md").read_text()
    missing = [r.value for r in Reason if f"| `{r.value}` |" not in doc]
    assert not missing, f"docs/capability.md lacks {missing}"


def test_every_sampler_fallback_documented():
    import pathlib

    from vllm_moe_graphs.ops.sampling_plan import SamplingRefusal

    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "capability.md").read_text()
    section = doc[doc.index("## Sampler fallbacks"):]
    missing = [r.value for r in SamplingRefusal
               if r is not SamplingRefusal.SERVABLE and f"`{r.value}`" not in section]
    assert not missing, f"docs/capability.md's sampler fallbacks lack {missing}"


@pytest.mark.parametrize("change,unproven,taken", [
    (dict(kv_cache_dtype="fp8"), {"fp8_kv"}, ["an FP8 KV cache (kv_cache_dtype fp8)"]),
    (dict(kv_cache_dtype="fp8_e4m3"), {"fp8_kv", "fp8"},
     ["an FP8 KV cache (kv_cache_dtype fp8_e4m3)"]),
    (dict(quantization=BLOCK_FP8), {"fp8"}, [f"FP8 weights (quantization {BLOCK_FP8})"]),
    (dict(quantization=WeightQuantization("fp8_per_block", Fp8Scheme.BLOCK)), {"fp8"},
     ["FP8 weights (quantization fp8_per_block: block-quantized FP8, 128x128 weight blocks, "
      "activations quantized per token and 128-column group)"]),
    (dict(quantization=BLOCK_FP8, kv_cache_dtype="fp8"), {"fp8", "fp8_kv"},
     [f"FP8 weights (quantization {BLOCK_FP8})", "an FP8 KV cache (kv_cache_dtype fp8)"]),
    (dict(), {"fp8", "fp8_kv"}, []),  # nothing unproven in use: nothing said
])
def test_unproven_configurations_taken_over_for_proof_runs(change, unproven, taken):
    from vllm_moe_graphs.capability import unproven_taken_over

    facts = dataclasses.replace(ELIGIBLE_FACTS, **change, unproven=frozenset(unproven))
    assert config_capability(facts).eligible
    assert unproven_taken_over(facts) == taken
    if change:  # without MOE_GRAPHS_UNPROVEN the same configuration is denied
        assert not config_capability(dataclasses.replace(facts, unproven=frozenset())).eligible


@pytest.mark.parametrize("change,unproven,reason", [
    (dict(kv_cache_dtype="fp8_e5m2"), {"fp8_kv"}, Reason.UNSUPPORTED_DTYPE),
    (dict(kv_cache_dtype="fp8"), {"fp8"}, Reason.UNSUPPORTED_DTYPE),
    (dict(quantization=WeightQuantization("awq")), {"fp8", "fp8_kv"},
     Reason.UNSUPPORTED_QUANTIZATION),
    (dict(quantization=BLOCK_FP8), {"fp8_kv"}, Reason.UNSUPPORTED_QUANTIZATION),
    # only block FP8 is taken over; per-tensor FP8 on an MoE model never
    (dict(quantization=ONLINE_FP8), {"fp8", "fp8_kv"}, Reason.FP8_PER_TENSOR_MOE),
    (dict(quantization=ONLINE_FP8, is_moe=False), {"fp8"}, Reason.UNSUPPORTED_QUANTIZATION),
    (dict(quantization=WeightQuantization("fp8", Fp8Scheme.STATIC)), {"fp8"},
     Reason.UNSUPPORTED_QUANTIZATION),
    (dict(quantization=WeightQuantization("fp8_per_channel", Fp8Scheme.PER_CHANNEL)), {"fp8"},
     Reason.UNSUPPORTED_QUANTIZATION),
    (dict(quantization=WeightQuantization("fp8")), {"fp8"}, Reason.UNSUPPORTED_QUANTIZATION),
    # vLLM computes the scales with a host read on the first forward
    (dict(kv_cache_dtype="fp8", calculate_kv_scales=True), {"fp8_kv"}, Reason.UNSUPPORTED_DTYPE),
])
def test_unproven_names_only_what_they_name(change, unproven, reason):
    from vllm_moe_graphs.capability import unproven_taken_over

    facts = dataclasses.replace(ELIGIBLE_FACTS, **change, unproven=frozenset(unproven))
    assert config_capability(facts).reasons == (reason,)
    assert not [x for x in unproven_taken_over(facts) if x.startswith("FP8 weights")]


def test_per_tensor_fp8_on_moe_is_refused_even_if_listed_as_proven(monkeypatch):
    # no parity test can prove it: the MoE's activation scale spans the step's padding rows
    import vllm_moe_graphs.capability as capability

    monkeypatch.setattr(capability, "PROVEN_QUANTIZATION", frozenset({ONLINE_FP8, BLOCK_FP8}))
    facts = dataclasses.replace(ELIGIBLE_FACTS, quantization=ONLINE_FP8)
    assert config_capability(facts).reasons == (Reason.FP8_PER_TENSOR_MOE,)
    assert config_capability(dataclasses.replace(facts, quantization=BLOCK_FP8)).eligible
