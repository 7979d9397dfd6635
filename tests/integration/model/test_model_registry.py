"""Exact-type model / layer registry: configs, real vLLM classes, and real vLLM layer instances.

Classes come from the installed vLLM 0.26 (importable on CPU). Layer *instances* need a vLLM
platform: they are built in a subprocess with the CPU build of vLLM 0.26 (`cpu_vllm` fixture,
skipped when the overlay is absent), as tiny real Qwen3 / Qwen3-MoE / Llama models on the meta
device.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from torch import nn

from tests.serve_util import run_result_script
from vllm_moe_graphs.capability import Reason
from vllm_moe_graphs.integration.model.registry import (
    AttentionLayerRegistry,
    classify_config,
    classify_layer_type,
    classify_model_class,
    register_model,
)

# NOTE: transformers and vLLM import triton. They are imported inside the tests, never at module
# import: triton imported before TRITON_INTERPRET=1 is set (tests/ops/conftest.py, test_proofs)
# breaks the interpreter for the whole session.

REPO = pathlib.Path(__file__).resolve().parents[3]
SHIPPED = REPO / "vllm_moe_graphs" / "model_configs"

# DeepSeek-V2-Lite's config.json, trimmed: MLA fields and no head_dim anywhere.
DEEPSEEK_V2 = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 16,
    "num_hidden_layers": 27, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 64, "num_experts_per_tok": 6,
}
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
         "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}


# ---------------------------------------------------------------------------- configs


@pytest.mark.parametrize("shipped", ["qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b"])
def test_shipped_qwen3_configs_are_eligible(shipped):
    from transformers import PretrainedConfig

    config = json.loads((SHIPPED / shipped / "config.json").read_text())
    assert classify_config(config).holds
    config.pop("rope_scaling")  # deprecated key, transformers warns about it
    assert classify_config(PretrainedConfig(**config)).holds


def test_deepseek_v2_mla_without_head_dim():
    from transformers import PretrainedConfig

    assert "head_dim" not in DEEPSEEK_V2
    p = classify_config(DEEPSEEK_V2)
    assert p.reason is Reason.MLA_LAYOUT_UNSUPPORTED and "deepseek_v2" in p.detail
    obj = PretrainedConfig(**DEEPSEEK_V2)
    with pytest.raises(AttributeError):
        obj.head_dim  # noqa: B018 - reading it would crash: the classifier must not
    assert classify_config(obj).reason is Reason.MLA_LAYOUT_UNSUPPORTED


@pytest.mark.parametrize("config", [
    {"model_type": "deepseek_v3"},  # model type alone
    {"architectures": ["Qwen3ForCausalLM"], "kv_lora_rank": 512},  # latent KV beats the name
    {"architectures": ["DeepseekV3ForCausalLM"]},
    {"architectures": ["Qwen3ForCausalLM"], "use_mla": True},
])
def test_mla_is_decided_first(config):
    assert classify_config(config).reason is Reason.MLA_LAYOUT_UNSUPPORTED


@pytest.mark.parametrize("config", [
    LLAMA,
    "LlamaConfig",  # the transformers object, built in the test
    {},
    {"architectures": ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"]},
    {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"},
    {"architectures": ["Qwen2ForCausalLM"], "head_dim": None},
])
def test_other_architectures_are_unsupported(config):
    if config == "LlamaConfig":
        from transformers import LlamaConfig

        config = LlamaConfig(architectures=["LlamaForCausalLM"])
    p = classify_config(config)
    assert p.name == "model_config" and p.reason is Reason.UNSUPPORTED_ARCHITECTURE


# ---------------------------------------------------------------------------- real vLLM classes


def test_model_classes_by_exact_type():
    from vllm.model_executor.models.deepseek_v2 import (
        DeepseekV2ForCausalLM,
        DeepseekV3ForCausalLM,
    )
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.mellum import MellumForCausalLM
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

    assert classify_model_class(Qwen3ForCausalLM).holds
    assert classify_model_class(Qwen3MoeForCausalLM).holds
    sub = classify_model_class(MellumForCausalLM)  # a real subclass of Qwen3MoeForCausalLM
    assert sub.reason is Reason.UNSUPPORTED_ARCHITECTURE and "exact type" in sub.detail
    assert classify_model_class(LlamaForCausalLM).reason is Reason.UNSUPPORTED_ARCHITECTURE
    for cls in (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM):
        assert classify_model_class(cls).reason is Reason.MLA_LAYOUT_UNSUPPORTED


def test_layer_classes_by_exact_type():
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2MLAAttention
    from vllm.model_executor.models.llama import LlamaAttention
    from vllm.model_executor.models.mellum import MellumAttention
    from vllm.model_executor.models.qwen3 import Qwen3Attention
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeAttention

    assert classify_layer_type(Qwen3Attention).holds
    assert classify_layer_type(Qwen3MoeAttention).holds
    sub = classify_layer_type(MellumAttention)
    assert sub.reason is Reason.UNSUPPORTED_ARCHITECTURE and "Qwen3MoeAttention" in sub.detail
    for cls in (LlamaAttention, Attention, nn.Linear):
        assert classify_layer_type(cls).reason is Reason.UNSUPPORTED_ARCHITECTURE
    for cls in (DeepseekV2MLAAttention, MLAAttention):
        assert classify_layer_type(cls).reason is Reason.MLA_LAYOUT_UNSUPPORTED


def test_registry_denies_modules_that_are_not_qwen3_attention():
    registry = AttentionLayerRegistry()
    empty = registry.proof()
    assert empty.name == "model_layers" and empty.reason is Reason.UNSUPPORTED_ARCHITECTURE
    p = registry.register("model.layers.0.self_attn", nn.Linear(2, 2))
    assert p.reason is Reason.UNSUPPORTED_ARCHITECTURE and "Linear" in p.detail
    assert registry.proof() == p and registry.layer_indices == {}
    assert register_model(nn.Sequential()).proof().reason is Reason.UNSUPPORTED_ARCHITECTURE


def test_importing_the_registry_imports_no_vllm():
    code = ("import sys, vllm_moe_graphs.integration.model.registry as r; "
            "r.classify_config({'architectures': ['DeepseekV2ForCausalLM']}); "
            "assert not any(m.split('.')[0] == 'vllm' for m in sys.modules), 'vllm imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)


def test_fp8_layers_only_on_the_kernels_the_proofs_ran_on():
    """vLLM 0.26's own classes (not constructed: their __init__ needs a GPU config): an FP8
    linear layer on the CUTLASS block GEMM and a fused MoE on Triton experts pass; DeepGEMM's
    GEMM, the per-tensor CUTLASS GEMM and other experts are named; an FP8 KV cache's method
    (no weights) and unquantized layers are not FP8 layers."""
    pytest.importorskip("vllm.model_executor.layers.quantization.fp8")
    from types import SimpleNamespace as ns

    from vllm.model_executor.kernels.linear.scaled_mm.cutlass import (
        CutlassFp8BlockScaledMMKernel, CutlassFP8ScaledMMLinearKernel)
    from vllm.model_executor.kernels.linear.scaled_mm.deep_gemm import (
        DeepGemmFp8BlockScaledMMKernel)
    from vllm.model_executor.layers.fused_moe.experts.deep_gemm_moe import DeepGemmExperts
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.model_executor.layers.quantization.fp8 import (
        Fp8KVCacheMethod, Fp8LinearMethod, Fp8MoEMethod)
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from vllm_moe_graphs.integration.model.registry import unproven_fp8_kernel

    def bare(cls, **attrs):
        obj = cls.__new__(cls)
        obj.__dict__.update(attrs)
        return obj

    def linear(kernel):
        return ns(quant_method=bare(Fp8LinearMethod, fp8_linear=bare(kernel)))

    def moe(experts):
        kernel = ns(impl=ns(fused_experts=bare(experts)))
        return ns(quant_method=bare(Fp8MoEMethod, moe_kernel=kernel))

    assert unproven_fp8_kernel(linear(CutlassFp8BlockScaledMMKernel)) is None
    assert unproven_fp8_kernel(moe(TritonExperts)) is None
    assert unproven_fp8_kernel(linear(DeepGemmFp8BlockScaledMMKernel)) == \
        "DeepGemmFp8BlockScaledMMKernel"
    assert unproven_fp8_kernel(linear(CutlassFP8ScaledMMLinearKernel)) == \
        "CutlassFP8ScaledMMLinearKernel"
    assert unproven_fp8_kernel(moe(DeepGemmExperts)) == "DeepGemmExperts"
    assert unproven_fp8_kernel(ns(quant_method=bare(Fp8KVCacheMethod))) is None
    assert unproven_fp8_kernel(ns(quant_method=bare(UnquantizedLinearMethod))) is None
    assert unproven_fp8_kernel(ns()) is None


# ---------------------------------------------------------------------------- real vLLM layers

_BUILD = r"""
import json, sys, tempfile
import torch
from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM
from vllm_moe_graphs.integration.model.registry import AttentionLayerRegistry, register_model
from vllm_moe_graphs.kv import PagedKVStorage

