"""FlashAttention 3 for the attention of steps with prefill tokens (`prefill_attention`
"auto", the default, or "flash_attn"), through vLLM 0.26's own build (`vllm.vllm_flash_attn`).

Called as vLLM's `FlashAttentionImpl.forward` calls it under full CUDA graphs: the varlen
kernel over the paged cache (`block_table`, `seqused_k`), with scheduler metadata computed ahead
of time by `get_scheduler_metadata` in the metadata build (outside any captured region) and
copied into one persistent buffer the kernel reads, so a graph replays the launch it captured
with the next step's schedule. Every launch constant is a function of the step's plan: for a
graph key, `max_seqlen_q` is its token bucket and `max_seqlen_k` the engine's max_model_len
(bounds of every step of the key), and the split count is fixed by the token count (vLLM's
`flash_attn_max_num_splits_for_cuda_graph` up to `SPLIT_TOKENS` tokens, else 1: the split
buffers grow with tokens x splits, and a long step has parallelism enough).

The KV cache views are the plugin's (`ops.split_kv_cache`: [NB, BS, Hkv, D] views of vLLM's
TRITON_ATTN layout, unit stride on D), the layout FA3 reads through `block_table`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from vllm.config import VllmConfig

SPLIT_TOKENS = 512  # vLLM's default max_cudagraph_capture_size: splits only up to here


def flash_attn_problem() -> str | None:
    """Why vLLM's FlashAttention 3 cannot run here, or None."""
    try:
        from vllm.v1.attention.backends.fa_utils import is_flash_attn_varlen_func_available
        from vllm.vllm_flash_attn.flash_attn_interface import fa_version_unsupported_reason

        if not is_flash_attn_varlen_func_available():
            return "vLLM's flash_attn_varlen_func is not available"
        return fa_version_unsupported_reason(3)
    except Exception as exc:  # noqa: BLE001 - any import failure means no FA3 here
        return f"{type(exc).__name__}: {exc}"


class FlashAttnPrefill:
    """The FA3 schedule of one metadata builder's steps, and the kernel call."""

    def __init__(self, vllm_config: VllmConfig, num_heads_q: int, num_heads_kv: int,
                 head_size: int, block_size: int, max_num_reqs: int,
                 device: torch.device) -> None:
        self.num_heads_q, self.num_heads_kv = num_heads_q, num_heads_kv
        self.head_size, self.block_size = head_size, block_size
        self.dtype = vllm_config.model_config.dtype
        self.max_splits = vllm_config.attention_config.flash_attn_max_num_splits_for_cuda_graph
        # FA3's scheduler metadata: 1 + round_up(batch, 4) * 4 int32 (vLLM's FlashAttention
        # builder allocates the same); allocated once, filled by plan()
        self._scheduler = torch.zeros(1 + -(-max_num_reqs // 4) * 16, dtype=torch.int32,
                                      device=device)

    @property
    def scheduler_buffer(self) -> torch.Tensor:
        return self._scheduler

    def splits(self, num_tokens: int) -> int:
        return self.max_splits if num_tokens <= SPLIT_TOKENS else 1

    def plan(self, num_reqs: int, num_tokens: int, query_start_loc: torch.Tensor,
             seq_lens: torch.Tensor, max_query_len: int, max_seq_len: int
             ) -> tuple[torch.Tensor, int]:
        """Schedule one step (its query_start_loc and seq_lens already in their persistent
        buffers); returns the view of the persistent schedule and the split count."""
        from vllm.v1.attention.backends.fa_utils import get_scheduler_metadata

        splits = self.splits(num_tokens)
        schedule = get_scheduler_metadata(
            batch_size=num_reqs, max_seqlen_q=max_query_len, max_seqlen_k=max_seq_len,
            num_heads_q=self.num_heads_q, num_heads_kv=self.num_heads_kv,
            headdim=self.head_size, cache_seqlens=seq_lens, qkv_dtype=self.dtype,
            cu_seqlens_q=query_start_loc, page_size=self.block_size, causal=True,
            window_size=(-1, -1), num_splits=splits)
        n = schedule.shape[0]
        self._scheduler[:n].copy_(schedule, non_blocking=True)
        # the rest zeroed, as vLLM does: a stale entry could send a program to write output
        self._scheduler[n:].zero_()
        return self._scheduler[:n], splits


def flash_attn_prefill(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, md: Any, scale: float) -> None:
    """FA3's varlen paged attention of one step planned by `FlashAttnPrefill.plan` (`md`:
    the step's `MoeGraphsAttentionMetadata`)."""
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func

    flash_attn_varlen_func(
        q=query, k=key_cache, v=value_cache, out=out, cu_seqlens_q=md.query_start_loc,
        max_seqlen_q=md.max_query_len, seqused_k=md.seq_lens, max_seqlen_k=md.fa3_max_seq_len,
        softmax_scale=scale, causal=True, alibi_slopes=None, window_size=[-1, -1],
        block_table=md.block_table, softcap=0, scheduler_metadata=md.fa3_schedule,
        fa_version=3, q_descale=None, k_descale=None, v_descale=None,
        num_splits=md.fa3_splits)
