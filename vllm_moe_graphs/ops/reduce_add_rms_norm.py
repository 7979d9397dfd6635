"""Split-K reduce + residual add + RMSNorm in one launch (decode-sized linear layers).

A decoder layer's o_proj and down_proj outputs go straight into a residual add and an RMSNorm
(vLLM's `fused_add_rms_norm`: `residual += x; x = rmsnorm(residual) * weight`). With the small-M
GEMM's split-K (`ops/small_m_gemm.py`) that is two launches after the GEMM: the split reduce,
then the norm. `reduce_add_rms_norm` does both from the GEMM's fp32 partials:

    o = round(sum_s partial[s] (+ bias))          # what the reduce kernel stores, bit for bit
    residual = round(o + residual)                # vLLM's add, in the activation dtype
    out = round(round(residual * rsqrt(mean(residual^2) + eps)) * weight)

Shapes: M rows (<= small_m_gemm.MAX_M in practice), N hidden features, S splits; workspace flat
float32 read as [S, M, N]; residual [M, N] (updated in place); out [M, N] (the normalized rows,
usually the GEMM's unwritten output tensor); weight [N]. One program per row holds the whole
row (N <= MAX_N). Deterministic: the split order is 0..S-1 and the row's sum of squares is one
fixed tree per N, so a row's bits do not depend on M. The mean of squares is summed in another
order than vLLM's CUDA kernel, so `out` can differ from the unfused pair by one unit in the last
place of the activation dtype; `residual` is bitwise the unfused value.
Graph safe: shapes and host constants only, no allocation, no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_moe_graphs.ops.kv_write import check_same_device, next_power_of_2

MAX_N = 16384  # one row per program, in registers


@triton.jit
def _reduce_add_rms_norm_kernel(
    out_ptr,  # [M, N] activation dtype: the normalized rows
    residual_ptr,  # [M, N] activation dtype, read and written
    weight_ptr,  # [N] the norm's weight
    workspace_ptr,  # [S, M, N] float32 (flat): the GEMM's split partials
    bias_ptr,  # [N], read when HAS_BIAS
    N,
    stride_o_m: tl.int64,
    stride_r_m: tl.int64,
    stride_ws_s: tl.int64,  # M * N
    eps,
    NUM_SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    part = workspace_ptr + row * N + offs
    acc = tl.load(part, mask=mask, other=0.0)
    for s in tl.static_range(1, NUM_SPLITS):  # the reduce kernel's order: 0, 1, ..., S - 1
        acc += tl.load(part + s * stride_ws_s, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    o = acc.to(dtype)  # the projection's output as the unfused reduce would store it
    res_ptrs = residual_ptr + row * stride_r_m + offs
    res = tl.load(res_ptrs, mask=mask, other=0.0)
    x = (o.to(tl.float32) + res.to(tl.float32)).to(dtype)
    tl.store(res_ptrs, x, mask=mask)
    xf = x.to(tl.float32)  # masked lanes are 0: they add nothing to the sum of squares
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    y = (xf * inv).to(dtype)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    y = (y.to(tl.float32) * w.to(tl.float32)).to(dtype)
    tl.store(out_ptr + row * stride_o_m + offs, y, mask=mask)


def reduce_add_rms_norm(workspace: torch.Tensor, num_splits: int, residual: torch.Tensor,
                        weight: torch.Tensor, eps: float, out: torch.Tensor,
                        bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the [num_splits, M, N] fp32 partials at the front of `workspace` (+ bias), add them to
    `residual` in place and write rmsnorm(residual) * weight to `out`; returns (out, residual),
    as vLLM's RMSNorm returns (x, residual)."""
    if residual.dim() != 2 or out.shape != residual.shape:
        raise ValueError(f"residual and out must be the same [M, N] shape, got "
                         f"{tuple(residual.shape)} and {tuple(out.shape)}")
    m, n = residual.shape
    if n > MAX_N:
        raise ValueError(f"hidden size {n} exceeds reduce_add_rms_norm's MAX_N={MAX_N}: use "
                         "the unfused reduce and vLLM's RMSNorm")
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if workspace.dtype != torch.float32 or workspace.numel() < num_splits * m * n:
        raise ValueError(f"workspace must be float32 with >= {num_splits * m * n} elements, got "
                         f"{workspace.dtype} with {workspace.numel()}")
    if out.dtype != residual.dtype or weight.dtype != residual.dtype:
        raise ValueError(f"out {out.dtype}, residual {residual.dtype} and weight {weight.dtype} "
                         "must share one dtype")
    if weight.shape != (n,) or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"weight (and bias) must be [{n}], got {tuple(weight.shape)}"
                         f"{'' if bias is None else f' and {tuple(bias.shape)}'}")
    for name, t in (("out", out), ("residual", residual)):
        if t.stride(1) != 1:
            raise ValueError(f"{name} needs a unit stride on N, got strides {t.stride()}")
    check_same_device(workspace=workspace, residual=residual, weight=weight, out=out)
    if m == 0:
        return out, residual
    block = next_power_of_2(n)
    _reduce_add_rms_norm_kernel[(m,)](
        out, residual, weight, workspace, bias if bias is not None else weight,
        n, out.stride(0), residual.stride(0), m * n, float(eps),
        NUM_SPLITS=num_splits, BLOCK=block, HAS_BIAS=bias is not None,
        num_warps=max(1, min(16, block // 256)),
    )
    return out, residual
