"""`tests.gpu_util.redraw_weights` on vLLM 0.26's own Qwen3 and Qwen3-MoE classes (CPU build).

Models are built in one subprocess, in bf16, as block-FP8 checkpoints and with online FP8, and
re-drawn there; the checks run here on what it reports. Shapes: hidden 256, intermediate 256,
moe_intermediate 128, 4 experts (block FP8 needs multiples of 128).

What runs on the CPU build and what stands in (layouts: the comment above `redraw_weights`):
- block FP8: the model as constructed, then vLLM's dummy loader (`DummyModelLoader.
  load_weights`), not `process_weights_after_loading`: on the CPU that VNNI-packs the weights
  for its own kernels, while on Hopper the Triton MoE and the Cutlass / DeepGEMM dense kernels
  keep the constructed layout (DeepGEMM checks SM90's 128x128 fp32 scales, does not move them).
- online FP8: vLLM's dummy loader in full (`load_model`, quantization in
  `process_weights_after_loading`) with two stand-ins, because the CPU build cannot run it:
  `ops.scaled_fp8_quant` is vLLM's own torch reference of that op (`QuantFP8.forward_native`;
  the CPU build's `_C::dynamic_scaled_fp8_quant` is an empty stub: "expected at most 0
  argument(s) but received 3"), and the MoE backend is TRITON, what `select_fp8_moe_backend`
  picks on an H100 at EP 1 (on the CPU it picks NONE and loading raises "Unsupported FP8 MoE
  backend: NONE").
"""

from __future__ import annotations

import json
import math

import pytest

from tests.serve_util import run_result_script

SEED = 7
BLOCK = [128, 128]
SHAPE = dict(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             max_position_embeddings=256)
MOE = dict(moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2)

