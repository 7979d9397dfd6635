"""Pure-torch references for the attention ops. Tests and benchmarks only: they read lengths
on the host and allocate freely, so they are neither fast nor graph safe.

Shapes follow the legend in `kv_write.py`. Math runs in `compute_dtype` (float64 by default);
results come back in that dtype so callers choose the comparison tolerance. FP8 e4m3 caches
follow vLLM's per-tensor semantics (`kv_quant.py`): written as e4m3(x / scale), saturating at
+-448, read as fp8.to(float32) * scale.
"""

from __future__ import annotations

import torch

from vllm_moe_graphs.ops.kv_quant import FP8_E4M3_MAX, FP8_KV_DTYPE


def quantize_fp8_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3(x / scale): float32 division, clamp to +-448, round to nearest even."""
    y = x.float() / scale.float().reshape(())
    return y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def dequantize_fp8_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8.to(float32) * scale, in float32."""
    return x.float() * scale.float().reshape(())


def _as_values(cache_rows: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache rows as the values they stand for: dequantized when FP8 (scale required)."""
    if cache_rows.dtype != FP8_KV_DTYPE:
        return cache_rows
    assert scale is not None, "reference: an FP8 cache needs its scale"
    return dequantize_fp8_kv(cache_rows, scale)


def gather_kv(
    key_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    value_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    block_table_row: torch.Tensor,  # [max_blocks] int32
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `seq_len` cached tokens of one sequence: ([seq_len, Hkv, D], same)."""
    block_size = key_cache.shape[1]
    pos = torch.arange(seq_len, device=key_cache.device)
    pages = block_table_row[pos // block_size].long()
    slots = pos % block_size
    return key_cache[pages, slots], value_cache[pages, slots]


def _attend(
    q: torch.Tensor,  # [Tq, Hq, D]
    k: torch.Tensor,  # [Tk, Hkv, D]
    v: torch.Tensor,  # [Tk, Hkv, D]
    scale: float,
    visible: torch.Tensor | None,  # [Tq, Tk] bool or None (all visible)
) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [Tk, Hq, D]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, Tq, Tk]
    if visible is not None:
        scores = scores.masked_fill(~visible[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)  # [Tq, Hq, D]


def reference_paged_decode(
    query: torch.Tensor,  # [B, Hq, D]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [B_max, max_blocks]
    seq_lens: torch.Tensor,  # [B_max]
    scale: float,
    *,
    compute_dtype: torch.dtype = torch.float64,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, Hq, D] in compute_dtype; rows with seq_len 0 are zeros. An FP8 cache is read through
    k_scale / v_scale."""
    batch = query.shape[0]
    out = torch.zeros(query.shape, dtype=compute_dtype, device=query.device)
    for b, seq_len in enumerate(seq_lens[:batch].tolist()):
        if seq_len == 0:
            continue
        k, v = gather_kv(key_cache, value_cache, block_table[b], seq_len)
        k, v = _as_values(k, k_scale), _as_values(v, v_scale)
        q = query[b : b + 1].to(compute_dtype)
        out[b] = _attend(q, k.to(compute_dtype), v.to(compute_dtype), scale, None)[0]
    return out


def reference_paged_prefill(
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,  # [B + 1]
    seq_lens: torch.Tensor,  # [>= B]
    scale: float,
    *,
    compute_dtype: torch.dtype = torch.float64,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """[T, Hq, D] in compute_dtype; rows past query_start_loc[B] are zeros. An FP8 cache is read
    through k_scale / v_scale."""
    out = torch.zeros(query.shape, dtype=compute_dtype, device=query.device)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i in range(len(starts) - 1):
        q0, q1, seq_len = starts[i], starts[i + 1], lens[i]
        q_len = q1 - q0
        if q_len == 0:
            continue
        k, v = gather_kv(key_cache, value_cache, block_table[i], seq_len)
        k, v = _as_values(k, k_scale), _as_values(v, v_scale)
        q_abs = torch.arange(seq_len - q_len, seq_len, device=query.device)  # [q_len]
        visible = torch.arange(seq_len, device=query.device)[None, :] <= q_abs[:, None]
        out[q0:q1] = _attend(
            query[q0:q1].to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype), scale, visible
        )
    return out


def reference_write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [NB, BS, Hkv, D], updated in place
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 skipped
    k_scale: torch.Tensor | None = None,  # [1] float32, for an FP8 cache
    v_scale: torch.Tensor | None = None,
) -> None:
    """Copy (or, into an FP8 cache, quantize with k_scale / v_scale) each live row."""
    if key_cache.dtype == FP8_KV_DTYPE:
        assert k_scale is not None and v_scale is not None, "reference: FP8 needs scales"
        key, value = quantize_fp8_kv(key, k_scale), quantize_fp8_kv(value, v_scale)
    block_size = key_cache.shape[1]
    for t, slot in enumerate(slot_mapping[: key.shape[0]].tolist()):
        if slot < 0:
            continue
        key_cache[slot // block_size, slot % block_size] = key[t]
        value_cache[slot // block_size, slot % block_size] = value[t]
