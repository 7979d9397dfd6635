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

from vllm_moe_graphs.ops.reduce_add_rms_norm import MAX_N, reduce_add_rms_norm
from vllm_moe_graphs.ops.small_m_gemm import (
    MAX_M,
    SmallMGemmConfig,
    choose_small_m_config,
    device_num_sms,
    small_m_linear,
    small_m_reduce,
    small_m_workspace_numel,
    split_k_plan,
)

logger = logging.getLogger("vllm.moe_graphs")

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # float32: interpreter tests only


class ResidualHandoff:
    """The one small-M GEMM output of a model whose split reduce waits for the next RMSNorm
    (`fuse_residual_norm`). Every method sharing the workspace flushes it before it launches
    (the next GEMM would overwrite the partials), and every wrapped norm either fuses it (its
    input is that output) or flushes it, so a deferred output is always reduced before it is
    read, in whatever order the layers run."""

    def __init__(self) -> None:
        # (out, workspace, splits): `out` unwritten, its partials in the workspace
        self.pending: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self.fused = 0  # host counters (tests, logs); never read on the device
        self.flushed = 0

    def flush(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            self.flushed += 1
            small_m_reduce(*pending)


class SmallMLinearMethod(UnquantizedLinearMethod):
    """vLLM's unquantized method, with inputs of <= MAX_M rows sent to `small_m_linear`.

    A subclass, so vLLM's `isinstance(..., UnquantizedLinearMethod)` checks still hold; it keeps
    no state of vLLM's (the base class has none) beyond what is set here.
    """

    def __init__(self, config: SmallMGemmConfig, workspace: torch.Tensor | None,
                 splits: int = 1) -> None:
        super().__init__()
        self.small_m_config = config
        self.workspace = workspace
        self.splits = splits  # split-K chunks actually launched (split_k_plan)
        self.handoff: ResidualHandoff | None = None  # set by install_residual_norm
        self.defer = False  # leave the split reduce to the next norm (install_residual_norm)
        self.small_m_calls = 0  # host counter (tests); never read on the device

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        # NOTE: graph safety. The branch reads shapes only: a captured decode step (M = its
        # bucket) always takes the kernel path, a prefill never does.
        if x.dim() == 2 and 0 < x.shape[0] <= MAX_M and x.stride(1) == 1:
            return self.gemm(x, layer.weight, bias)
        return super().apply(layer, x, bias)

    def gemm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             silu_mul: bool = False) -> torch.Tensor:
        """The small-M kernel on a decode-sized x (the caller checked the shape)."""
        self.small_m_calls += 1
        handoff = self.handoff
        if handoff is None:
            return small_m_linear(x, weight, bias, workspace=self.workspace,
                                  config=self.small_m_config, silu_mul=silu_mul)
        handoff.flush()  # its partials live in the workspace this launch writes
        if self.defer and bias is None and self.splits > 1:
            out = small_m_linear(x, weight, None, workspace=self.workspace,
                                 config=self.small_m_config, silu_mul=silu_mul, reduce=False)
            handoff.pending = (out, self.workspace, self.splits)
            return out
        return small_m_linear(x, weight, bias, workspace=self.workspace,
                              config=self.small_m_config, silu_mul=silu_mul)


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


def install_small_m_gemm(model: torch.nn.Module, which: bool | str = True,
                         fuse_silu: bool = False,
                         fuse_residual: bool = False) -> dict[str, SmallMLinearMethod]:
    """Give the eligible linear layers of `model` a `SmallMLinearMethod` (`which`: True every
    one, "auto" those `auto_selects`); with `fuse_silu`, the MLPs around them the fused
    SiLU * up (`install_silu_down_proj`); with `fuse_residual`, o_proj and down_proj's split
    reduce fused into the residual add + RMSNorm after them (`install_residual_norm`). Returns
    the methods by module name. Call after the weights are loaded and before any capture."""
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
        cfg = configs[name]
        method = SmallMLinearMethod(cfg, workspace,
                                    split_k_plan(module.weight.shape[1], cfg.block_k,
                                                 cfg.num_splits)[0])
        module.quant_method = method
        methods[name] = method
    logger.info("moe_graphs: small-M GEMM on %d linear layers (%s; <= %d rows; workspace "
                "%.1f MiB)", len(methods), "auto" if which == "auto" else "all eligible", MAX_M,
                need * 4 / 2**20)
    if fuse_silu:
        fused = install_silu_down_proj(model, methods)
        logger.info("moe_graphs: SiLU * up fused into down_proj in %d MLPs", fused)
    if fuse_residual:
        deferred, why = install_residual_norm(model, methods)
        logger.info("moe_graphs: split-K reduce fused into the residual add + RMSNorm after %d "
                    "projections%s", deferred, f" (none: {why})" if why else "")
    return methods