_SCRIPT = r"""
import json, sys, tempfile, zlib
import torch
from transformers import Qwen3Config, Qwen3MoeConfig
import vllm._custom_ops as ops
import vllm.model_executor.layers.quantization.online.fp8 as online_fp8
from vllm.config import LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape
from vllm.model_executor.model_loader import get_model_loader
from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader
from vllm.model_executor.model_loader.utils import initialize_model
from vllm.utils.deep_gemm import per_block_cast_to_fp8
from tests.gpu_util import redraw_weights

SEED, BLOCK = json.loads(sys.argv[2]), json.loads(sys.argv[3])
SHAPE, MOE = json.loads(sys.argv[4]), json.loads(sys.argv[5])
FP8 = torch.float8_e4m3fn


def redraw_weights_before_fp8(model, seed=0):  # tests/gpu_util.py before FP8 weights
    count = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_floating_point():
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() >= 2:
                gen = torch.Generator(device=p.device)
                gen.manual_seed(zlib.crc32(name.encode()) + seed)
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
            else:
                continue
            count += 1
    return count


def per_tensor_quant(x, scale=None, **kw):  # stands in for the CPU build's stub op
    assert scale is None and not kw, kw
    return QuantFP8(static=False, group_shape=GroupShape.PER_TENSOR).forward_native(x)


ops.scaled_fp8_quant = per_tensor_quant
online_fp8.select_fp8_moe_backend = lambda **kw: (Fp8MoeBackend.TRITON, TritonExperts)


def build(moe, quant):
    cls, extra = (Qwen3MoeConfig, MOE) if moe else (Qwen3Config, {})
    arch = "Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"
    cfg = cls(**SHAPE, **extra, architectures=[arch])
    if quant == "block":
        cfg.quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
                                   "activation_scheme": "dynamic", "weight_block_size": BLOCK}
    path = tempfile.mkdtemp()
    cfg.save_pretrained(path)
    mc = ModelConfig(model=path, skip_tokenizer_init=True, dtype="bfloat16",
                     **({"quantization": "fp8"} if quant == "online" else {}))
    vc = VllmConfig(model_config=mc, load_config=LoadConfig(load_format="dummy"))
    with set_current_vllm_config(vc):
        torch.set_default_dtype(torch.bfloat16)
        if quant == "online":
            return get_model_loader(vc.load_config).load_model(vllm_config=vc, model_config=mc)
        model = initialize_model(vllm_config=vc, model_config=mc)
        if quant == "block":
            DummyModelLoader(vc.load_config).load_weights(model, mc)
        return model


def raw(t):
    return t.detach().contiguous().view(-1).view(torch.uint8).clone()


def snapshot(model):
    return {n: raw(p) for n, p in model.named_parameters()}


def fill(model):
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.copy_(torch.full(p.shape, 0.125))


def mats(t, stacked):
    return list(t.unbind(0)) if stacked else [t]


def fp8_report(model, name, p, bf16_ref, before):
    # the logical [.., N, K] view and the scale per matrix, as the kernels read them
    mod = model.get_submodule(name.rpartition(".")[0])
    leaf = name.rpartition(".")[2]
    own = dict(mod.named_parameters(recurse=False))
    block = leaf + "_scale_inv" in own
    scale = own[leaf + ("_scale_inv" if block else "_scale")]
    logical = p if block or p.dim() == 3 else p.t()
    stacked = logical.dim() == 3
    deq, max_q, ref_equal = [], [], True
    for q, s, r in zip(mats(logical, stacked), mats(scale, stacked), mats(bf16_ref, stacked)):
        qf = q.float()
        if block:
            bn, bk = BLOCK
            full = s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: q.shape[0], : q.shape[1]]
            deq.append(qf * full)
            groups = torch.nn.functional.pad(qf.abs(), (0, -q.shape[1] % bk, 0, -q.shape[0] % bn))
            max_q += groups.view(s.shape[0], bn, s.shape[1], bk).amax(dim=(1, 3)).flatten().tolist()
            rq, rs = per_block_cast_to_fp8(r, BLOCK, use_ue8m0=False)
        else:
            deq.append(qf * s)
            max_q.append(qf.abs().max().item())
            rq, rs = per_tensor_quant(r)
        ref_equal &= torch.equal(raw(q), raw(rq)) and torch.equal(raw(s), raw(rs.reshape(s.shape)))
    deq = torch.stack(deq)
    rel_err = ((deq - torch.stack(mats(bf16_ref, stacked)).float()).norm() / deq.norm()).item()
    return {
        "format": "block" if block else "tensor", "shape": list(p.shape),
        "stride": list(p.stride()), "scale_name": name + ("_scale_inv" if block else "_scale"),
        "scale_shape": list(scale.shape), "scale_dtype": str(scale.dtype),
        "fan_in": logical.shape[-1], "std": deq.std().item(),
        "zeros": (deq == 0).float().mean().item(),
        "scales_positive_finite": bool(((scale > 0) & scale.isfinite()).all()),
        "max_q": [min(max_q), max(max_q)], "equals_vllm_quant_of_bf16": ref_equal,
        "changed": not torch.equal(raw(p), before[name]),
        "rel_err_vs_bf16": rel_err, "zeros_before": before[name + ":zeros"],
        "negative_scales_before": before[name + ":negative_scales"],
    }


with set_current_vllm_config(VllmConfig()):  # for the process groups and QuantFP8
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{sys.argv[1]}")
    initialize_model_parallel(1, 1)
    out = {}
    for moe in (False, True):
        arch = "moe" if moe else "dense"
        model = build(moe, None)
        fill(model)
        count_new = redraw_weights(model, SEED)
        new = snapshot(model)
        bf16_ref = {n: p.detach().clone() for n, p in model.named_parameters()}
        fill(model)
        count_old = redraw_weights_before_fp8(model, SEED)
        old = snapshot(model)
        out[arch + "/bf16"] = {"count": [count_new, count_old],
                               "differ": [n for n in old if not torch.equal(old[n], new[n])]}
        for quant in ("block", "online"):
            model = build(moe, quant)
            params = dict(model.named_parameters())
            before = snapshot(model)
            for n, p in params.items():
                if p.dtype == FP8:
                    before[n + ":zeros"] = (p.float() == 0).float().mean().item()
                    s = params.get(n + "_scale_inv", params.get(n + "_scale"))
                    before[n + ":negative_scales"] = (s <= 0).float().mean().item()
            addresses = {n: (id(p), p.data_ptr(), tuple(p.shape), p.stride())
                         for n, p in params.items()}
            count = redraw_weights(model, SEED)
            after = snapshot(model)
            fp8 = {n: fp8_report(model, n, p, bf16_ref[n], before)
                   for n, p in model.named_parameters() if p.dtype == FP8}
            twin = build(moe, quant)
            redraw_weights(twin, SEED)
            again = snapshot(twin)
            redraw_weights(twin, SEED + 1)
            other = snapshot(twin)
            out[f"{arch}/{quant}"] = {
                "count": count, "fp8": fp8,
                "bf16_redrawn": sum(p.dim() >= 2 or n.endswith("norm.weight")
                                    for n, p in params.items()
                                    if p.dtype == torch.bfloat16 and not n.endswith("_scale")),
                "moved": [n for n, p in model.named_parameters()
                          if addresses.get(n) != (id(p), p.data_ptr(), tuple(p.shape), p.stride())],
                "same_seed_differ": [n for n in after if not torch.equal(after[n], again[n])],
                "fp8_same_on_other_seed": [n for n in fp8 if torch.equal(after[n], other[n])],
                "bf16_differ_from_bf16_model": [
                    n for n, p in model.named_parameters()
                    if p.dtype == torch.bfloat16 and n in new and p.dim() >= 1
                    and not n.endswith("_scale") and not torch.equal(after[n], new[n])],
            }
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def redrawn(cpu_vllm) -> dict:
    """The subprocess's report: per model (`dense|moe` / `bf16|block|online`)."""
    return run_result_script(_SCRIPT, cpu_vllm, timeout=300, TORCHDYNAMO_DISABLE="1",
                             argv=(json.dumps(SEED), json.dumps(BLOCK), json.dumps(SHAPE),
                                   json.dumps(MOE)))


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_bf16_models_redraw_exactly_as_before_fp8(redrawn, arch):
    r = redrawn[f"{arch}/bf16"]
    assert r["count"][0] == r["count"][1] > 0
    assert r["differ"] == []


