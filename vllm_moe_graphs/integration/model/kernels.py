"""`install_kernels`: the configured model surgery on a loaded model whose layers the registry
proved (small-M GEMM, fused q/k norm + RoPE, compiled numerics, MoE padding skip), each module
saying per layer where it applied and why not elsewhere."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_moe_graphs.config import PluginConfig
    from vllm_moe_graphs.integration.model.moe_padding import MoePadding


@dataclasses.dataclass
class InstalledKernels:
    linear: dict[str, Any] = dataclasses.field(default_factory=dict)  # layer -> method
    fused_attn: dict[str, str] = dataclasses.field(default_factory=dict)  # module -> fused/why
    norms: dict[str, str] = dataclasses.field(default_factory=dict)  # module -> installed/why
    moe_padding: MoePadding | None = None  # for an MoE model


def install_kernels(model: Any, runner: Any, c: PluginConfig) -> InstalledKernels:
    """Install what `c` turns on into `model` (vLLM model runner `runner`'s)."""
    out = InstalledKernels()
    if c.small_m_gemm:
        from vllm_moe_graphs.integration.model.small_m_linear import install_small_m_gemm

        out.linear = install_small_m_gemm(model, c.small_m_gemm)
    if c.fuse_qk_norm_rope:
        from vllm_moe_graphs.integration.model.qk_norm_rope import install_fused_qk_norm_rope

        out.fused_attn = install_fused_qk_norm_rope(model)
    if c.compiled_numerics:
        from vllm_moe_graphs.integration.model.compiled_numerics import (
            install_compiled_numerics,
        )

        mc = runner.model_config
        out.norms = install_compiled_numerics(model, mc.get_hidden_size(), mc.dtype)
    if c.skip_moe_padding:
        from vllm_moe_graphs.integration.model.moe_padding import install_moe_padding

        out.moe_padding = install_moe_padding(model, runner, c.fuse_moe_padding_mask)
    return out
