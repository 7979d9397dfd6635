"""Block-quantized FP8 checkpoints of Qwen3 / Qwen3-MoE shapes from random weights (no model hub).

The form vLLM 0.26 loads with `Fp8Config` (quantization/fp8.py) as Qwen/Qwen3-30B-A3B-FP8 ships
it: `quantization_config` {quant_method fp8, e4m3, dynamic activations, weight_block_size
[128, 128]}, the LM head and every MoE router gate left in bf16 (`modules_to_not_convert`). Every
linear weight X of the attention and MLP (dense and per expert) is stored as `X.weight`
float8_e4m3fn [N, K] plus `X.weight_scale_inv` float32 [N/128, K/128] (real weight = fp8 x its
block's scale_inv, as vLLM's `per_block_cast_to_fp8`); embeddings, norms, gates and the LM head
in bf16. Weights are drawn N(0, `std`) in bf16, seeded per tensor name (`original_weight`), norm
gains 1; every quantized dimension must be a multiple of 128 (vLLM's block FP8 MoE needs it).
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

from benchmarks.harness.shapes import BLOCK, fp8_block_config, moe_layers  # noqa: F401
from tests.gpu_util import quantize_blocks

def checkpoint_tensors(hf: Mapping[str, Any]) -> Iterator[tuple[str, tuple[int, ...], bool]]:
    """(name, shape, quantized) of every tensor a checkpoint of `hf` holds, as Hugging Face names
    them (vLLM's loader packs q/k/v, gate/up and the experts)."""
    h, v = int(hf["hidden_size"]), int(hf["vocab_size"])
    d = int(hf.get("head_dim") or h // hf["num_attention_heads"])
    q, kv = int(hf["num_attention_heads"]) * d, int(hf["num_key_value_heads"]) * d
    yield "model.embed_tokens.weight", (v, h), False
    if not hf.get("tie_word_embeddings"):
        yield "lm_head.weight", (v, h), False
    yield "model.norm.weight", (h,), False
    sparse = moe_layers(hf)
    for i in range(int(hf["num_hidden_layers"])):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,), False
        yield p + "post_attention_layernorm.weight", (h,), False
        yield p + "self_attn.q_norm.weight", (d,), False
        yield p + "self_attn.k_norm.weight", (d,), False
        for name, shape in (("q_proj", (q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)),
                            ("o_proj", (h, q))):
            yield f"{p}self_attn.{name}.weight", shape, True
        if i in sparse:
            e, m = int(hf["num_experts"]), int(hf["moe_intermediate_size"])
            yield p + "mlp.gate.weight", (e, h), False
            for j in range(e):
                for name, shape in (("gate_proj", (m, h)), ("up_proj", (m, h)),
                                    ("down_proj", (h, m))):
                    yield f"{p}mlp.experts.{j}.{name}.weight", shape, True
        else:
            m = int(hf["intermediate_size"])
            for name, shape in (("gate_proj", (m, h)), ("up_proj", (m, h)),
                                ("down_proj", (h, m))):
                yield f"{p}mlp.{name}.weight", shape, True


def original_weight(name: str, shape: tuple[int, ...], seed: int = 0, std: float = 0.02,
                    device: str = "cpu"):
    """The bf16 tensor `name` is drawn as before quantization: norm gains 1, the rest
    N(0, std), seeded by the name (the same on every run on the same device type)."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(zlib.crc32(name.encode()) + seed)
    return torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, std,
                                                                           generator=gen)


def build_fp8_block_checkpoint(path: str, hf: Mapping[str, Any], *, seed: int = 0,
                               std: float = 0.02, device: str = "cpu") -> str:
    """Write config.json (`fp8_block_config(hf)`) and model.safetensors into `path`; weights
    drawn and quantized on `device` ("cuda" is much faster for real shapes), saved from the
    host. Returns `path`."""
    import torch
    from safetensors.torch import save_file

    cfg = fp8_block_config(hf)
    os.makedirs(path, exist_ok=True)
    tensors = {}
    with torch.no_grad():
        for name, shape, quantized in checkpoint_tensors(cfg):
            w = original_weight(name, shape, seed, std, device)
            if quantized:
                q, scale_inv = quantize_blocks(w, BLOCK)
                tensors[name] = q.contiguous().cpu()
                tensors[name + "_scale_inv"] = scale_inv.cpu()
            else:
                tensors[name] = w.cpu()
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return path
