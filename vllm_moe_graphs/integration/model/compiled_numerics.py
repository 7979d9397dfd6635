"""The residual stream's RMSNorms and the dense MLP's SiLU-and-mul rounded as stock vLLM's
compiled model rounds them (config key `compiled_numerics`; off by default until its numerics
and speed are measured on a GPU: `tests/graphs/test_gpu_numerics.py` with the `diagnose`
variants, the decode benchmark's `plugin_graphs_compiled_numerics`).

Stock vLLM compiles the model with Inductor, which runs vLLM's `native` RMSNorm (the fp32 sum
of hidden state and residual normalised) and keeps fused intermediates in fp32. The plugin runs
the model uncompiled, where vLLM picks its `vllm_c` CUDA kernels: the bf16-rounded sum
normalised, each output rounded twice. Measured on an H100 (`gpu-tests-h100.txt`, numerics
diagnosis): with vLLM's uncompiled kernels the plugin's logprobs sit 1.7x (Qwen3-0.6B) and 1.9x
(Qwen3-30B-A3B) stock's own noise floor away from stock's, as far as vLLM's own eager mode.
Swapping vLLM's RMSNorm IR provider for its `native` one brought them to 1.5x and 1.4x.
`ops/norm_act.py` computes what stock's compiled code computes, in one launch each.

Installed, as `module_forward.install`, on every exactly-typed `RMSNorm` of the model's hidden
size with a weight (the decoder layers' input and post-attention norms, the final norm; the q/k
norms of head size are fused with RoPE by `fuse_qk_norm_rope`) and every exactly-typed
`SiluAndMul` (the dense MLP's; the fused MoE applies its own activation inside the experts'
kernel, alike in stock and the plugin). Eager and replayed steps use the same forward, so graphs
against the kill switch stay token-identical. A call the kernels cannot take (an input of
another rank or layout) runs vLLM's forward. Refused, leaving the module as vLLM built it:
`VLLM_BATCH_INVARIANT` (vLLM's batch-invariant norm), a variance size override, dtypes other
than bf16 / fp16, a hidden size past `norm_act.MAX_NORM_BLOCK`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vllm_moe_graphs.integration.patch import module_forward
from vllm_moe_graphs.ops import norm_act

logger = logging.getLogger("vllm.moe_graphs")

INSTALLED = "installed"


def norm_forward(self: Any, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
    """`RMSNorm.forward` with torch.compile's rounding (`ops/norm_act.py`); vLLM's forward for
    an input the kernel cannot take."""
    weight = self.weight.data
    if norm_act.unsupported(x, weight) is None and (
            residual is None or norm_act.unsupported(residual) is None):
        if residual is None:
            return norm_act.rms_norm(x, weight, self.variance_epsilon)
        return norm_act.fused_add_rms_norm_(x, residual, weight, self.variance_epsilon)
    return type(self).forward(self, x, residual)


def act_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """`SiluAndMul.forward` with torch.compile's rounding; vLLM's for another input."""
    if norm_act.unsupported(x) is None:
        return norm_act.silu_and_mul(x)
    return type(self).forward(self, x)


def norm_refusal(module: Any, hidden_size: int) -> str | None:
    """Why the RMSNorm `module` keeps vLLM's forward; None if it takes `norm_forward`."""
    weight = getattr(module, "weight", None)
    if not getattr(module, "has_weight", False) or weight is None:
        return "no weight"
    if getattr(module, "variance_size_override", None) is not None:
        return f"variance size override {module.variance_size_override}"
    if weight.shape != (hidden_size,):
        return f"size {tuple(weight.shape)}, not the hidden size {hidden_size} (q/k norm)"
    if weight.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {weight.dtype} (bf16 / fp16 only)"
    if hidden_size > norm_act.MAX_NORM_BLOCK:
        return f"hidden size {hidden_size} > {norm_act.MAX_NORM_BLOCK}"
    return None


def install_compiled_numerics(model: torch.nn.Module, hidden_size: int,
                              dtype: torch.dtype) -> dict[str, str]:
    """Give every eligible RMSNorm and SiLU-and-mul of `model` (of `hidden_size`, activations
    in `dtype`) the compiled rounding. Returns module name -> INSTALLED or why not (empty when
    the model has neither)."""
    from vllm import envs
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm

    owners = {name: m for name, m in model.named_modules() if type(m) in (RMSNorm, SiluAndMul)}
    if envs.VLLM_BATCH_INVARIANT:
        why = "VLLM_BATCH_INVARIANT: vLLM's batch-invariant kernels"
        logger.info("moe_graphs: compiled_numerics is on but %s stay", why)
        return dict.fromkeys(owners, why)
    if dtype not in (torch.bfloat16, torch.float16):
        return dict.fromkeys(owners, f"dtype {dtype} (bf16 / fp16 only)")
    out = {}
    for name, module in owners.items():
        if type(module) is RMSNorm:
            why = norm_refusal(module, hidden_size)
            forward = norm_forward
        else:
            why, forward = None, act_forward
        if why is None:
            module_forward.install(module, forward)
        out[name] = why or INSTALLED
    done = sum(v == INSTALLED for v in out.values())
    logger.info("moe_graphs: torch.compile's rounding in %d of %d norm and activation modules",
                done, len(out))
    return out
