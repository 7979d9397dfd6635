"""Decode-time linear layers through the plugin's small-M GEMM (`ops/small_m_gemm.py`).

Config key `small_m_gemm` ("auto" by default, true, false). At batch 1 the decode step of a
small dense model is bound by cuBLAS's small-M GEMMs, which read the weights at ~30% of HBM
bandwidth on an H200 (docs/benchmarking.md). A chosen linear layer whose quant method is exactly
`UnquantizedLinearMethod` (fp16 / bf16 weights, nn.Linear layout) gets a `SmallMLinearMethod`:
an input of at most `MAX_M` rows goes to `small_m_linear`, anything larger (prefill) to vLLM's
own GEMM.

Which layers: true takes every eligible one. "auto" takes those where the kernel measured
faster than cuBLAS on the H200 (`benchmarks/results/gemm-kernels-h200.txt`): more input than
output features (K >= N) and N >= 1024, i.e. o_proj and down_proj (split-K keeps every SM
busy where cuBLAS launches too few output tiles: 0.6B o_proj 5.1 vs 12.6 us at M=1, down
5.7 vs 7.3, 8B 1.06-1.11x, 30B-A3B o_proj 1.15x). qkv_proj and gate_up_proj (N > K) were
0.79-0.96x of cuBLAS and stay there; router gates (N = experts) were not measured and stay too.

Eager and replayed decode steps use the same
kernel, so graphs vs kill switch stay token-identical, and a row's result does not depend on the
batch it came with. The split-K workspace is one persistent buffer shared by every layer
(kernels of one stream run one after the other), allocated here, before any capture.

Layers reachable (with `true`; "auto" picks among them): Qwen3's qkv_proj, o_proj,
gate_up_proj, down_proj and Qwen3-MoE's attention projections and router gate; not the MoE
experts (fused MoE) and not the LM head (an embedding's matmul, already near the bandwidth
floor in cuBLAS).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

from vllm_moe_graphs.integration.patch import linear_quant_method
from vllm_moe_graphs.ops.small_m_gemm import small_m_linear
from vllm_moe_graphs.ops.small_m_plan import (
    MAX_M,
    SmallMGemmConfig,
    choose_small_m_config,
    device_num_sms,
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


AUTO_MIN_N = 1024


def auto_selects(n: int, k: int) -> bool:
    """The "auto" rule: a weight of N outputs x K inputs where the kernel measured faster."""
    return k >= n >= AUTO_MIN_N


def install_small_m_gemm(model: torch.nn.Module,
                         which: bool | str = True) -> dict[str, SmallMLinearMethod]:
    """Give the eligible linear layers of `model` a `SmallMLinearMethod` (`which`: True every
    one, "auto" those `auto_selects`). Returns the methods by module name. Call after the
    weights are loaded and before any capture."""
    layers = {name: m for name, m in model.named_modules() if _eligible(m)
              and (which is True or auto_selects(*m.weight.shape))}
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
        linear_quant_method.install(module, method)
        methods[name] = method
    logger.info("moe_graphs: small-M GEMM on %d linear layers (%s; <= %d rows; workspace "
                "%.1f MiB)", len(methods), "auto" if which == "auto" else "all eligible", MAX_M,
                need * 4 / 2**20)
    return methods
