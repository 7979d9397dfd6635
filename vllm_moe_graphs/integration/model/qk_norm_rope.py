"""Qwen3 attention with Q/K RMSNorm and RoPE in one launch (vLLM's own fused CUDA kernel).

On by default (config key `fuse_qk_norm_rope`; measured with the small-M GEMM on the H200, the run
in git history; parity in `benchmarks/results/gpu-tests-h100.json`, `parity-experimental-kernels`).
Without torch.compile (the plugin's decode graphs run vLLM uncompiled), Qwen3's attention launches
three kernels between the QKV projection and attention in every layer: q RMSNorm, k RMSNorm, RoPE
(~170 us of a 1.5 ms Qwen3-0.6B decode step at batch 1 on an H200, docs/benchmarking.md). vLLM 0.26
ships `torch.ops._C.fused_qk_norm_rope`, which does all three in place on the QKV output; its
compile pass (`QKNormRoPEFusionPass`) uses it only under torch.compile. When on, every
exactly-typed `Qwen3Attention` / `Qwen3MoeAttention` whose geometry the kernel supports gets
`fused_forward` as its forward (an instance attribute: the class is untouched); eager and replayed
steps use it alike, so graphs vs kill switch stay token-identical. Its rounding differs slightly
from the unfused path (no bf16 round trip between norm and RoPE).

Refused, leaving the module as vLLM built it: the op missing from this vLLM build (e.g. the CPU
build), a head size the kernel lacks, partial rotary, a rotary embedding that is not exactly
vLLM's `RotaryEmbedding`, norms that are not `RMSNorm` with a weight, dtypes other than fp16 /
bf16.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vllm_moe_graphs.integration.patch import module_forward

logger = logging.getLogger("vllm.moe_graphs")

SUPPORTED_HEAD_DIMS = (64, 128, 256)  # vLLM 0.26's fused_qk_norm_rope switch statements


def op_available() -> bool:
    """True when this vLLM build registered `torch.ops._C.fused_qk_norm_rope`."""
    try:
        import vllm._custom_ops  # noqa: F401  (loads vllm._C)
    except ImportError:
        return False
    return hasattr(torch.ops._C, "fused_qk_norm_rope")


def fused_forward(self: Any, positions: torch.Tensor,
                  hidden_states: torch.Tensor) -> torch.Tensor:
    """`Qwen3Attention.forward` / `Qwen3MoeAttention.forward` (vLLM 0.26) with the q/k norms and
    RoPE as one in-place kernel on the QKV output."""
    qkv, _ = self.qkv_proj(hidden_states)  # [T, (Hq + 2 Hkv) D]
    rope = self.rotary_emb
    torch.ops._C.fused_qk_norm_rope(
        qkv, self.num_heads, self.num_kv_heads, self.num_kv_heads, self.head_dim,
        self.q_norm.variance_epsilon, self.q_norm.weight, self.k_norm.weight,
        rope.cos_sin_cache, rope.is_neox_style, positions.view(-1), -1)
    q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
    attn_output = self.attn(q, k, v)
    output, _ = self.o_proj(attn_output)
    return output


def refusal(module: Any) -> str | None:
    """Why `module` (an exactly-typed Qwen3 attention) cannot take `fused_forward`; None if it
    can."""
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    rope = getattr(module, "rotary_emb", None)
    if type(rope) is not RotaryEmbedding:
        return f"rotary embedding {type(rope).__name__} (only vLLM's RotaryEmbedding)"
    if module.head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {module.head_dim} (supported: {SUPPORTED_HEAD_DIMS})"
    if rope.rotary_dim != module.head_dim:
        return f"partial rotary (rotary_dim {rope.rotary_dim} of head_dim {module.head_dim})"
    for name in ("q_norm", "k_norm"):
        norm = getattr(module, name, None)
        if type(norm) is not RMSNorm or getattr(norm, "weight", None) is None:
            return f"{name} is {type(norm).__name__} (only RMSNorm with a weight)"
    weight = module.q_norm.weight
    if weight.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {weight.dtype} (fp16 / bf16 only)"
    cache = rope.cos_sin_cache
    if cache.dtype != weight.dtype or cache.device != weight.device:
        # vLLM would convert it on first use (a buffer swap): never inside a captured graph
        return (f"RoPE cache {cache.dtype} on {cache.device}, model {weight.dtype} on "
                f"{weight.device}")
    return None


def install_fused_qk_norm_rope(model: torch.nn.Module) -> dict[str, str]:
    """Give every eligible Qwen3 attention module of `model` `fused_forward`. Returns module
    name -> "fused" or why not (empty when the model has no Qwen3 attention)."""
    from vllm.model_executor.models.qwen3 import Qwen3Attention
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeAttention

    owners = {name: m for name, m in model.named_modules()
              if type(m) in (Qwen3Attention, Qwen3MoeAttention)}
    if not owners:
        return {}
    if not op_available():
        why = "torch.ops._C.fused_qk_norm_rope is not in this vLLM build"
        logger.warning("moe_graphs: fuse_qk_norm_rope is on but %s; attention stays unfused", why)
        return dict.fromkeys(owners, why)
    out = {}
    for name, module in owners.items():
        why = refusal(module)
        if why is None:
            module_forward.install(module, fused_forward)
        out[name] = why or "fused"
    fused = sum(v == "fused" for v in out.values())
    logger.info("moe_graphs: fused q/k norm + RoPE in %d of %d attention layers%s", fused,
                len(out), "" if fused == len(out) else f" (first refusal: "
                f"{next(v for v in out.values() if v != 'fused')})")
    return out
