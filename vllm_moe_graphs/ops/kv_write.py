"""Paged KV cache layout contract and the KV write kernel.

Shape legend used across `vllm_moe_graphs.ops`:
    B   = sequences (decode rows), T = tokens, D = head size
    Hq  = query heads, Hkv = kv heads, G = Hq // Hkv (query heads per kv head)
    NB  = cache blocks (pages), BS = tokens per block, S = split-K chunks

Every kernel in this package reads and writes the cache through two 4-d views
`key_cache`/`value_cache` of shape [NB, BS, Hkv, D] with explicit strides; only the stride of D
must be 1. `split_kv_cache` builds those views from the per-layer tensors that exist:

- vLLM 0.26 TRITON_ATTN: logical [NB, Hkv, BS, 2 * D] (K and V packed on the last dim),
  physically [NB, BS, Hkv, 2 * D] for the default "NHD" layout; the backend takes
  `kv_cache.transpose(1, 2).split(D, dim=-1)`, which is what we do too. Page padding
  (`page_size_padded`) only changes the block stride, which we read from the view.
- [NB, 2, BS, Hkv, D] (the flash-attn style layout): `kv_cache[:, 0]`, `kv_cache[:, 1]`.

A cache holds the model's dtype (bf16 / fp16 / fp32; the write moves bits) or FP8 e4m3 with
per-tensor scales (`kv_quant.py`: the write quantizes, the attention kernels dequantize).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_moe_graphs.capability import SUPPORTED_HEAD_SIZES  # one definition, no torch there
from vllm_moe_graphs.ops.kv_quant import (
    check_dtype,
    check_kv_cache_dtype,
    check_kv_scales,
    dequantize_kv,
    quantize_e4m3,
)

SUPPORTED_BLOCK_SIZES: tuple[int, ...] = (16, 32, 64)

# Same-width integer dtypes: the write kernel moves bits, never values.
_BITS_DTYPE: dict[torch.dtype, torch.dtype] = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
}

WRITE_KV_NUM_WARPS = 4


# ----------------------------------------------------------------------------- layout checks


def check_head_size(head_size: int) -> None:
    if head_size not in SUPPORTED_HEAD_SIZES:
        raise NotImplementedError(
            f"head size {head_size} is not supported by the vllm_moe_graphs attention kernels "
            f"(supported: {SUPPORTED_HEAD_SIZES})"
        )


def check_block_size(block_size: int) -> None:
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise NotImplementedError(
            f"block size {block_size} is not supported by the vllm_moe_graphs attention kernels "
            f"(supported: {SUPPORTED_BLOCK_SIZES})"
        )


def check_kv_caches(
    key_cache: torch.Tensor, value_cache: torch.Tensor, head_size: int
) -> tuple[int, int]:
    """Validate a pair of paged cache views; returns (block_size, num_kv_heads)."""
    if key_cache.dim() != 4 or value_cache.dim() != 4:
        raise ValueError(
            "key_cache/value_cache must be 4-d [num_blocks, block_size, num_kv_heads, head_size] "
            f"views, got shapes {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key_cache and value_cache shapes differ: {tuple(key_cache.shape)} vs "
            f"{tuple(value_cache.shape)}"
        )
    if key_cache.dtype != value_cache.dtype:
        raise ValueError(
            f"key_cache and value_cache dtypes differ: {key_cache.dtype} vs {value_cache.dtype}"
        )
    check_kv_cache_dtype(key_cache.dtype)
    check_head_size(key_cache.shape[3])
    if key_cache.shape[3] != head_size:
        raise ValueError(
            f"cache head size {key_cache.shape[3]} does not match the head size {head_size}"
        )
    if key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError(
            "key_cache/value_cache need a unit stride on the head dimension, got strides "
            f"{key_cache.stride()} and {value_cache.stride()}"
        )
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    check_block_size(block_size)
    return block_size, num_kv_heads


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def check_index_tensor(name: str, t: torch.Tensor, dtype: torch.dtype, min_rows: int) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() < 1 or t.shape[0] < min_rows:
        raise ValueError(f"{name} needs at least {min_rows} rows, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} needs a unit stride on its last dimension, got {t.stride()}")


def check_token_tensor(name: str, t: torch.Tensor, num_heads: int, head_size: int) -> None:
    if t.dim() != 3 or t.shape[1] != num_heads or t.shape[2] != head_size:
        raise ValueError(
            f"{name} must be [tokens, {num_heads}, {head_size}], got {tuple(t.shape)}"
        )
    if t.stride(2) != 1:
        raise ValueError(f"{name} needs a unit stride on the head dimension, got {t.stride()}")


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def kv_cache_strides(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, ...]:
    """The (block, slot, head) strides of the K cache, then of the V cache: what every paged
    kernel takes to address [NB, BS, Hkv, D] views (D has unit stride)."""
    return (*key_cache.stride()[:3], *value_cache.stride()[:3])


def check_attention_io(query: torch.Tensor, out: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, scale: object, rows: str,
                       k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                       ) -> tuple[int, int, int, int, int, bool]:
    """The checks every paged attention launcher makes of its query [R, Hq, D], out (same
    shape and dtype), caches (the query's dtype, or FP8 with k_scale / v_scale tensors) and
    scale (a Python float: a tensor would force a host sync); `rows` names R in messages.
    Returns (R, Hq, D, block size, Hkv, whether the cache is FP8)."""
    if isinstance(scale, torch.Tensor):
        raise ValueError("scale must be a Python float: a tensor would force a host sync")
    head_size = query.shape[-1]
    check_head_size(head_size)
    check_dtype(query.dtype)
    block_size, num_kv_heads = check_kv_caches(key_cache, value_cache, head_size)
    if query.dim() != 3:
        raise ValueError(
            f"query must be [{rows}, num_q_heads, head_size], got {tuple(query.shape)}")
    num_rows, num_q_heads = query.shape[0], query.shape[1]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}"
        )
    check_token_tensor("query", query, num_q_heads, head_size)
    check_token_tensor("out", out, num_q_heads, head_size)
    if out.shape[0] != num_rows:
        raise ValueError(f"out has {out.shape[0]} rows, query has {num_rows}")
    kv_fp8 = check_kv_scales(key_cache.dtype, k_scale, v_scale, key_cache.device)
    if (not kv_fp8 and query.dtype != key_cache.dtype) or out.dtype != query.dtype:
        raise ValueError(
            f"query, out and cache dtypes must match (or the cache be FP8), got {query.dtype}, "
            f"{out.dtype}, {key_cache.dtype}"
        )
    return num_rows, num_q_heads, head_size, block_size, num_kv_heads, kv_fp8


@triton.jit
def load_kv_tile(bt_row, k_base, v_base, start, end, offs_n, offs_d, stride_k_block,
                 stride_k_slot, stride_v_block, stride_v_slot, k_scale, v_scale,
                 BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr, DTYPE: tl.constexpr):
    """Inside a paged kernel: K and V [BLOCK_N, D] of KV positions `start + offs_n` of one
    sequence (block-table row `bt_row`, head bases `k_base` / `v_base`), gathered over
    BLOCK_N // BLOCK_SIZE pages; positions >= `end` read nothing and load 0. An FP8 cache
    (KV_FP8) is dequantized to DTYPE with the fp32 scalars k_scale / v_scale; otherwise the
    scales are unused and the tiles keep the cache's dtype. Returns (k, v, positions, mask)."""
    pos = start + offs_n  # [BLOCK_N]
    mask = pos < end
    page = tl.load(bt_row + pos // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)
    in_page = (pos % BLOCK_SIZE).to(tl.int64)
    k = tl.load(
        k_base + (page * stride_k_block + in_page * stride_k_slot)[:, None] + offs_d[None, :],
        mask=mask[:, None],
        other=0.0,
    )
    v = tl.load(
        v_base + (page * stride_v_block + in_page * stride_v_slot)[:, None] + offs_d[None, :],
        mask=mask[:, None],
        other=0.0,
    )
    if KV_FP8:
        k = dequantize_kv(k, k_scale, DTYPE)
        v = dequantize_kv(v, v_scale, DTYPE)
    return k, v, pos, mask


def split_kv_cache(
    kv_cache: torch.Tensor, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-layer cache tensor -> (key_cache, value_cache), each a [NB, BS, Hkv, D] view.

    Accepts vLLM 0.26 TRITON_ATTN's logical [NB, Hkv, BS, 2 * D] tensor (any stride order) and
    the [NB, 2, BS, Hkv, D] layout. No copy is made.
    """
    if kv_cache.dim() == 5 and kv_cache.shape[1] == 2 and kv_cache.shape[4] == head_size:
        return kv_cache[:, 0], kv_cache[:, 1]
    if kv_cache.dim() == 4 and kv_cache.shape[3] == 2 * head_size:
        key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
        return key_cache, value_cache
    raise ValueError(
        f"unrecognised KV cache shape {tuple(kv_cache.shape)} for head size {head_size}: "
        "expected [num_blocks, num_kv_heads, block_size, 2 * head_size] (vLLM 0.26 TRITON_ATTN) "
        "or [num_blocks, 2, block_size, num_kv_heads, head_size]"
    )


# ----------------------------------------------------------------------------- kernel


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [T, Hkv, D] new keys: an integer view, or the keys themselves when KV_FP8
    value_ptr,  # [T, Hkv, D] new values, the same
    key_cache_ptr,  # [NB, BS, Hkv, D] strided: an integer view, or float8e4nv when KV_FP8
    value_cache_ptr,  # [NB, BS, Hkv, D] strided, the same
    slot_mapping_ptr,  # [T] int64, slot = block * BS + offset, -1 = padding
    k_scale_ptr,  # [1] float32 when KV_FP8, else None
    v_scale_ptr,  # [1] float32 when KV_FP8, else None
    stride_key_t: tl.int64,
    stride_key_h: tl.int64,
    stride_value_t: tl.int64,
    stride_value_h: tl.int64,
    stride_kc_block: tl.int64,
    stride_kc_slot: tl.int64,
    stride_kc_head: tl.int64,
    stride_vc_block: tl.int64,
    stride_vc_slot: tl.int64,
    stride_vc_head: tl.int64,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # next power of 2 of NUM_KV_HEADS
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,  # quantize to the FP8 cache; else move bits
):
    # One program copies all heads of one token: a [HEADS_PAD, D] tile for K and one for V.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # padded token: nothing is written
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_SIZE)
    mask = (offs_h < NUM_KV_HEADS)[:, None]

    src_k = key_ptr + token * stride_key_t + offs_h[:, None] * stride_key_h + offs_d[None, :]
    src_v = value_ptr + token * stride_value_t + offs_h[:, None] * stride_value_h + offs_d[None, :]
    dst_k = (
        key_cache_ptr
        + block * stride_kc_block
        + offset * stride_kc_slot
        + offs_h[:, None] * stride_kc_head
        + offs_d[None, :]
    )
    dst_v = (
        value_cache_ptr
        + block * stride_vc_block
        + offset * stride_vc_slot
        + offs_h[:, None] * stride_vc_head
        + offs_d[None, :]
    )
    # NOTE: the scales are read here, at run time: a captured graph follows their values.
    k = tl.load(src_k, mask=mask)
    if KV_FP8:
        k = quantize_e4m3(k.to(tl.float32), tl.load(k_scale_ptr))
    tl.store(dst_k, k, mask=mask)
    v = tl.load(src_v, mask=mask)
    if KV_FP8:
        v = quantize_e4m3(v.to(tl.float32), tl.load(v_scale_ptr))
    tl.store(dst_v, v, mask=mask)


# ----------------------------------------------------------------------------- launcher


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter new K/V rows into the paged cache: byte for byte, or quantized to FP8.

    key, value: [T, Hkv, D] (any token/head strides, unit stride on D); key_cache, value_cache:
    [NB, BS, Hkv, D] strided views; slot_mapping: [T] int64 with slot = block * BS + offset and
    -1 for padded tokens, which are skipped (their cache bytes stay untouched). A cache of the
    rows' dtype gets their raw bits (other dtype pairs raise ValueError); an FP8 e4m3 cache gets
    e4m3(x / scale) as vLLM writes it, with k_scale / v_scale float32 tensors of one element
    read on the device (required then; not read for other caches).
    Graph safe: no allocation, no host sync; the grid is (T,).
    """
    # NOTE: padding is skipped inside the kernel (slot -1); never filter slot_mapping on the
    # host, that would be a sync and a data-dependent grid.
    head_size = key.shape[-1]
    check_head_size(head_size)
    block_size, num_kv_heads = check_kv_caches(key_cache, value_cache, head_size)
    kv_fp8 = check_kv_scales(key_cache.dtype, k_scale, v_scale, key_cache.device)
    if kv_fp8:
        check_dtype(key.dtype)
        check_dtype(value.dtype)
    elif key.dtype != key_cache.dtype or value.dtype != value_cache.dtype:
        raise ValueError(
            f"write_kv copies bytes and does not convert: key/value are {key.dtype}/{value.dtype} "
            f"but the cache is {key_cache.dtype}"
        )
    check_token_tensor("key", key, num_kv_heads, head_size)
    check_token_tensor("value", value, num_kv_heads, head_size)
    num_tokens = key.shape[0]
    if value.shape[0] != num_tokens:
        raise ValueError(f"key has {num_tokens} tokens but value has {value.shape[0]}")
    check_index_tensor("slot_mapping", slot_mapping, torch.int64, num_tokens)
    check_same_device(
        key=key, value=value, key_cache=key_cache, value_cache=value_cache,
        slot_mapping=slot_mapping,
    )
    if num_tokens == 0:
        return

    if kv_fp8:  # values are converted: the kernel sees the real dtypes
        key_bits, value_bits, kc_bits, vc_bits = key, value, key_cache, value_cache
    else:
        bits = _BITS_DTYPE[key.dtype]
        key_bits, value_bits = key.view(bits), value.view(bits)
        kc_bits, vc_bits = key_cache.view(bits), value_cache.view(bits)
    _write_kv_kernel[(num_tokens,)](
        key_bits,
        value_bits,
        kc_bits,
        vc_bits,
        slot_mapping,
        k_scale if kv_fp8 else None,  # None: a constexpr, the bits-moving kernel is unchanged
        v_scale if kv_fp8 else None,
        key_bits.stride(0),
        key_bits.stride(1),
        value_bits.stride(0),
        value_bits.stride(1),
        *kv_cache_strides(kc_bits, vc_bits),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=next_power_of_2(num_kv_heads),
        HEAD_SIZE=head_size,
        BLOCK_SIZE=block_size,
        KV_FP8=kv_fp8,
        num_warps=WRITE_KV_NUM_WARPS,
    )
