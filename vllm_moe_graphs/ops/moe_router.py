"""Top-k softmax routing of a fused-MoE layer, with the padding rows of a padded step sent to a
sentinel expert id in the same launch.

Shapes: T = rows (tokens of the step, padding included), E = experts, K = experts per token.
logits [T, E] (the router's output, any float dtype, unit E stride); weights [T, K] float32;
ids [T, K] int32 or int64; real [1] int32 (device scalar: rows >= real[0] are padding).

Semantics are those of vLLM 0.26's `topk_softmax` (`fused_topk` with softmax scoring): softmax
over the E logits in float32, the K largest probabilities in descending order (a tie goes to
the lower expert id), divided by their sum when `renormalize`. Rows at or past `real[0]` get
`sentinel` for every id (the id vLLM's Triton experts skip, `integration/model/moe_padding.py`);
their weights are computed like any row's. With `real` None every row is real.

Design: one program per BLOCK_T rows, a whole row of E logits in registers; K rounds of
(max, lowest index holding it, knock it out). BLOCK_T, the warp count and the reduction layout
are fixed, and T is never specialized on, so a row's ids and weights are bitwise the same
whatever T it comes with (a graph key pads T; the kill switch runs the real T).
Graph safety: the launcher reads only shapes, dtypes and host constants; no host sync; the
outputs are allocated as vLLM's `fused_topk` allocates them (`torch.empty`, the graph pool
inside a capture); the real-row count is read on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_moe_graphs.ops.kv_write import check_same_device

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
SUPPORTED_ID_DTYPES: tuple[torch.dtype, ...] = (torch.int32, torch.int64)
MAX_EXPERTS = 1024  # a whole row lives in registers
BLOCK_T = 4
NUM_WARPS = 1


@triton.jit(do_not_specialize=["T", "sentinel"])
def _topk_softmax_kernel(
    weights_ptr,  # [T, K] float32
    ids_ptr,  # [T, K] int32 / int64
    logits_ptr,  # [T, E], row stride stride_t, unit E stride
    real_ptr,  # [1] int32, read when HAS_REAL
    T,
    E,
    stride_t,
    sentinel,
    K: tl.constexpr,
    K_P2: tl.constexpr,  # next power of two >= K
    BLOCK_E: tl.constexpr,  # next power of two >= E
    BLOCK_T: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_REAL: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    cols = tl.arange(0, BLOCK_E)  # [BE]
    slots = tl.arange(0, K_P2)  # [KP]
    row_in = rows < T
    col_in = cols < E
    offs = rows.to(tl.int64)[:, None] * stride_t + cols[None, :]  # [BT, BE]
    x = tl.load(logits_ptr + offs, mask=row_in[:, None] & col_in[None, :], other=0.0)
    x = tl.where(col_in[None, :], x.to(tl.float32), float("-inf"))  # [BT, BE]
    e = tl.exp(x - tl.max(x, axis=1)[:, None])  # [BT, BE], 0 past E
    p = e * (1.0 / tl.sum(e, axis=1))[:, None]  # [BT, BE] softmax
    top_w = tl.zeros((BLOCK_T, K_P2), dtype=tl.float32)  # [BT, KP]
    top_i = tl.zeros((BLOCK_T, K_P2), dtype=tl.int32)  # [BT, KP]
    for k in tl.static_range(K):
        best = tl.max(p, axis=1)  # [BT]
        pick = tl.min(tl.where(p == best[:, None], cols[None, :], BLOCK_E), axis=1)  # [BT]
        top_w = tl.where(slots[None, :] == k, best[:, None], top_w)
        top_i = tl.where(slots[None, :] == k, pick[:, None], top_i)
        p = tl.where(cols[None, :] == pick[:, None], -1.0, p)  # probabilities are >= 0
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]  # slots past K hold 0
    if HAS_REAL:
        padding = rows >= tl.load(real_ptr)  # [BT]
        top_i = tl.where(padding[:, None], sentinel, top_i)
    out = rows.to(tl.int64)[:, None] * K + slots[None, :]  # [BT, KP]
    keep = row_in[:, None] & (slots[None, :] < K)
    tl.store(weights_ptr + out, top_w, mask=keep)
    tl.store(ids_ptr + out, top_i.to(ids_ptr.dtype.element_ty), mask=keep)


def topk_softmax(
    logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
    *,
    ids_dtype: torch.dtype = torch.int32,
    real: torch.Tensor | None = None,  # [1] int32
    sentinel: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, K] float32, ids [T, K] `ids_dtype`) of `logits`' rows (module doc); rows at
    or past `real[0]` get `sentinel` ids."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be a 2-d [tokens, experts] tensor with unit expert stride, "
                         f"got shape {tuple(logits.shape)} strides {logits.stride()}")
    if logits.dtype not in SUPPORTED_DTYPES:
        raise NotImplementedError(f"logits dtype {logits.dtype} (supported: {SUPPORTED_DTYPES})")
    if ids_dtype not in SUPPORTED_ID_DTYPES:
        raise NotImplementedError(f"ids dtype {ids_dtype} (supported: {SUPPORTED_ID_DTYPES})")
    rows, experts = logits.shape
    if not 0 < top_k <= experts <= MAX_EXPERTS:
        raise ValueError(f"top_k={top_k} with {experts} experts: needs 0 < top_k <= experts "
                         f"<= {MAX_EXPERTS}")
    if real is not None:
        check_same_device(logits=logits, real=real)
        if real.dtype != torch.int32 or real.numel() != 1:
            raise ValueError(f"real must be one int32 element, got {real.dtype} "
                             f"shape {tuple(real.shape)}")
    weights = torch.empty(rows, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(rows, top_k, dtype=ids_dtype, device=logits.device)
    if rows == 0:
        return weights, ids
    _topk_softmax_kernel[(triton.cdiv(rows, BLOCK_T),)](
        weights, ids, logits, real if real is not None else ids, rows, experts,
        logits.stride(0), sentinel, K=top_k, K_P2=triton.next_power_of_2(top_k),
        BLOCK_E=triton.next_power_of_2(experts), BLOCK_T=BLOCK_T,
        RENORMALIZE=renormalize, HAS_REAL=real is not None, num_warps=NUM_WARPS)
    return weights, ids
