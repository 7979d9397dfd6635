"""RMSNorm (with and without the residual add) and SiLU-and-mul with torch.compile's rounding.

Stock vLLM on a GPU compiles its model with Inductor, which runs vLLM's `native` RMSNorm and
SiLU-and-mul as fused Triton kernels and, inside a fused kernel, keeps intermediates in fp32:
its `.to(bf16)` between two fused ops is elided (`torch._inductor.config.emulate_precision_casts`
off, the default). So stock normalises the fp32 sum of the hidden state and the residual, and
rounds each output once. vLLM's CUDA kernels, which run where nothing is compiled (the plugin's
graphs, vLLM's eager mode), normalise the bf16-rounded sum and round twice (after the
normalisation, then after the weight; after SiLU, then after the product). The kernels here do
what stock's compiled code does, so the plugin's logprobs sit near stock's (measured:
`tests/graphs/test_gpu_numerics.py`):

    fused_add_rms_norm_(x, r, w, eps):  h = f32(x) + f32(r);  r <- bf16(h)
                                        x <- bf16(h * rsqrt(mean(h^2) + eps) * f32(w))
    rms_norm(x, w, eps):                bf16(f32(x) * rsqrt(mean(f32(x)^2) + eps) * f32(w))
    silu_and_mul(x) with x = [a | b]:   bf16(f32(a) * sigmoid(f32(a)) * f32(b))

One program per row; the hidden size fits one block (Qwen3: 1024-5120 for the norms, up to
25600 for SiLU-and-mul, which loops over column blocks). The row count is the grid, never an
argument, so a batch of one compiles no variant of its own (Triton specialises an int of 1).
Rows must have a unit column stride; the row stride is an argument.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_WARPS = 4
MAX_NORM_BLOCK = 16384  # the largest hidden size one program normalises in registers
ACT_BLOCK = 1024  # SiLU-and-mul columns per step of a program's loop


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, x_stride, r_stride, out_stride, n_cols,
                     eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r_row = r_ptr + row * r_stride + cols
        h += tl.load(r_row, mask=mask, other=0.0).to(tl.float32)
        tl.store(r_row, h.to(r_ptr.dtype.element_ty), mask=mask)
    inv = tl.math.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (h * inv * w).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    for start in range(0, d, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < d
        a = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols,
                 (a * tl.sigmoid(a) * b).to(out_ptr.dtype.element_ty), mask=mask)


def unsupported(x: torch.Tensor, weight: torch.Tensor | None = None) -> str | None:
    """Why these kernels cannot take `x` (and `weight`); None if they can."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {x.dtype} (bf16 / fp16 only)"
    if x.dim() != 2 or x.stride(-1) != 1:
        return f"shape {tuple(x.shape)} strides {x.stride()} (rows with unit column stride only)"
    if weight is not None:
        if weight.dtype != x.dtype or weight.shape != (x.shape[-1],) or weight.stride(0) != 1:
            return (f"weight {weight.dtype} {tuple(weight.shape)} for input {x.dtype} "
                    f"{tuple(x.shape)}")
        if x.shape[-1] > MAX_NORM_BLOCK:
            return f"hidden size {x.shape[-1]} > {MAX_NORM_BLOCK}"
    return None


def _check(x: torch.Tensor, weight: torch.Tensor | None = None) -> None:
    if (why := unsupported(x, weight)) is not None:
        raise ValueError(f"norm_act: {why}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the rows of `x` [T, N] into a new tensor (see the module docstring)."""
    _check(x, weight)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x, x, weight, out, x.stride(0), 0, out.stride(0), x.shape[1], eps,
            HAS_RESIDUAL=False, BLOCK=triton.next_power_of_2(x.shape[1]), num_warps=NUM_WARPS)
    return out


def fused_add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """In place, as vLLM's `fused_add_rms_norm`: `residual` <- x + residual, `x` <- RMSNorm of
    that sum (fp32, see the module docstring). Returns (x, residual)."""
    _check(x, weight)
    _check(residual)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"norm_act: residual {residual.dtype} {tuple(residual.shape)} for "
                         f"input {x.dtype} {tuple(x.shape)}")
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x, residual, weight, x, x.stride(0), residual.stride(0), x.stride(0), x.shape[1],
            eps, HAS_RESIDUAL=True, BLOCK=triton.next_power_of_2(x.shape[1]),
            num_warps=NUM_WARPS)
    return x, residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU of the first half of each row of `x` [T, 2d] times its second half: [T, d]."""
    _check(x)
    if x.shape[1] % 2:
        raise ValueError(f"norm_act: silu_and_mul needs an even row width, got {x.shape[1]}")
    d = x.shape[1] // 2
    out = torch.empty((x.shape[0], d), dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _silu_and_mul_kernel[(x.shape[0],)](x, out, x.stride(0), out.stride(0), d,
                                            BLOCK=min(ACT_BLOCK, triton.next_power_of_2(d)),
                                            num_warps=NUM_WARPS)
    return out