def _silu_down_forward(mlp: Any, x: torch.Tensor) -> torch.Tensor:
    """Qwen2MLP.forward (Qwen3's MLP) with SiluAndMul inside down_proj's small-M GEMM."""
    gate_up, _ = mlp.gate_up_proj(x)
    down = mlp.down_proj
    method = down.quant_method
    # NOTE: graph safety: shapes only, as in SmallMLinearMethod.apply.
    if gate_up.dim() == 2 and 0 < gate_up.shape[0] <= MAX_M and gate_up.stride(1) == 1:
        return method.gemm(gate_up, down.weight, None, silu_mul=True)
    out, _ = down(mlp.act_fn(gate_up))
    return out


def install_silu_down_proj(model: torch.nn.Module,
                           methods: dict[str, SmallMLinearMethod]) -> int:
    """Give every Qwen3 MLP (vLLM's `Qwen2MLP`, exact type) whose down_proj has one of `methods`,
    vLLM's SiluAndMul, no bias and one tensor-parallel rank a forward that computes SiLU(gate) *
    up inside down_proj's GEMM for decode-sized inputs (`small_m_linear(silu_mul=True)`; larger
    inputs run vLLM's path). At one rank, RowParallelLinear's forward is exactly its quant
    method's apply. Returns how many MLPs changed."""
    from functools import partial

    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.models.qwen2 import Qwen2MLP

    by_method = {id(m) for m in methods.values()}
    count = 0
    for mlp in model.modules():
        down = getattr(mlp, "down_proj", None)
        if (type(mlp) is Qwen2MLP and type(mlp.act_fn) is SiluAndMul and down is not None
                and id(down.quant_method) in by_method and down.bias is None
                and getattr(down, "tp_size", 1) == 1):
            mlp.forward = partial(_silu_down_forward, mlp)
            count += 1
    return count


def _norm_forward(norm: Any, forward: Any, handoff: ResidualHandoff, x: torch.Tensor,
                  residual: torch.Tensor | None = None) -> Any:
    """RMSNorm.forward that takes a deferred projection output by the fused kernel."""
    pending = handoff.pending
    if pending is not None:
        if x is pending[0] and residual is not None and residual.dtype == x.dtype \
                and norm.weight.dtype == x.dtype:
            handoff.pending = None
            handoff.fused += 1
            return reduce_add_rms_norm(pending[1], pending[2], residual, norm.weight,
                                       norm.variance_epsilon, out=x)
        handoff.flush()
    return forward(x, residual) if residual is not None else forward(x)


def install_residual_norm(model: torch.nn.Module,
                          methods: dict[str, SmallMLinearMethod]) -> tuple[int, str]:
    """Fuse the split reduce of each decoder layer's o_proj and (Qwen3 MLP) down_proj into the
    residual add + RMSNorm that consumes it (`ops/reduce_add_rms_norm.py`): one launch fewer per
    projection. Only for vLLM's Qwen3 / Qwen3-MoE decoder layers (exact types, whose forward
    hands o_proj's output straight to post_attention_layernorm and the MLP's to the next
    layer's input_layernorm or the final norm), one tensor-parallel rank, one pipeline stage,
    no auxiliary hidden-state layers (EAGLE-3 reads a layer's output before the next norm),
    vLLM's RMSNorm with a weight. Returns (projections deferred, why none when 0)."""
    from functools import partial

    from vllm.distributed import get_pp_group
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.models.qwen2 import Qwen2MLP
    from vllm.model_executor.models.qwen3 import Qwen3DecoderLayer
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeDecoderLayer

    if get_pp_group().world_size != 1:
        return 0, "pipeline parallelism"
    inner = getattr(model, "model", None)
    if getattr(inner, "aux_hidden_state_layers", None):
        return 0, "auxiliary hidden-state layers (EAGLE-3)"
    layers = [m for m in model.modules() if type(m) in (Qwen3DecoderLayer, Qwen3MoeDecoderLayer)]

    def plain_norm(norm: Any) -> bool:
        return (type(norm) is RMSNorm and norm.has_weight and norm.variance_size_override is None
                and norm.weight.shape[0] <= MAX_N)

    norms = [getattr(layer, n, None) for layer in layers
             for n in ("input_layernorm", "post_attention_layernorm")]
    norms.append(getattr(inner, "norm", None))
    if not layers or not all(plain_norm(n) for n in norms):
        return 0, "not vLLM's Qwen3 decoder layers with plain RMSNorms"
    by_id = {id(m): m for m in methods.values()}
    deferred = []
    for layer in layers:
        proj = [layer.self_attn.o_proj]
        if type(layer.mlp) is Qwen2MLP:
            proj.append(layer.mlp.down_proj)
        for linear in proj:
            method = by_id.get(id(linear.quant_method))
            if method is not None and getattr(linear, "tp_size", 1) == 1 and method.splits > 1:
                deferred.append(method)
    if not deferred:
        return 0, "no o_proj / down_proj with a split-K small-M GEMM"
    handoff = ResidualHandoff()
    for method in methods.values():  # every GEMM on the shared workspace flushes first
        method.handoff = handoff
    for method in deferred:
        method.defer = True
    for norm in norms:
        norm.forward = partial(_norm_forward, norm, norm.forward, handoff)
    model.moe_graphs_residual_handoff = handoff  # tests and diagnostics
    return len(deferred), ""