# vLLM 0.26's FP8 parameters of these shapes, per layer (layer 0; layer 1 is alike)
_LAYOUTS = {
    "block": {
        "self_attn.qkv_proj.weight": ([512, 256], [256, 1], [4, 2]),
        "self_attn.o_proj.weight": ([256, 256], [256, 1], [2, 2]),
        "mlp.gate_up_proj.weight": ([512, 256], [256, 1], [4, 2]),
        "mlp.down_proj.weight": ([256, 256], [256, 1], [2, 2]),
        "mlp.gate.weight": ([4, 256], [256, 1], [1, 2]),
        "mlp.experts.routed_experts.w13_weight": ([4, 256, 256], [65536, 256, 1], [4, 2, 2]),
        "mlp.experts.routed_experts.w2_weight": ([4, 256, 128], [32768, 128, 1], [4, 2, 1]),
    },
    "online": {  # dense weights stored transposed: [K, N], strides (1, K)
        "self_attn.qkv_proj.weight": ([256, 512], [1, 256], [1]),
        "self_attn.o_proj.weight": ([256, 256], [1, 256], [1]),
        "mlp.gate_up_proj.weight": ([256, 512], [1, 256], [1]),
        "mlp.down_proj.weight": ([256, 256], [1, 256], [1]),
        "mlp.gate.weight": ([256, 4], [1, 256], [1]),
        "mlp.experts.routed_experts.w13_weight": ([4, 256, 256], [65536, 256, 1], [4]),
        "mlp.experts.routed_experts.w2_weight": ([4, 256, 128], [32768, 128, 1], [4]),
    },
}
_DENSE_MLP = ("mlp.gate_up_proj.weight", "mlp.down_proj.weight")
_MOE_MLP = ("mlp.gate.weight", "mlp.experts.routed_experts.w13_weight",
            "mlp.experts.routed_experts.w2_weight")


@pytest.mark.parametrize("arch", ["dense", "moe"])
@pytest.mark.parametrize("quant", ["block", "online"])
def test_fp8_layouts_are_vllms(redrawn, arch, quant):
    fp8 = redrawn[f"{arch}/{quant}"]["fp8"]
    leaves = ["self_attn.qkv_proj.weight", "self_attn.o_proj.weight",
              *(_MOE_MLP if arch == "moe" else _DENSE_MLP)]
    assert sorted(fp8) == sorted(f"model.layers.{i}.{leaf}" for i in (0, 1) for leaf in leaves)
    for leaf in leaves:
        r = fp8[f"model.layers.0.{leaf}"]
        assert [r["shape"], r["stride"], r["scale_shape"]] == list(_LAYOUTS[quant][leaf]), leaf
        assert r["format"] == ("block" if quant == "block" else "tensor")
        assert r["scale_dtype"] == "torch.float32"


