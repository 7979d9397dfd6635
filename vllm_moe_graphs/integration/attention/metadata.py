"""Attention metadata and its builder: the *plan* half of plan / run.

Shape legend (as in `vllm_moe_graphs/ops/kv_write.py`): B = rows of the batch (requests; padded
rows in FULL graphs), T = query tokens (padded), W = block-table width = cdiv(max_model_len, BS),
S = split-K chunks, Hq = query heads, D = head size.

`MoeGraphsMetadataBuilder.build()` runs on the host once per step (per KV-cache group), outside
any captured region, and copies every per-step input the kernels read into buffers allocated
once in `__init__` at the largest batch (max_num_seqs rows, W columns). Their addresses never
change, so a CUDA graph captured over one step reads the next step's data after the next
build(). build() fills all of them whichever kernel it picks, because a FULL graph replays the
kernel it captured: vLLM may replay a mixed-batch graph for a decode-only step.

In place: the plugin's model runner hands the builder vLLM's own persistent buffers
(`read_in_place`: V1's query_start_loc, seq_lens and this group's block table, which V1 fills
at fixed addresses every step and which the KV storage's identity covers). A step whose
metadata views exactly those buffers is then planned without the three device-to-device
copies: the kernels read vLLM's buffers, as vLLM's own backends do. Any other step (another
runner, vLLM's own capture) keeps the copies.

Kernel choice (host ints only): `max_query_len == 1` -> paged_decode_attention over B rows, with
`num_splits` a pure function of (B, context bucket, kv heads, SM count); any other batch ->
paged_prefill_attention over all T tokens (it handles q_len 1 and q_len 0 rows too), or, where
vLLM has it and `prefill_attention` is "auto" (the default) or "flash_attn", FlashAttention 3's
varlen kernel, its schedule planned here (`flash_attn.py`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.utils import get_num_attention_heads_from_layers

from vllm_moe_graphs.config import plugin_config
from vllm_moe_graphs.graphs.buckets import attention_context_buckets, context_bucket
from vllm_moe_graphs.integration.attention.flash_attn import FlashAttnPrefill, flash_attn_problem
from vllm_moe_graphs.ops import choose_num_splits, decode_workspace_shape
from vllm_moe_graphs.ops.kv_write import check_block_size, check_head_size

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import AttentionSpec

logger = logging.getLogger("vllm.moe_graphs")

# SM count used when the kernels run under the Triton interpreter on CPU tensors (tests): small,
# so that the split-K path is exercised there too.
INTERPRETER_NUM_SMS = 4


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class MoeGraphsAttentionMetadata:
    """Per-step attention inputs, shared by every layer of one attention group.

    The tensors are views of persistent buffers (fixed addresses): the builder's, or vLLM's own
    when the runner let the builder read them in place.
    """

    num_actual_tokens: int  # T: query rows the prefill kernel may read and write
    num_reqs: int  # B: rows of seq_lens / block_table (padded rows have seq_len 0)
    max_query_len: int  # host upper bound of the query lengths
    max_seq_len: int  # host upper bound of the context lengths
    decode: bool  # max_query_len == 1: paged_decode_attention, else paged_prefill_attention
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, W] int32
    context_bucket: int  # longest context `num_splits` was planned for
    num_splits: int  # S of the decode kernel (1: no split, no workspace)
    workspace: torch.Tensor | None  # [B, Hq, S, D + 2] float32 when num_splits > 1
    # FA3 for a step with prefill tokens (prefill_attention): its schedule (a view of the
    # builder's persistent buffer), split count and max_seqlen_k; None: the plugin's kernel
    fa3_schedule: torch.Tensor | None = None
    fa3_splits: int = 0
    fa3_max_seq_len: int = 0


class MoeGraphsMetadataBuilder(AttentionMetadataBuilder[MoeGraphsAttentionMetadata]):
    """Plans one step: host work plus copies into persistent buffers (or none, in place);
    never syncs.

    ALWAYS: every kernel launch depends only on shapes and host constants, and every tensor it
    reads lives in a persistent buffer (filled here, or by vLLM in place), so decode-only,
    uniform (spec-decode) and mixed prefill/decode batches can all be captured. Both runners key
    FULL graphs on (T, B), the only shapes the launch grids depend on.
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        model_config = vllm_config.model_config
        parallel_config = vllm_config.parallel_config
        _refuse_unsupported_spec(kv_cache_spec, vllm_config)

        self.block_size = kv_cache_spec.block_size  # the kernel block size chosen by vLLM
        self.head_size = kv_cache_spec.head_size
        self.num_heads_kv = kv_cache_spec.num_kv_heads
        self.num_heads_q = get_num_attention_heads_from_layers(
            vllm_config, layer_names
        ) or model_config.get_num_attention_heads(parallel_config)
        self.max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.max_model_len = model_config.max_model_len
        self.max_blocks = _cdiv(self.max_model_len, self.block_size)
        plugin = plugin_config(vllm_config.additional_config)
        self.context_buckets = attention_context_buckets(plugin.context_buckets,
                                                         self.max_model_len)
        self.num_sms = _num_sms(torch.device(device))

        # NOTE: allocations happen here, once, never in build() or forward().
        int32 = dict(dtype=torch.int32, device=device)
        self._query_start_loc = torch.zeros(self.max_num_reqs + 1, **int32)  # [B_max + 1]
        self._seq_lens = torch.zeros(self.max_num_reqs, **int32)  # [B_max]
        self._block_table = torch.zeros(self.max_num_reqs, self.max_blocks, **int32)  # [B_max, W]
        # Split-K workspace, flat: a step of B rows and S splits views its first B*Hq*S*(D+2)
        # floats as [B, Hq, S, D + 2]. S shrinks as B grows, so the largest need is max_b b*S(b)
        # rows, far less than max_num_seqs * max_splits.
        self._workspace = torch.empty(self._workspace_numel(), dtype=torch.float32, device=device)
        # data_ptr()s of the runner buffers build() may read in place (see read_in_place)
        self._in_place: tuple[int, int, int] | None = None
        # the graph key the current step was planned for (plan_for)
        self._planned_context: int | None = None
        self._planned_query_len: int | None = None
        self.flash_attn: FlashAttnPrefill | None = None
        choice = plugin.prefill_attention
        if choice != "triton" and str(vllm_config.cache_config.cache_dtype).startswith("fp8"):
            # FA3 reads an FP8 cache only with FP8 queries and descale tensors: not wired
            logger.info("moe_graphs: kv_cache_dtype %s: steps with prefill tokens use the "
                        "plugin's kernel (prefill_attention %s)",
                        vllm_config.cache_config.cache_dtype, choice)
            choice = "triton"
        if choice != "triton":  # "auto" or "flash_attn"
            if (problem := flash_attn_problem()) is None:
                self.flash_attn = FlashAttnPrefill(
                    vllm_config, self.num_heads_q, self.num_heads_kv, self.head_size,
                    self.block_size, self.max_num_reqs, torch.device(device))
                logger.info("moe_graphs: steps with prefill tokens use FlashAttention 3 "
                            "(prefill_attention %s)", choice)
            else:
                log = logger.warning if choice == "flash_attn" else logger.info
                log("moe_graphs: prefill_attention %s: FlashAttention 3 is not available "
                    "(%s); steps with prefill tokens use the plugin's kernel", choice, problem)

    # ------------------------------------------------------------------------- plan

    def num_splits(self, num_reqs: int, bucket: int) -> int:
        """Split-K factor of a decode step: a pure function of host constants."""
        if num_reqs < 1:
            return 1
        return choose_num_splits(num_reqs, self.num_heads_kv, bucket, self.num_sms)

    def plan_for(self, context_bucket: int | None, max_query_len: int | None = None) -> None:
        """The next builds are for a graph key: a decode key's context bucket (the decode
        kernel's split count), a mixed key's query-length bound (the varlen kernel's tile).
        None: no key, the builder plans from the step itself. A graph replays the launch it was
        captured with, so a key's steps must plan exactly that one: the plugin's step plan hands
        its key over before vLLM builds the step's metadata."""
        self._planned_context = context_bucket
        self._planned_query_len = max_query_len

    def read_in_place(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      block_table: torch.Tensor) -> None:
        """Let build() read these runner buffers in place instead of copying them: a step whose
        CommonAttentionMetadata views exactly them (same start addresses) gets metadata that
        views them too. The caller vouches that they stay at these addresses, are filled before
        every forward (padded rows: seq_len 0) and are part of the KV storage's identity, so a
        captured graph never reads a freed buffer."""
        for name, t, dims in (("query_start_loc", query_start_loc, 1), ("seq_lens", seq_lens, 1),
                              ("block_table", block_table, 2)):
            if t.dtype != torch.int32 or t.dim() != dims or t.stride(-1) != 1:
                raise ValueError(
                    f"{name} must be a {dims}-D int32 tensor with a unit last stride (vLLM's "
                    f"persistent buffer), got {t.dtype} shape {tuple(t.shape)} strides "
                    f"{t.stride()}")
            if t.device != self._seq_lens.device:
                raise ValueError(f"{name} is on {t.device}, the builder on "
                                 f"{self._seq_lens.device}")
        self._in_place = (query_start_loc.data_ptr(), seq_lens.data_ptr(),
                          block_table.data_ptr())

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> MoeGraphsAttentionMetadata:
        cm = common_attn_metadata
        if common_prefix_len:
            raise NotImplementedError(
                f"cascade attention (common_prefix_len={common_prefix_len}) is not supported by "
                "the vllm_moe_graphs attention backend (CUSTOM)"
            )
        if cm.causal is not True:
            raise NotImplementedError(
                "non-causal attention is not supported by the vllm_moe_graphs attention backend "
                "(CUSTOM)"
            )
        num_reqs, num_tokens = cm.num_reqs, cm.num_actual_tokens
        if num_reqs > self.max_num_reqs:
            raise ValueError(
                f"batch of {num_reqs} requests exceeds max_num_seqs={self.max_num_reqs}, the "
                "size the attention metadata buffers were allocated for"
            )
        # NOTE: graph safety. Views of buffers at fixed addresses only: vLLM's own (in place,
        # host pointer compares) or ours, filled by device-to-device copies enqueued on the
        # current stream before the forward. No host read of device data, no allocation. The
        # host ints (num_reqs, max_query_len, max_seq_len) come from the scheduler.
        if self._in_place is not None and self._in_place == (
                cm.query_start_loc.data_ptr(), cm.seq_lens.data_ptr(),
                cm.block_table_tensor.data_ptr()):
            query_start_loc = cm.query_start_loc[: num_reqs + 1]
            seq_lens = cm.seq_lens[:num_reqs]
            block_table = cm.block_table_tensor[:num_reqs]
        else:
            query_start_loc = self._query_start_loc[: num_reqs + 1]
            query_start_loc.copy_(cm.query_start_loc[: num_reqs + 1], non_blocking=True)
            seq_lens = self._seq_lens[:num_reqs]
            seq_lens.copy_(cm.seq_lens[:num_reqs], non_blocking=True)
            block_table = self._block_table[:num_reqs]
            # Columns past cdiv(max_seq_len, BS) are never read for this step (max_seq_len
            # bounds every seq_len), so only the leading ones are copied.
            cols = min(_cdiv(cm.max_seq_len, self.block_size), self.max_blocks,
                       cm.block_table_tensor.shape[1])
            if num_reqs > 0 and cols > 0:
                block_table[:, :cols].copy_(cm.block_table_tensor[:num_reqs, :cols],
                                            non_blocking=True)

        decode = cm.max_query_len == 1
        # NOTE: any split count is correct for any context (the kernel cuts each sequence's
        # chunks from its seq_len); the bucket only decides how many programs share the work.
        bucket = self._planned_context
        if bucket is None:
            bucket = context_bucket(self.context_buckets, cm.max_seq_len)
        num_splits = self.num_splits(num_reqs, bucket) if decode else 1
        max_query_len = self._planned_query_len or cm.max_query_len
        fa3: dict[str, object] = {}
        if self.flash_attn is not None and not decode:
            # a graph key's launch bounds every step of the key: its token bucket, max_model_len
            max_seq_len = self.max_model_len if self._planned_query_len else cm.max_seq_len
            schedule, splits = self.flash_attn.plan(num_reqs, num_tokens, query_start_loc,
                                                    seq_lens, max_query_len, max_seq_len)
            fa3 = dict(fa3_schedule=schedule, fa3_splits=splits, fa3_max_seq_len=max_seq_len)
        return MoeGraphsAttentionMetadata(
            num_actual_tokens=num_tokens,
            num_reqs=num_reqs,
            max_query_len=max_query_len,
            max_seq_len=cm.max_seq_len,
            decode=decode,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=block_table,
            context_bucket=bucket,
            num_splits=num_splits,
            workspace=self._workspace_view(num_reqs, num_splits) if num_splits > 1 else None,
            **fa3,
        )

    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> MoeGraphsAttentionMetadata:
        metadata = self.build(0, common_attn_metadata)
        # Capture over the smallest valid context, seq_len = q_len (no cached prefix; 0 for
        # padded rows), like TRITON_ATTN's seq_lens.fill_(1): what is captured depends only on
        # shapes and host constants, and every replayed step copies its own lengths in build().
        qsl = metadata.query_start_loc
        torch.sub(qsl[1:], qsl[:-1], out=metadata.seq_lens)
        return metadata

    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers a captured graph reads (their identity is part of the KV storage's)."""
        buffers = {"query_start_loc": self._query_start_loc, "seq_lens": self._seq_lens,
                   "block_table": self._block_table, "workspace": self._workspace}
        if self.flash_attn is not None:
            buffers["fa3_schedule"] = self.flash_attn.scheduler_buffer
        return buffers

    # ------------------------------------------------------------------------- helpers

    def _workspace_numel(self) -> int:
        # The largest context gives the largest split count for every batch size.
        need = 0
        for batch in range(1, self.max_num_reqs + 1):
            splits = self.num_splits(batch, self.max_model_len)
            if splits > 1:
                shape = decode_workspace_shape(batch, self.num_heads_q, self.head_size, splits)
                need = max(need, shape[0] * shape[1] * shape[2] * shape[3])
        return need

    def _workspace_view(self, num_reqs: int, num_splits: int) -> torch.Tensor:
        shape = decode_workspace_shape(num_reqs, self.num_heads_q, self.head_size, num_splits)
        numel = shape[0] * shape[1] * shape[2] * shape[3]
        assert numel <= self._workspace.numel(), (
            f"split-K workspace too small: need {shape}, have {self._workspace.numel()} floats"
        )
        return self._workspace[:numel].view(shape)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_NUM_SMS


def _refuse_unsupported_spec(kv_cache_spec: AttentionSpec, vllm_config: VllmConfig) -> None:
    """NotImplementedError naming the setting, for what the KV-cache spec and config reveal."""
    check_block_size(kv_cache_spec.block_size)
    check_head_size(kv_cache_spec.head_size)
    head_size_v = getattr(kv_cache_spec, "head_size_v", kv_cache_spec.head_size)
    if head_size_v != kv_cache_spec.head_size:
        raise NotImplementedError(
            f"value head size {head_size_v} != key head size {kv_cache_spec.head_size} is not "
            "supported by the vllm_moe_graphs attention backend (CUSTOM)"
        )
    for name in ("sliding_window", "attention_chunk_size"):
        if getattr(kv_cache_spec, name, None) is not None:
            raise NotImplementedError(
                f"{name.replace('_', ' ')} ({name}={getattr(kv_cache_spec, name)}) is not "
                "supported by the vllm_moe_graphs attention backend (CUSTOM)"
            )
    if getattr(kv_cache_spec, "non_causal", False):
        raise NotImplementedError(
            "non-causal attention is not supported by the vllm_moe_graphs attention backend "
            "(CUSTOM)"
        )
    if getattr(vllm_config.model_config, "rswa_window", None) is not None:
        raise NotImplementedError(
            "reference sliding-window attention (rswa_window) is not supported by the "
            "vllm_moe_graphs attention backend (CUSTOM)"
        )
    parallel = vllm_config.parallel_config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(parallel, name, 1)
        if size > 1:
            raise NotImplementedError(
                f"{name}={size} (context parallelism) is not supported by the vllm_moe_graphs "
                "attention backend (CUSTOM)"
            )