PORT = int(sys.argv[1])
common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=256)

def build(cls, hf_config, first=False):
    path = tempfile.mkdtemp()
    hf_config.save_pretrained(path)
    vc = VllmConfig(model_config=ModelConfig(model=path, skip_tokenizer_init=True,
                                             dtype="float32"))
    with set_current_vllm_config(vc):
        if first:  # vLLM creates its expert-parallel group only under a MoE config
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{PORT}")
            initialize_model_parallel(1, 1)
        with torch.device("meta"):
            return cls(vllm_config=vc, prefix="")

moe = build(Qwen3MoeForCausalLM, Qwen3MoeConfig(
    architectures=["Qwen3MoeForCausalLM"], intermediate_size=64, moe_intermediate_size=32,
    num_experts=4, num_experts_per_tok=2, **common), first=True)
dense = build(Qwen3ForCausalLM, Qwen3Config(architectures=["Qwen3ForCausalLM"],
                                            intermediate_size=64, **common))
llama = build(LlamaForCausalLM, LlamaConfig(architectures=["LlamaForCausalLM"],
                                            intermediate_size=64, **common))

def summary(reg):
    p = reg.proof()
    return {"reason": p.reason.value, "detail": p.detail, "indices": reg.layer_indices,
            "layers": [[x.family, x.num_kv_heads, x.head_size] for x in reg.layers]}

