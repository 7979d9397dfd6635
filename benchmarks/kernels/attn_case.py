"""One decode attention case of `benchmarks.kernels.attn` and the kernels it times on it: the
model shapes (`MODELS`), the caches, block table and buffers of one (model, batch, context)
(`Case`), vLLM 0.26's TRITON_ATTN (`VllmTritonAttn`) and FA3 (`VllmFlashAttn`) called the way
their backends call them, and the plugin's kernel (`Ours`). Each kernel is called as
`kernel(copy, out)`: `copy` picks the cache copy (L2 rotation). The prefill benchmark shares
`MODELS` and `flash_attn_problem`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from benchmarks.kernels.timing import DEVICE


@dataclass(frozen=True, slots=True)
class AttnShape:
    num_q_heads: int
    num_kv_heads: int
    head_size: int


MODELS: dict[str, AttnShape] = {
    "qwen3-0.6b": AttnShape(16, 8, 128),
    "qwen3-30b-a3b": AttnShape(32, 4, 128),
}
# vLLM's default CUDA graph capture sizes (config/vllm.py); TRITON_ATTN snaps its 3D threshold
# to the closest one.
VLLM_CAPTURE_SIZES = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))


class Case:
    """Caches, block table and buffers for one (model, batch, context)."""

    def __init__(self, torch, shape: AttnShape, batch: int, context: int, block_size: int,
                 dtype, copies: int, seed: int):
        from vllm_moe_graphs.ops import split_kv_cache

        self.shape, self.batch, self.context = shape, batch, context
        pages_per_seq = math.ceil(context / block_size)
        num_blocks = batch * pages_per_seq + 1
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.kv_caches = []
        self.views = []
        for _ in range(copies):
            raw = torch.randn(num_blocks, block_size, shape.num_kv_heads, 2 * shape.head_size,
                              generator=gen, device=DEVICE, dtype=dtype)
            kv_cache = raw.permute(0, 2, 1, 3)  # logical [NB, Hkv, BS, 2D], physically NHD
            self.kv_caches.append(kv_cache)
            self.views.append(split_kv_cache(kv_cache, shape.head_size))
            del raw
        perm = torch.randperm(num_blocks - 1, generator=gen, device=DEVICE) + 1
        self.block_table = perm[: batch * pages_per_seq].view(batch, pages_per_seq).int()
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
        self.query = torch.randn(batch, shape.num_q_heads, shape.head_size, generator=gen,
                                 device=DEVICE).to(dtype)
        self.out_ours = torch.empty_like(self.query)
        self.out_vllm = torch.empty_like(self.query)
        self.scale = 1.0 / math.sqrt(shape.head_size)
        self.cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
        self.elem = self.query.element_size()

    def kv_bytes(self) -> int:
        s = self.shape
        return self.batch * self.context * s.num_kv_heads * s.head_size * 2 * self.elem

    def io_bytes(self) -> int:
        return self.kv_bytes() + 2 * self.query.numel() * self.elem


class VllmTritonAttn:
    """vLLM 0.26 `unified_attention` called the way TritonAttentionImpl.forward calls it."""

    def __init__(self, torch, case: Case):
        from vllm.v1.attention.backends import triton_attn
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention
        from vllm.v1.kv_cache_interface import KVQuantMode

        self.fn = unified_attention
        self.kv_quant_mode = KVQuantMode.NONE
        shape = case.shape
        threshold = triton_attn.MIN_LAUNCH_GRID_SIZE_2D // shape.num_kv_heads
        self.seq_threshold_3D = min(VLLM_CAPTURE_SIZES, key=lambda x: abs(x - threshold))
        self.segments = triton_attn.NUM_PAR_SOFTMAX_SEGMENTS
        pad = 1 << (shape.head_size - 1).bit_length()
        f32 = dict(dtype=torch.float32, device=DEVICE)
        self.segm_output = torch.empty(
            (self.seq_threshold_3D, shape.num_q_heads, self.segments, pad), **f32)
        self.segm_max = torch.empty((self.seq_threshold_3D, shape.num_q_heads, self.segments),
                                    **f32)
        self.segm_expsum = torch.empty_like(self.segm_max)
        unit = torch.tensor(1.0, **f32)  # layer._k_scale / layer._v_scale
        self.k_descale = unit.expand((case.batch, shape.num_kv_heads))
        self.v_descale = unit.expand((case.batch, shape.num_kv_heads))
        self.case = case

    def __call__(self, copy: int, out) -> None:
        c = self.case
        key_cache, value_cache = c.views[copy]
        self.fn(
            q=c.query, k=key_cache, v=value_cache, out=out,
            cu_seqlens_q=c.cu_seqlens_q, max_seqlen_q=1, seqused_k=c.seq_lens,
            max_seqlen_k=c.context, softmax_scale=c.scale, causal=True, window_size=(-1, -1),
            block_table=c.block_table, softcap=0, q_descale=None, k_descale=self.k_descale,
            v_descale=self.v_descale, seq_threshold_3D=self.seq_threshold_3D,
            num_par_softmax_segments=self.segments, softmax_segm_output=self.segm_output,
            softmax_segm_max=self.segm_max, softmax_segm_expsum=self.segm_expsum,
            alibi_slopes=None, sinks=None, output_scale=None, mm_prefix_range=None,
            rswa_prefix_lens=None, rswa_window=None, kv_quant_mode=self.kv_quant_mode,
            k_scale_cache=None, v_scale_cache=None, chunk_lookback=-1, use_td=False,
            mm_prefix_clamp_sliding_window=False,
        )


class VllmFlashAttn:
    """vLLM 0.26 FA3 `flash_attn_varlen_func` called the way FlashAttentionImpl.forward calls it
    for a decode batch under full CUDA graphs."""

    def __init__(self, torch, case: Case, block_size: int, dtype):
        from vllm.config.attention import AttentionConfig
        from vllm.v1.attention.backends.fa_utils import (
            flash_attn_varlen_func,
            get_scheduler_metadata,
        )

        shape = case.shape
        self.fn, self.case = flash_attn_varlen_func, case
        self.num_splits = AttentionConfig().flash_attn_max_num_splits_for_cuda_graph
        self.scheduler_metadata = get_scheduler_metadata(
            batch_size=case.batch, max_seqlen_q=1, max_seqlen_k=case.context,
            num_heads_q=shape.num_q_heads, num_heads_kv=shape.num_kv_heads,
            headdim=shape.head_size, cache_seqlens=case.seq_lens, qkv_dtype=dtype,
            cu_seqlens_q=case.cu_seqlens_q, page_size=block_size, causal=True,
            window_size=(-1, -1), num_splits=self.num_splits)
        unit = torch.tensor(1.0, dtype=torch.float32, device=DEVICE)  # layer._k_scale
        self.k_descale = unit.expand((case.batch, shape.num_kv_heads))
        self.v_descale = unit.expand((case.batch, shape.num_kv_heads))

    def __call__(self, copy: int, out) -> None:
        c = self.case
        key_cache, value_cache = c.views[copy]
        self.fn(
            q=c.query, k=key_cache, v=value_cache, out=out, cu_seqlens_q=c.cu_seqlens_q,
            max_seqlen_q=1, seqused_k=c.seq_lens, max_seqlen_k=c.context, softmax_scale=c.scale,
            causal=True, alibi_slopes=None, window_size=[-1, -1], block_table=c.block_table,
            softcap=0, scheduler_metadata=self.scheduler_metadata, fa_version=3,
            q_descale=None, k_descale=self.k_descale, v_descale=self.v_descale,
            num_splits=self.num_splits,
        )


def flash_attn_problem() -> str | None:
    """Why vLLM's FA3 cannot be benchmarked here, or None (the plugin's own check)."""
    from vllm_moe_graphs.integration.attention.flash_attn import flash_attn_problem as problem

    return problem()


class Ours:
    def __init__(self, torch, case: Case, num_splits: int, config, workspace):
        from vllm_moe_graphs.ops import paged_decode_attention

        self.fn, self.case = paged_decode_attention, case
        self.num_splits, self.config, self.workspace = num_splits, config, workspace

    def __call__(self, copy: int, out) -> None:
        c = self.case
        key_cache, value_cache = c.views[copy]
        self.fn(out, c.query, key_cache, value_cache, c.block_table, c.seq_lens, c.scale,
                num_splits=self.num_splits, workspace=self.workspace, config=self.config)


def max_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()
