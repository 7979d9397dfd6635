"""Paged decode attention: one query token per sequence, GQA-aware, optional split-K.

Shapes (legend in `kv_write.py`): query/out [B, Hq, D]; key_cache/value_cache [NB, BS, Hkv, D]
strided views; block_table [B_max, max_blocks] int32; seq_lens [B_max] int32; workspace
[B_ws, Hq, S_ws, D + 2] float32.

Design, per program = (sequence b, kv head h, split s):
- the G query heads of kv head h form the M dimension of the score tile, so every KV byte is
  read once per query group; for G >= DOT_MIN_GROUP the scores and P @ V are `tl.dot`s with M
  padded to 16, below that a broadcast-multiply-reduce;
- each loop step gathers BLOCK_N tokens, i.e. several pages when BLOCK_N > BS, through
  the block table; fp32 online softmax in base 2 (log2(e) folded into the scale);
- split-K: the context of every sequence is cut into `num_splits` equal chunks (rounded up to
  BLOCK_N so tiles never straddle chunks). `num_splits` is a host constant chosen from the
  *bucket* (`decode_plan.choose_num_splits`), never from data; chunk bounds are computed in
  the kernel from seq_lens. Each split writes (acc, max, sum) to the workspace and `_decode_reduce_kernel`
  merges them with a log-sum-exp rescale, which is exact up to fp32 rounding.
FP8 KV cache (`kv_quant.py`): each K/V tile is dequantized after its load, fp8 * scale rounded
to the dtype the tile is multiplied in (the query's for tl.dot, as vLLM does; float32 for the
multiply-reduce), with k_scale / v_scale read once per program from device memory; a constexpr
switch, so the kernel of an unquantized cache is the one it was without FP8.
Graph safety: the launchers read only shapes and host constants; no allocation, no sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_moe_graphs.ops.decode_plan import (
    REDUCE_NUM_WARPS,
    DecodeKernelConfig,
    check_decode_workspace,
)
from vllm_moe_graphs.ops.kv_quant import load_kv_scales
from vllm_moe_graphs.ops.kv_write import (
    check_attention_io,
    check_index_tensor,
    check_same_device,
    kv_cache_strides,
    load_kv_tile,
    next_power_of_2,
)

LOG2E = 1.4426950408889634

DOT_MIN_GROUP = 2  # G >= this uses tl.dot (M padded to DOT_MIN_M), else multiply-reduce
DOT_MIN_M = 16  # smallest M tl.dot accepts


# ----------------------------------------------------------------------------- kernels


# NOTE: num_splits is not specialised (it differs by bucket): one compile per SPLIT value.
@triton.jit(do_not_specialize=["num_splits"])
def _paged_decode_kernel(
    out_ptr,  # [B, Hq, D] written when not SPLIT
    workspace_ptr,  # [B_ws, Hq, S_ws, D + 2] float32, written when SPLIT
    query_ptr,  # [B, Hq, D]
    key_cache_ptr,  # [NB, BS, Hkv, D] strided view
    value_cache_ptr,  # [NB, BS, Hkv, D] strided view
    block_table_ptr,  # [B_max, max_blocks] int32
    seq_lens_ptr,  # [B_max] int32, 0 = padded row
    k_scale_ptr,  # [1] float32 when KV_FP8, else None
    v_scale_ptr,  # [1] float32 when KV_FP8, else None
    qk_scale,  # float32: softmax scale * log2(e)
    num_splits,  # int32: S, the number of context chunks (1 when not SPLIT)
    stride_q_b: tl.int64,
    stride_q_h: tl.int64,
    stride_o_b: tl.int64,
    stride_o_h: tl.int64,
    stride_w_b: tl.int64,
    stride_w_h: tl.int64,
    stride_w_s: tl.int64,
    stride_k_block: tl.int64,
    stride_k_slot: tl.int64,
    stride_k_head: tl.int64,
    stride_v_block: tl.int64,
    stride_v_slot: tl.int64,
    stride_v_head: tl.int64,
    stride_bt: tl.int64,
    GROUP: tl.constexpr,  # G query heads per kv head
    GROUP_PAD: tl.constexpr,  # M of the score tile: pow2 >= G (>= 16 when USE_DOT)
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache page
    BLOCK_N: tl.constexpr,  # tokens per loop step
    SPLIT: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 queries, "tf32" (ignored) for 16-bit
    KV_FP8: tl.constexpr,  # the cache is float8e4nv: dequantize each tile
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_SIZE)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    q_heads = kv_head * GROUP + offs_g  # [GROUP_PAD]

    seq_len = tl.load(seq_lens_ptr + seq)
    if SPLIT:
        chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, seq_len)
    else:
        lo = 0
        hi = seq_len

    # Q : [GROUP_PAD, D], padded heads are zero rows and never stored
    q = tl.load(
        query_ptr + seq * stride_q_b + q_heads[:, None] * stride_q_h + offs_d[None, :],
        mask=g_mask[:, None],
        other=0.0,
    )
    if not USE_DOT:
        q = q.to(tl.float32)
    k_scale, v_scale = load_kv_scales(k_scale_ptr, v_scale_ptr, KV_FP8)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_SIZE], dtype=tl.float32)

    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    k_base = key_cache_ptr + kv_head * stride_k_head
    v_base = value_cache_ptr + kv_head * stride_v_head
    # NOTE: a padded row (seq_len 0) or an empty split runs zero iterations: no block-table or
    # KV read at all, so stale block ids of padded rows are never dereferenced.
    for start in tl.range(lo, hi, BLOCK_N):
        # K, V : [BLOCK_N, D], gathered over BLOCK_N // BLOCK_SIZE pages
        k, v, tok, tok_mask = load_kv_tile(
            bt_row, k_base, v_base, start, hi, offs_n, offs_d, stride_k_block, stride_k_slot,
            stride_v_block, stride_v_slot, k_scale, v_scale, BLOCK_SIZE, KV_FP8, q.dtype)
        # S : [GROUP_PAD, BLOCK_N], log2 domain
        if USE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        else:
            s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        s = tl.where(tok_mask[None, :], s * qk_scale, float("-inf"))
        # every step has >= 1 valid token, so m_new is finite and no inf - inf appears
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        else:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)  # [GROUP_PAD, D]
            acc = acc * alpha[:, None] + pv
        m_i = m_new

    if SPLIT:
        # Empty splits store (acc 0, max -inf, sum 0): the merge gives them weight 0.
        row = (
            workspace_ptr
            + seq.to(tl.int64) * stride_w_b
            + q_heads.to(tl.int64) * stride_w_h
            + split * stride_w_s
        )  # [GROUP_PAD]
        tl.store(row[:, None] + offs_d[None, :], acc, mask=g_mask[:, None])
        tl.store(row + HEAD_SIZE, m_i, mask=g_mask)
        tl.store(row + HEAD_SIZE + 1, l_i, mask=g_mask)
    else:
        denom = tl.where(l_i > 0.0, l_i, 1.0)  # seq_len 0 -> acc 0 / 1 = 0, never NaN
        o = acc / denom[:, None]
        tl.store(
            out_ptr + seq * stride_o_b + q_heads[:, None] * stride_o_h + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None],
        )


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    out_ptr,  # [B, Hq, D]
    workspace_ptr,  # [B_ws, Hq, S_ws, D + 2] float32
    num_splits,  # int32: S valid split rows per (sequence, head)
    stride_o_b: tl.int64,
    stride_o_h: tl.int64,
    stride_w_b: tl.int64,
    stride_w_h: tl.int64,
    stride_w_s: tl.int64,
    HEAD_SIZE: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # pow2 >= S
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_SIZE)
    s_mask = offs_s < num_splits

    row = workspace_ptr + seq * stride_w_b + head * stride_w_h + offs_s * stride_w_s  # [SPLITS_PAD]
    m = tl.load(row + HEAD_SIZE, mask=s_mask, other=float("-inf"))
    l = tl.load(row + HEAD_SIZE + 1, mask=s_mask, other=0.0)
    live = m > float("-inf")
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)  # all splits empty -> zeros, not NaN
    w = tl.where(live, tl.math.exp2(m - m_max), 0.0)  # [SPLITS_PAD]
    denom = tl.sum(w * l, axis=0)
    acc = tl.load(row[:, None] + offs_d[None, :], mask=live[:, None], other=0.0)  # [SPLITS_PAD, D]
    o = tl.sum(w[:, None] * acc, axis=0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(
        out_ptr + seq * stride_o_b + head * stride_o_h + offs_d,
        o.to(out_ptr.dtype.element_ty),
    )


# ----------------------------------------------------------------------------- launcher


def paged_decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int = 1,
    workspace: torch.Tensor | None = None,
    config: DecodeKernelConfig | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[b, i] = softmax(scale * q[b, i] . K_b^T) V_b over the first seq_lens[b] cached tokens.

    query/out: [B, Hq, D] with B <= B_max; key_cache/value_cache: [NB, BS, Hkv, D] views of
    the query's dtype, or FP8 e4m3 with k_scale / v_scale float32 tensors of one element (read
    on the device: K = fp8 * k_scale, V = fp8 * v_scale; not read for other caches);
    block_table: [B_max, max_blocks] int32; seq_lens: [B_max] int32 (0 -> zeros, no KV read);
    num_splits: host constant S >= 1 (`choose_num_splits` on the bucket); S > 1 needs a float32
    `workspace` of at least `decode_workspace_shape(B, Hq, D, S)`. Returns `out`.
    Graph safe: reads only shapes, no allocation, no host sync; grid (B, Hkv, S) [+ (B, Hq)].
    """
    # NOTE: graph safety. Everything below reads shapes, strides, dtypes and host constants
    # only: no `.item()`, no read of seq_lens/block_table, no allocation. `num_splits` must come
    # from the bucket (choose_num_splits), `scale` must be a Python float (float() of a CUDA
    # tensor would sync), and the workspace must be allocated before capture.
    batch, num_q_heads, head_size, block_size, num_kv_heads, kv_fp8 = check_attention_io(
        query, out, key_cache, value_cache, scale, "batch", k_scale, v_scale)
    check_index_tensor("seq_lens", seq_lens, torch.int32, batch)
    check_index_tensor("block_table", block_table, torch.int32, batch)
    check_same_device(
        out=out, query=query, key_cache=key_cache, value_cache=value_cache,
        block_table=block_table, seq_lens=seq_lens,
    )
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    split = num_splits > 1
    if split:
        check_decode_workspace(workspace, batch, num_q_heads, head_size, num_splits, query.device)
    if batch == 0:
        return out

    cfg = config or DecodeKernelConfig()
    group = num_q_heads // num_kv_heads
    use_dot = group >= DOT_MIN_GROUP
    group_pad = max(next_power_of_2(group), DOT_MIN_M) if use_dot else next_power_of_2(group)
    # NOTE: the grid depends on shapes and num_splits only, never on sequence lengths.
    ws = workspace if split else out  # placeholder pointer when not SPLIT (never written)
    ws_strides = (ws.stride(0), ws.stride(1), ws.stride(2)) if split else (0, 0, 0)

    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        out,
        ws,
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        k_scale if kv_fp8 else None,  # None: a constexpr, the unquantized kernel is unchanged
        v_scale if kv_fp8 else None,
        float(scale) * LOG2E,
        num_splits,
        *query.stride()[:2],
        *out.stride()[:2],
        *ws_strides,
        *kv_cache_strides(key_cache, value_cache),
        block_table.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_SIZE=head_size,
        BLOCK_SIZE=block_size,
        BLOCK_N=cfg.block_n,
        SPLIT=split,
        USE_DOT=use_dot,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        KV_FP8=kv_fp8,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split:
        _decode_reduce_kernel[(batch, num_q_heads)](
            out,
            workspace,
            num_splits,
            out.stride(0),
            out.stride(1),
            workspace.stride(0),
            workspace.stride(1),
            workspace.stride(2),
            HEAD_SIZE=head_size,
            SPLITS_PAD=next_power_of_2(num_splits),
            num_warps=REDUCE_NUM_WARPS,
        )
    return out