out = {"dense": summary(register_model(dense)), "moe": summary(register_model(moe)),
       "llama": summary(register_model(llama))}
attn = [(n, m) for n, m in dense.named_modules() if type(m).__name__ == "Qwen3Attention"]
out["attn_prefixes"] = [n for n, _ in attn]

dup = AttentionLayerRegistry()
out["dup_first"] = dup.register(*attn[0]).reason.value
out["dup_second"] = dup.register(*attn[0]).detail
out["dup"] = summary(dup)
gap = AttentionLayerRegistry()
gap.register(*attn[0]); gap.register(*attn[2])
out["gap"] = summary(gap)
wrong = AttentionLayerRegistry()
wrong.register("model.layers.9.self_attn", attn[0][1])
out["wrong_prefix"] = summary(wrong)
llama_attn = [(n, m) for n, m in llama.named_modules() if type(m).__name__ == "LlamaAttention"]
foreign = AttentionLayerRegistry()
foreign.register(*llama_attn[0])
out["llama_attn"] = summary(foreign)

reg = register_model(dense)
storage = PagedKVStorage()
kv = lambda heads: torch.empty(4, 16, heads, 64, device="meta").permute(0, 2, 1, 3)
storage.bind({n: kv(2) for n in reg.layer_indices}, layer_indices=reg.layer_indices,
             phase="serving")
out["match"] = reg.match_storage(storage.identity()).reason.value
storage.bind({n: kv(1 if i == 1 else 2) for n, i in reg.layer_indices.items()},
             layer_indices=reg.layer_indices, phase="serving")
p = reg.match_storage(storage.identity())
out["mismatch"] = [p.reason.value, p.detail]
storage.bind({n: kv(2) for n in list(reg.layer_indices)[:2]}, phase="serving")
out["missing"] = reg.match_storage(storage.identity()).reason.value
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def built(cpu_vllm) -> dict:
    return run_result_script(_BUILD, cpu_vllm, timeout=300)


def _names(n: int) -> dict[str, int]:
    return {f"model.layers.{i}.self_attn.attn": i for i in range(n)}


def test_real_qwen3_and_qwen3_moe_models_register(built):
    for kind, family in (("dense", "qwen3"), ("moe", "qwen3_moe")):
        assert built[kind]["reason"] == "eligible", built[kind]
        assert built[kind]["indices"] == _names(3)
        assert built[kind]["layers"] == [[family, 2, 32]] * 3
    assert built["attn_prefixes"] == [f"model.layers.{i}.self_attn" for i in range(3)]


def test_real_llama_model_and_layer_are_unsupported(built):
    assert built["llama"]["reason"] == "unsupported_architecture"
    assert "LlamaForCausalLM" in built["llama"]["detail"] and built["llama"]["indices"] == {}
    assert built["llama_attn"]["reason"] == "unsupported_architecture"
    assert "LlamaAttention" in built["llama_attn"]["detail"]


def test_real_layers_refuse_duplicates_gaps_and_wrong_prefixes(built):
    assert built["dup_first"] == "eligible"
    assert "duplicate" in built["dup_second"]
    assert built["dup"]["reason"] == "unsupported_architecture"
    assert built["dup"]["indices"] == _names(1)
    assert built["gap"]["reason"] == "unsupported_architecture"
    assert "missing [1]" in built["gap"]["detail"]
    assert built["wrong_prefix"]["reason"] == "unsupported_architecture"
    assert "model.layers.0.self_attn.attn" in built["wrong_prefix"]["detail"]


def test_registry_matches_storage_geometry(built):
    assert built["match"] == "eligible"
    reason, detail = built["mismatch"]
    assert reason == "storage_identity_changed" and "model.layers.1.self_attn.attn" in detail
    assert "1 heads" in detail
    assert built["missing"] == "storage_identity_changed"
