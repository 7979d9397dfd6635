"""`tests/fp8_checkpoint.py` against vLLM 0.26's own loader (CPU build).

Tiny checkpoints (hidden 256, 2 heads x 128, 128 experts, top-8) are written, then read back two
ways: here, from the safetensors header (names, dtypes, shapes); and in a subprocess, by vLLM
itself: `Fp8Config.from_config` on the checkpoint's quantization_config, the model built from the
directory (`initialize_model`: which quant method each layer got) and loaded by
`DefaultModelLoader`'s weight iterator and the model's own `load_weights` (packing q/k/v,
gate/up and the experts). Every parameter is checked by value (a scale left unloaded would keep
vLLM's placeholder): each FP8 one and its scale byte-equal to vLLM's `per_block_cast_to_fp8` of
the original bf16 weights packed the same way, its dequantized value close to them; every other
one equal to its original. Not run:
`process_weights_after_loading` (on the CPU it repacks for the CPU's kernels; on Hopper the
block layouts stay as loaded).
"""

from __future__ import annotations

import json

import pytest

from tests.serve_util import run_result_script

SEED = 3
COMMON = dict(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=128,
              max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1000000.0,
              hidden_act="silu", bos_token_id=0, eos_token_id=0)
DENSE = dict(COMMON, architectures=["Qwen3ForCausalLM"], model_type="qwen3",
             tie_word_embeddings=True)
MOE = dict(COMMON, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
           tie_word_embeddings=False, moe_intermediate_size=128, num_experts=128,
           num_experts_per_tok=8, decoder_sparse_step=1, norm_topk_prob=True)
SHAPES = {"dense": DENSE, "moe": MOE}