@pytest.mark.parametrize("arch", ["dense", "moe"])
@pytest.mark.parametrize("quant", ["block", "online"])
def test_fp8_weights_redrawn_with_the_bf16_statistics(redrawn, arch, quant):
    r = redrawn[f"{arch}/{quant}"]
    assert r["count"] == len(r["fp8"]) + r["bf16_redrawn"]
    for name, w in r["fp8"].items():
        assert w["changed"], name
        assert abs(w["std"] * math.sqrt(w["fan_in"]) - 1.0) < 0.1, (name, w)
        assert w["zeros"] < 0.02, (name, w)
        assert w["scales_positive_finite"], name
        # scale = amax / 448: each scale group's largest |fp8| is e4m3's largest
        assert w["max_q"] == [448.0, 448.0], (name, w)
        # the logical bf16 draw of the same name, quantized as vLLM quantizes that format
        assert w["equals_vllm_quant_of_bf16"], name
        assert w["rel_err_vs_bf16"] < 0.05, (name, w)


def test_block_fp8_dummy_weights_were_useless_before(redrawn):
    """What the re-draw is for: vLLM's dummy block-FP8 weights are nearly all zeros."""
    w = redrawn["moe/block"]["fp8"]["model.layers.0.mlp.experts.routed_experts.w13_weight"]
    assert w["zeros_before"] > 0.9 and w["negative_scales_before"] > 0


@pytest.mark.parametrize("arch", ["dense", "moe"])
@pytest.mark.parametrize("quant", ["block", "online"])
def test_fp8_redraw_in_place_and_reproducible(redrawn, arch, quant):
    r = redrawn[f"{arch}/{quant}"]
    assert r["moved"] == []  # same Parameter objects, data_ptrs, shapes and strides
    assert r["same_seed_differ"] == []  # a second build, same seed: identical bytes
    assert r["fp8_same_on_other_seed"] == []
    assert r["bf16_differ_from_bf16_model"] == []  # norms, embeddings, lm_head as in bf16


def _module_with(**params):
    torch = pytest.importorskip("torch")
    module = torch.nn.Module()
    for name, value in params.items():
        module.register_parameter(name, torch.nn.Parameter(value, requires_grad=False))
    outer = torch.nn.Module()
    outer.proj = module
    return outer


def test_unknown_float8_layouts_raise_naming_the_parameter():
    torch = pytest.importorskip("torch")
    from tests.gpu_util import redraw_weights

    weight = torch.zeros(256, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"proj\.weight: a float8 weight with neither"):
        redraw_weights(_module_with(weight=weight))
    bad_block = _module_with(weight=weight.clone(), weight_scale_inv=torch.ones(2, 3))
    bad_block.proj.weight_block_size = [128, 128]
    with pytest.raises(ValueError, match=r"proj\.weight: block scale_inv .* \(2, 2\)"):
        redraw_weights(bad_block)
    not_transposed = _module_with(weight=torch.zeros(512, 256, dtype=torch.float8_e4m3fn),
                                  weight_scale=torch.ones(1))
    not_transposed.proj.input_size_per_partition = 256
    not_transposed.proj.output_size_per_partition = 512
    with pytest.raises(ValueError, match=r"proj\.weight: per-tensor weight \(512, 256\)"):
        redraw_weights(not_transposed)
    e5m2 = _module_with(weight=torch.zeros(4, 4, dtype=torch.float8_e5m2))
    with pytest.raises(ValueError, match=r"proj\.weight: torch\.float8_e5m2"):
        redraw_weights(e5m2)


def test_scale_parameters_are_never_drawn():
    torch = pytest.importorskip("torch")
    from tests.gpu_util import redraw_weights

    scales = dict(w_scale_inv=torch.full((2, 2), 3.0), input_scale=torch.full((2, 2), 3.0),
                  k_scale=torch.full((), 3.0), weight=torch.zeros(2, 2))
    model = _module_with(**scales)
    assert redraw_weights(model) == 1
    for name in ("w_scale_inv", "input_scale", "k_scale"):
        assert bool((getattr(model.proj, name) == 3.0).all()), name
