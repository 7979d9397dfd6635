"""Varlen / chunked prefill attention over the paged KV cache (prefix-cached context included).

Shapes (legend in `kv_write.py`): query/out [T, Hq, D]; key_cache/value_cache [NB, BS, Hkv, D]
strided views; block_table [B_max, max_blocks] int32; query_start_loc [B + 1] int32;
seq_lens [>= B] int32.

Sequence i owns query rows query_start_loc[i]:query_start_loc[i + 1]; they are the last
q_len_i tokens of its seq_lens[i]-token context, whose KV (new tokens included) is already in
the cache. Causal: query token j (absolute position seq_len - q_len + j) sees KV 0..pos.

Design: one program per (query block, kv head). A query block is BLOCK_Q consecutive query
tokens of one sequence times the G query heads of the kv head, flattened to the M = BLOCK_Q *
GROUP_PAD rows of the score tile (vLLM's unified-attention trick), so K/V tiles are shared by
the whole query group. Program ids are numbered per sequence from
query_start_loc[i] // BLOCK_Q + i, which bounds the grid by T // BLOCK_Q + B from shapes alone;
a program finds its sequence by binary search over query_start_loc. BLOCK_Q is derived from the
host constant `max_query_len`, so a batch of decode rows (max_query_len 1) does not waste rows.
Only rows of tokens < query_start_loc[B] are written.
An FP8 cache is dequantized tile by tile as in `paged_decode.py` (a constexpr switch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

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

# ----------------------------------------------------------------------------- tunables
DEFAULT_BLOCK_M = 64  # score-tile rows: BLOCK_Q query tokens x GROUP_PAD heads
DEFAULT_BLOCK_N = 64  # KV tokens per loop step
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 2
MIN_M = 16  # smallest M tl.dot accepts


@dataclass(frozen=True, slots=True)
class PrefillKernelConfig:
    block_m: int = DEFAULT_BLOCK_M
    block_n: int = DEFAULT_BLOCK_N
    num_warps: int = DEFAULT_NUM_WARPS
    num_stages: int = DEFAULT_NUM_STAGES

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of 2 >= 16, got {v}")


@triton.jit
def _find_sequence(
    query_start_loc_ptr,  # [B + 1] int32
    num_seqs,
    pid,
    BLOCK_Q: tl.constexpr,
):
    # Largest i with query_start_loc[i] // BLOCK_Q + i <= pid.
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# NOTE: num_seqs (the batch's sequence count) is a runtime int: not specialised (== 1, % 16), so
# one compile covers every batch and the start-up warm-up (integration/startup/precapture.py)
# covers it.
@triton.jit(do_not_specialize=["num_seqs"])
def _paged_prefill_kernel(
    out_ptr,  # [T, Hq, D]
    query_ptr,  # [T, Hq, D]
    key_cache_ptr,  # [NB, BS, Hkv, D] strided view
    value_cache_ptr,  # [NB, BS, Hkv, D] strided view
    block_table_ptr,  # [B_max, max_blocks] int32
    query_start_loc_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [>= B] int32
    k_scale_ptr,  # [1] float32 when KV_FP8, else None
    v_scale_ptr,  # [1] float32 when KV_FP8, else None
    qk_scale,  # float32: softmax scale * log2(e)
    num_seqs,  # int32: B
    stride_q_t: tl.int64,
    stride_q_h: tl.int64,
    stride_o_t: tl.int64,
    stride_o_h: tl.int64,
    stride_k_block: tl.int64,
    stride_k_slot: tl.int64,
    stride_k_head: tl.int64,
    stride_v_block: tl.int64,
    stride_v_slot: tl.int64,
    stride_v_head: tl.int64,
    stride_bt: tl.int64,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # pow2 >= G
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # max(16, BLOCK_Q * GROUP_PAD): score-tile rows
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache page
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,  # the cache is float8e4nv: dequantize each tile
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)

    seq = _find_sequence(query_start_loc_ptr, num_seqs, pid, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # prefix tokens before the first query token

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_SIZE)
    offs_n = tl.arange(0, BLOCK_N)
    # rows beyond BLOCK_Q * GROUP_PAD only pad M up to 16 and belong to no query token
    q_pos = q_block * BLOCK_Q + offs_m // GROUP_PAD  # [BLOCK_M] position within the query
    g = offs_m % GROUP_PAD
    row_mask = (offs_m < BLOCK_Q * GROUP_PAD) & (q_pos < q_len) & (g < GROUP)
    token = (q_start + q_pos).to(tl.int64)
    head = kv_head * GROUP + g

    # Q : [BLOCK_M, D]; invalid rows are zero and never stored
    q = tl.load(
        query_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :],
        mask=row_mask[:, None],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE], dtype=tl.float32)
    k_scale, v_scale = load_kv_scales(k_scale_ptr, v_scale_ptr, KV_FP8)

    # Causal horizon of the block's last query token, clipped to the context.
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    q_abs = context_len + q_pos  # [BLOCK_M] absolute position of each row's query token
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    k_base = key_cache_ptr + kv_head * stride_k_head
    v_base = value_cache_ptr + kv_head * stride_v_head
    # The first tile holds KV position 0, visible to every row: m_i is finite from then on.
    for start in tl.range(0, kv_end, BLOCK_N):
        # K, V : [BLOCK_N, D]
        k, v, kv, kv_mask = load_kv_tile(
            bt_row, k_base, v_base, start, kv_end, offs_n, offs_d, stride_k_block,
            stride_k_slot, stride_v_block, stride_v_slot, k_scale, v_scale, BLOCK_SIZE, KV_FP8,
            q.dtype)
        # S : [BLOCK_M, BLOCK_N], log2 domain, causal
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        visible = kv_mask[None, :] & (kv[None, :] <= q_abs[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None],
    )


def paged_prefill_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    config: PrefillKernelConfig | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new query tokens over its whole paged context.

    query/out: [T, Hq, D]; key_cache/value_cache: [NB, BS, Hkv, D] views of the query's dtype,
    or FP8 e4m3 with k_scale / v_scale float32 tensors of one element (read on the device, as
    in `paged_decode_attention`); block_table:
    [B_max, max_blocks] int32; query_start_loc: [B + 1] int32 (non-decreasing, last entry
    <= T); seq_lens: [>= B] int32 with seq_lens[i] >= q_len_i; max_query_len: host upper bound
    of q_len_i (q_len 1 rows are fine). Writes out rows < query_start_loc[B]. Returns `out`.
    No host sync; the grid is (T // BLOCK_Q + B, Hkv) with BLOCK_Q from max_query_len.
    """
    # NOTE: max_query_len must be the scheduler's host int: deriving it from query_start_loc
    # here would be a device-to-host sync. It only sizes the tile, so an understatement is
    # still correct (just slower).
    num_tokens, num_q_heads, head_size, block_size, num_kv_heads, kv_fp8 = check_attention_io(
        query, out, key_cache, value_cache, scale, "tokens", k_scale, v_scale)
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] < 1:
        raise ValueError(f"query_start_loc must be [B + 1], got {tuple(query_start_loc.shape)}")
    num_seqs = query_start_loc.shape[0] - 1
    check_index_tensor("query_start_loc", query_start_loc, torch.int32, num_seqs + 1)
    check_index_tensor("seq_lens", seq_lens, torch.int32, num_seqs)
    check_index_tensor("block_table", block_table, torch.int32, num_seqs)
    check_same_device(
        out=out, query=query, key_cache=key_cache, value_cache=value_cache,
        block_table=block_table, query_start_loc=query_start_loc, seq_lens=seq_lens,
    )
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    if num_seqs == 0 or num_tokens == 0:
        return out

    cfg = config or PrefillKernelConfig()
    group = num_q_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    block_q = max(1, min(next_power_of_2(max_query_len), cfg.block_m // group_pad))
    block_m = max(MIN_M, block_q * group_pad)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_prefill_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        block_table,
        query_start_loc,
        seq_lens,
        k_scale if kv_fp8 else None,  # None: a constexpr, the unquantized kernel is unchanged
        v_scale if kv_fp8 else None,
        float(scale) * LOG2E,
        num_seqs,
        *query.stride()[:2],
        *out.stride()[:2],
        *kv_cache_strides(key_cache, value_cache),
        block_table.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_SIZE=head_size,
        BLOCK_SIZE=block_size,
        BLOCK_N=cfg.block_n,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        KV_FP8=kv_fp8,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