_SCRIPT = r"""
import json, sys
import torch
from vllm.config import LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.layers.quantization.fp8 import Fp8Config
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.utils import initialize_model
from vllm.utils.deep_gemm import per_block_cast_to_fp8
from tests.fp8_checkpoint import BLOCK, checkpoint_tensors, original_weight

SEED, PATHS = json.loads(sys.argv[2]), json.loads(sys.argv[3])
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def originals(cfg):
    return {n: original_weight(n, s, SEED) for n, s, _ in checkpoint_tensors(cfg)}


def expected(name, cfg, orig):
    # the bf16 original of vLLM parameter `name` ([.., N, K]), packed as vLLM packs it
    base = name.removesuffix(".weight")
    if ".experts.routed_experts." in name:
        layer = name.split(".mlp.")[0]
        parts = ("gate_proj", "up_proj") if name.endswith("w13_weight") else ("down_proj",)
        return torch.stack([torch.cat([orig[f"{layer}.mlp.experts.{e}.{p}.weight"]
                                       for p in parts]) for e in range(cfg["num_experts"])])
    prefix, _, leaf = base.rpartition(".")
    if leaf in PACKED:
        return torch.cat([orig[f"{prefix}.{p}.weight"] for p in PACKED[leaf]])
    return orig[name]


def check(model, cfg, orig):
    params = dict(model.named_parameters())
    out = {"fp8": {}, "other": {}, "attn_scales": {}}
    for name, p in params.items():
        if name.endswith("_scale_inv"):
            continue
        if ".attn." in name:  # Fp8KVCacheMethod's: an FP8 KV cache's scales, not in the file
            out["attn_scales"][name] = p.detach().float().flatten().tolist()
            continue
        ref = expected(name, cfg, orig)
        if p.dtype != torch.float8_e4m3fn:
            out["other"][name] = {"dtype": str(p.dtype), "equal": torch.equal(p, ref)}
            continue
        scale = params[name + "_scale_inv"]
        mats = zip(ref.unbind(0), p.unbind(0), scale.unbind(0)) if p.dim() == 3 else [
            (ref, p, scale)]
        equal, deq = True, []
        for r, q, s in mats:
            rq, rs = per_block_cast_to_fp8(r, BLOCK, use_ue8m0=False)
            equal &= torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
            full = s.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
            deq.append(q.float() * full)
        deq = torch.stack(deq).view(ref.shape)
        err = ((deq - ref.float()).norm() / ref.float().norm()).item()
        out["fp8"][name] = {"shape": list(p.shape), "scale_shape": list(scale.shape),
                            "scale_dtype": str(scale.dtype), "equal_vllm_quant": equal,
                            "rel_err": err}
    return out


with set_current_vllm_config(VllmConfig()):  # process groups
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{sys.argv[1]}")
    initialize_model_parallel(1, 1)
result = {}
for arch, path in PATHS.items():
    cfg = json.load(open(f"{path}/config.json"))
    qc = Fp8Config.from_config(cfg["quantization_config"])
    mc = ModelConfig(model=path, skip_tokenizer_init=True, dtype="bfloat16")
    vc = VllmConfig(model_config=mc, load_config=LoadConfig())
    with set_current_vllm_config(vc):
        torch.set_default_dtype(torch.bfloat16)
        model = initialize_model(vllm_config=vc, model_config=mc)
        methods = {n: type(m.quant_method).__name__ for n, m in model.named_modules()
                   if getattr(m, "quant_method", None) is not None}
        loader = DefaultModelLoader(vc.load_config)
        model.load_weights(loader.get_all_weights(mc, model))
    result[arch] = {
        "quantization": mc.quantization,
        "fp8_config": {"serialized": qc.is_checkpoint_fp8_serialized,
                       "block": qc.weight_block_size, "activation": qc.activation_scheme,
                       "ignored": qc.ignored_layers},
        "methods": {n.removeprefix("model.layers."): m for n, m in methods.items()},
        **check(model, cfg, originals(cfg))}
print("RESULT " + json.dumps(result))
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    from tests.fp8_checkpoint import build_fp8_block_checkpoint

    root = tmp_path_factory.mktemp("fp8-block")
    return {arch: build_fp8_block_checkpoint(str(root / arch), hf, seed=SEED)
            for arch, hf in SHAPES.items()}


@pytest.fixture(scope="module")
def loaded(checkpoints, cpu_vllm) -> dict:
    return run_result_script(_SCRIPT, cpu_vllm, timeout=300, TORCHDYNAMO_DISABLE="1",
                             argv=(json.dumps(SEED), json.dumps(checkpoints)))


def _header(path: str) -> dict[str, tuple[str, list[int]]]:
    from safetensors import safe_open

    with safe_open(f"{path}/model.safetensors", "pt") as f:
        return {n: (str(f.get_slice(n).get_dtype()), list(f.get_slice(n).get_shape()))
                for n in f.keys()}


@pytest.mark.parametrize("arch", list(SHAPES))
def test_files_hold_e4m3_weights_with_block_scales(checkpoints, arch):
    header = _header(checkpoints[arch])
    layer = "model.layers.1."
    fp8 = {n: v for n, v in header.items() if v[0] == "F8_E4M3"}
    scales = {n: v for n, v in header.items() if n.endswith("_scale_inv")}
    assert header[layer + "self_attn.q_proj.weight"] == ("F8_E4M3", [256, 256])
    assert header[layer + "self_attn.q_proj.weight_scale_inv"] == ("F32", [2, 2])
    assert header[layer + "self_attn.k_proj.weight_scale_inv"] == ("F32", [1, 2])
    assert header[layer + "self_attn.o_proj.weight"] == ("F8_E4M3", [256, 256])
    assert header[layer + "self_attn.q_norm.weight"] == ("BF16", [128])
    assert header["model.embed_tokens.weight"] == ("BF16", [512, 256])
    assert sorted(scales) == sorted(n + "_scale_inv" for n in fp8)
    assert all(v[0] == "F32" for v in scales.values())
    if arch == "moe":
        assert header[layer + "mlp.gate.weight"] == ("BF16", [128, 256])
        assert header[layer + "mlp.experts.127.down_proj.weight"] == ("F8_E4M3", [256, 128])
        assert header[layer + "mlp.experts.127.down_proj.weight_scale_inv"] == ("F32", [2, 1])
        assert header["lm_head.weight"] == ("BF16", [512, 256])
        assert len(fp8) == 2 * (4 + 3 * 128)
    else:
        assert header[layer + "mlp.up_proj.weight"] == ("F8_E4M3", [256, 256])
        assert "lm_head.weight" not in header  # tied
        assert len(fp8) == 2 * (4 + 3)


@pytest.mark.parametrize("arch", list(SHAPES))
def test_vllm_reads_a_block_fp8_checkpoint(loaded, arch):
    r = loaded[arch]
    assert r["quantization"] == "fp8"
    ignored = [] if arch == "dense" else ["lm_head", "model.layers.0.mlp.gate",
                                          "model.layers.1.mlp.gate"]
    assert r["fp8_config"] == {"serialized": True, "block": [128, 128], "activation": "dynamic",
                               "ignored": ignored}
    methods = r["methods"]
    assert methods["0.self_attn.qkv_proj"] == methods["0.self_attn.o_proj"] == "Fp8LinearMethod"
    if arch == "moe":
        assert methods["0.mlp.gate"] == "UnquantizedLinearMethod"  # the router stays bf16
        assert methods["0.mlp.experts.routed_experts"] == "Fp8MoEMethod"
    else:
        assert methods["0.mlp.gate_up_proj"] == methods["0.mlp.down_proj"] == "Fp8LinearMethod"


@pytest.mark.parametrize("arch", list(SHAPES))
def test_every_parameter_loaded_as_quantized_from_the_originals(loaded, arch):
    r = loaded[arch]
    leaves = {n.split(".layers.0.")[-1] for n in r["fp8"] if ".layers.0." in n}
    assert leaves == ({"self_attn.qkv_proj.weight", "self_attn.o_proj.weight"}
                      | ({"mlp.experts.routed_experts.w13_weight",
                          "mlp.experts.routed_experts.w2_weight"} if arch == "moe"
                         else {"mlp.gate_up_proj.weight", "mlp.down_proj.weight"}))
    for name, w in r["fp8"].items():
        assert w["equal_vllm_quant"], name  # same bytes as vLLM's quantizer of the originals
        assert w["scale_dtype"] == "torch.float32", name
        assert w["rel_err"] < 0.05, (name, w)  # e4m3: 3 mantissa bits
    if arch == "moe":
        w13 = r["fp8"]["model.layers.0.mlp.experts.routed_experts.w13_weight"]
        assert (w13["shape"], w13["scale_shape"]) == ([128, 256, 256], [128, 2, 2])
    for name, w in r["other"].items():
        assert w == {"dtype": "torch.bfloat16", "equal": True}, name
    assert ("model.layers.0.mlp.gate.weight" in r["other"]) == (arch == "moe")
    # an FP8 KV cache's q/k/v/prob scales (Fp8KVCacheMethod): none in the file, left at vLLM's
    # "not given" -1 (1.0 once processed)
    assert len(r["attn_scales"]) == 2 * 4 and all(v == [-1.0] for v in r["attn_scales"].values())


def test_dimensions_off_the_block_grid_are_refused():
    from tests.fp8_checkpoint import fp8_block_config

    with pytest.raises(ValueError, match=r"multiples of 128.*'moe_intermediate_size': 96"):
        fp8_block_config(dict(MOE, moe_intermediate_size=96))
