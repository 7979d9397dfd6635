"""Decode-time linear layers through the plugin's small-M GEMM (`ops/small_m_gemm.py`).

Opt-in (`--additional-config '{"moe_graphs": {"small_m_gemm": true}}'`), experimental: at batch 1
the decode step of a small dense model is bound by cuBLAS's small-M GEMMs, which read the
weights at ~30% of HBM bandwidth on an H200 (docs/benchmarking.md). When on, every vLLM linear
layer whose quant method is exactly `UnquantizedLinearMethod` (fp16 / bf16 weights, nn.Linear
layout) gets a `SmallMLinearMethod`: an input of at most `MAX_M` rows goes to `small_m_linear`,
anything larger (prefill) to vLLM's own GEMM. Eager and replayed decode steps use the same
kernel, so graphs vs kill switch stay token-identical, and a row's result does not depend on the
batch it came with. The split-K workspace is one persistent buffer shared by every layer
(kernels of one stream run one after the other), allocated here, before any capture.

Layers reached: Qwen3's qkv_proj, o_proj, gate_up_proj, down_proj and Qwen3-MoE's attention
projections and router gate; not the MoE experts (fused MoE) and not the LM head (an
embedding's matmul, already near the bandwidth floor in cuBLAS).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

from vllm_moe_graphs.ops.small_m_gemm import (
    MAX_M,
    SmallMGemmConfig,
    choose_small_m_config,
    device_num_sms,
    small_m_linear,
    small_m_workspace_numel,
)

logger = logging.getLogger("vllm.moe_graphs")

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # float32: interpreter tests only


class SmallMLinearMethod(UnquantizedLinearMethod):
    """vLLM's unquantized method, with inputs of <= MAX_M rows sent to `small_m_linear`.

    A subclass, so vLLM's `isinstance(..., UnquantizedLinearMethod)` checks still hold; it keeps
    no state of vLLM's (the base class has none) beyond what is set here.
    """

    def __init__(self, config: SmallMGemmConfig, workspace: torch.Tensor | None) -> None:
        super().__init__()
        self.small_m_config = config
        self.workspace = workspace
        self.small_m_calls = 0  # host counter (tests); never read on the device

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        # NOTE: graph safety. The branch reads shapes only: a captured decode step (M = its
        # bucket) always takes the kernel path, a prefill never does.
        if x.dim() == 2 and 0 < x.shape[0] <= MAX_M and x.stride(1) == 1:
            self.small_m_calls += 1
            return small_m_linear(x, layer.weight, bias, workspace=self.workspace,
                                  config=self.small_m_config)
        return super().apply(layer, x, bias)


def _eligible(module: Any) -> bool:
    if not isinstance(module, LinearBase):
        return False
    if type(getattr(module, "quant_method", None)) is not UnquantizedLinearMethod:
        return False
    w = getattr(module, "weight", None)
    return (isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype in _DTYPES
            and w.stride(1) == 1 and w.device.type != "meta")


def install_small_m_gemm(model: torch.nn.Module) -> dict[str, SmallMLinearMethod]:
    """Give every eligible linear layer of `model` a `SmallMLinearMethod`; returns them by
    module name. Call after the weights are loaded and before any graph capture."""
    layers = {name: m for name, m in model.named_modules() if _eligible(m)}
    if not layers:
        return {}
    num_sms = device_num_sms(next(iter(layers.values())).weight.device)
    configs = {name: choose_small_m_config(1, m.weight.shape[0], m.weight.shape[1], num_sms)
               for name, m in layers.items()}
    need = max(small_m_workspace_numel(MAX_M, m.weight.shape[0], configs[name])
               for name, m in layers.items())
    first = next(iter(layers.values())).weight
    workspace = torch.empty(need, dtype=torch.float32, device=first.device) if need else None
    methods = {}
    for name, module in layers.items():
        method = SmallMLinearMethod(configs[name], workspace)
        module.quant_method = method
        methods[name] = method
    logger.info("moe_graphs: small-M GEMM on %d linear layers (<= %d rows; workspace %.1f MiB)",
                len(methods), MAX_M, need * 4 / 2**20)
    return methods
