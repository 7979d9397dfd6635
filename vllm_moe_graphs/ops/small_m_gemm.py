"""Small-M GEMM for decode-time linear layers: out[M, N] = x[M, K] @ weight[N, K]^T (+ bias[N]).

Shapes: M = rows (decode tokens, 1..MAX_M), N = output features, K = input features,
S = split-K chunks. x [M, K] (any row stride, unit K stride); weight [N, K] (vLLM's nn.Linear
layout, unit K stride); bias [N]; out [M, N] (unit N stride); workspace flat float32, read as
[S, M, N].

At decode batch sizes a linear layer is a stream over the weight: the kernel has to read the
N x K weight at HBM speed, and the tensor cores have nothing to do. Design, per program =
(N tile n, split s):
- the M rows are padded to a fixed BLOCK_M = 16 inside the kernel (masked loads give zero rows,
  masked stores drop them), and every K step is one `tl.dot` of a [16, BLOCK_K] x tile with a
  [BLOCK_N, BLOCK_K] weight tile (optionally transposed, `swap_ab`: weight as the A operand);
  a row's result therefore never depends on how many other rows came with it;
- split-K: K is cut into `num_splits` chunks of whole BLOCK_K tiles; each split writes an fp32
  partial tile to the workspace and `_small_m_reduce_kernel` sums the splits in the fixed order
  0, 1, ..., S - 1, adds the bias, casts and stores. No atomics: results are deterministic;
- the config (BLOCK_K, splits) is chosen from (N, K, num_sms) only, never from M, so the K
  reduction order of an output element is the same for every M: row i of an M = 1 call and of
  an M = 16 call are bitwise equal (CUDA graph buckets pad M differently; results do not move).
Graph safety: the launcher reads only shapes, strides, dtypes and host constants; no host sync;
the only allocation is `out` when the caller passes none; the workspace is the caller's.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from vllm_moe_graphs.ops.kv_write import check_same_device
from vllm_moe_graphs.ops.small_m_plan import (
    BLOCK_M,
    MAX_M,
    SmallMGemmConfig,
    check_small_m_workspace,
    choose_small_m_config,
    device_num_sms,
    split_k_plan,
)

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
REDUCE_BLOCK_N = 256
REDUCE_NUM_WARPS = 4


# ----------------------------------------------------------------------------- kernels


@triton.jit(do_not_specialize=["M"])
def _small_m_gemm_kernel(
    out_ptr,  # [M, N] x's dtype, written when not SPLIT
    workspace_ptr,  # [S, M, N] float32 (flat), written when SPLIT
    x_ptr,  # [M, K]
    weight_ptr,  # [N, K]
    bias_ptr,  # [N], read when HAS_BIAS and not SPLIT
    M,
    N,
    K,
    k_per_split,  # int32: K elements per split, a multiple of BLOCK_K (K when not SPLIT)
    stride_x_m: tl.int64,
    stride_w_n: tl.int64,
    stride_o_m: tl.int64,
    stride_ws_s: tl.int64,  # M * N
    BLOCK_M: tl.constexpr,  # 16: the padded M of every tl.dot
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K mask
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    SWAP_AB: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs, "tf32" (ignored) for 16-bit
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M  # padded rows load as zeros: they never touch the real rows' sums
    n_mask = offs_n < N
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)

    x_rows = x_ptr + offs_m[:, None] * stride_x_m  # [BLOCK_M, 1]
    w_rows = weight_ptr + offs_n.to(tl.int64)[:, None] * stride_w_n  # [BLOCK_N, 1]
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # out^T tile
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # The K order (tiles k_lo, k_lo + BLOCK_K, ... sequentially) depends on K and the config
    # only, never on M.
    for k0 in tl.range(k_lo, k_hi, BLOCK_K):
        k = k0 + offs_k  # [BLOCK_K]
        if EVEN_K:
            x_mask = m_mask[:, None]
            w_mask = n_mask[:, None]
        else:
            k_mask = k < k_hi
            x_mask = m_mask[:, None] & k_mask[None, :]
            w_mask = n_mask[:, None] & k_mask[None, :]
        xt = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0)  # [BLOCK_M, BLOCK_K]
        wt = tl.load(w_rows + k[None, :], mask=w_mask, other=0.0)  # [BLOCK_N, BLOCK_K]
        if SWAP_AB:
            acc = tl.dot(wt, tl.trans(xt), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(xt, tl.trans(wt), acc, input_precision=DOT_PRECISION)
    if SWAP_AB:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]

    mn_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        ws = workspace_ptr + split * stride_ws_s + offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws, acc, mask=mn_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        o = out_ptr + offs_m[:, None] * stride_o_m + offs_n[None, :]
        tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=mn_mask)


@triton.jit
def _small_m_reduce_kernel(
    out_ptr,  # [M, N] x's dtype
    workspace_ptr,  # [S, M, N] float32 (flat)
    bias_ptr,  # [N], read when HAS_BIAS
    N,
    stride_o_m: tl.int64,
    stride_ws_s: tl.int64,  # M * N
    NUM_SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    offs_n = pid_n * BLOCK + tl.arange(0, BLOCK)
    n_mask = offs_n < N
    part = workspace_ptr + row * N + offs_n  # [BLOCK], split 0
    acc = tl.load(part, mask=n_mask, other=0.0)
    # Fixed order 0, 1, ..., S - 1 for every element: deterministic, independent of M.
    for s in tl.static_range(1, NUM_SPLITS):
        acc += tl.load(part + s * stride_ws_s, mask=n_mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o_m + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


# ----------------------------------------------------------------------------- launcher


def small_m_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    config: SmallMGemmConfig | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) -> out [M, N] in x's dtype, fp32 accumulation.

    M <= MAX_M; x needs a unit K stride (any row stride); weight a unit K stride; out (optional,
    allocated when None) a unit N stride. `config` defaults to `choose_small_m_config(M, N, K,
    SMs of x's device)`; a config with num_splits > 1 (that actually splits K) needs a float32
    `workspace` of >= `small_m_workspace_numel(M, N, config)` elements. Deterministic; a row's
    bits do not depend on M. Graph safe: shapes only, no host sync; grid (N tiles, S) [+ (N / 256,
    M)]. Returns out.
    """
    # NOTE: graph safety. Everything below reads shapes, strides, dtypes and host constants
    # only: no `.item()`, no device reads. Pass `out` and `workspace` allocated before capture
    # to keep the launch allocation-free (out=None allocates through torch's caching allocator,
    # which inside a capture lands in the graph's private pool).
    m, n, k = _check_inputs(x, weight, bias, out)
    cfg = config or choose_small_m_config(max(m, 1), n, k, device_num_sms(x.device))
    splits, k_per_split = split_k_plan(k, cfg.block_k, cfg.num_splits)
    split = splits > 1
    if split:
        check_small_m_workspace(workspace, m, n, cfg, x.device)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out

    has_bias = bias is not None
    ws = workspace if split else out  # placeholder pointer when not SPLIT (never written)
    _small_m_gemm_kernel[(triton.cdiv(n, cfg.block_n), splits)](
        out,
        ws,
        x,
        weight,
        bias if has_bias else out,  # placeholder pointer without bias (never read)
        m,
        n,
        k,
        k_per_split,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        m * n,
        BLOCK_M=BLOCK_M,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0,
        HAS_BIAS=has_bias,
        SPLIT=split,
        SWAP_AB=cfg.swap_ab,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split:
        small_m_reduce(out, workspace, splits, bias)
    return out


def small_m_reduce(out: torch.Tensor, workspace: torch.Tensor, num_splits: int,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The split reduce of `small_m_linear`: out[M, N] = sum of the first `num_splits` [M, N]
    fp32 partials of `workspace` (+ bias), in out's dtype, in the fixed order 0, 1, ..."""
    m, n = out.shape
    if m == 0:
        return out
    _small_m_reduce_kernel[(triton.cdiv(n, REDUCE_BLOCK_N), m)](
        out,
        workspace,
        bias if bias is not None else out,
        n,
        out.stride(0),
        m * n,
        NUM_SPLITS=num_splits,
        BLOCK=REDUCE_BLOCK_N,
        HAS_BIAS=bias is not None,
        num_warps=REDUCE_NUM_WARPS,
    )
    return out


def _check_inputs(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None,
) -> tuple[int, int, int]:
    if x.dim() != 2:
        raise ValueError(
            f"x must be 2-D [M, K], got shape {tuple(x.shape)}: pass x.reshape(-1, x.shape[-1])"
        )
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K] (nn.Linear layout), got {tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_M:
        raise ValueError(
            f"x has M={m} rows but small_m_linear handles M <= {MAX_M} (decode batches): use "
            "torch.nn.functional.linear for larger M"
        )
    if weight.shape[1] != k:
        raise ValueError(
            f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)}: expected weight "
            f"[N, {k}] (nn.Linear layout [out_features, in_features]); transpose it if it is [K, N]"
        )
    if x.dtype not in SUPPORTED_DTYPES:
        raise NotImplementedError(
            f"dtype {x.dtype} is not supported by small_m_linear (supported: {SUPPORTED_DTYPES})"
        )
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} must match x dtype {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError(
            f"x needs a unit stride on K, got strides {x.stride()}: pass x.contiguous()"
        )
    if weight.stride(1) != 1:
        raise ValueError(
            f"weight needs a unit stride on K ([N, K] row-major), got strides {weight.stride()}:"
            " pass weight.contiguous()"
        )
    tensors = {"x": x, "weight": weight}
    if bias is not None:
        if bias.shape != (n,) or bias.stride(0) != 1:
            raise ValueError(
                f"bias must be a contiguous [{n}] tensor, got shape {tuple(bias.shape)} with "
                f"strides {bias.stride()}"
            )
        if bias.dtype != x.dtype:
            raise ValueError(f"bias dtype {bias.dtype} must match x dtype {x.dtype}")
        tensors["bias"] = bias
    if out is not None:
        if out.shape != (m, n):
            raise ValueError(f"out must have shape ({m}, {n}), got {tuple(out.shape)}")
        if out.dtype != x.dtype:
            raise ValueError(f"out dtype {out.dtype} must match x dtype {x.dtype}")
        if out.stride(1) != 1:
            raise ValueError(f"out needs a unit stride on N, got strides {out.stride()}")
        tensors["out"] = out
    check_same_device(**tensors)
    return m, n, k
