"""The plugin's Triton kernels: attention over vLLM 0.26's paged KV cache (paged decode with GQA
and split-K, KV write, varlen/chunked prefill), the small-M GEMM of decode-time linear layers
and the MoE routing that sends padding rows to a sentinel expert (`moe_router`). `reference`
holds pure-torch references for tests and benchmarks; import it explicitly.

Importing this package imports triton (not vLLM). Under `TRITON_INTERPRET=1` the kernels run
on CPU tensors; that variable must be set before this package is first imported.
"""

from __future__ import annotations

from vllm_moe_graphs.ops.kv_write import (
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_SIZES,
    split_kv_cache,
    write_kv,
)
from vllm_moe_graphs.ops.decode_plan import (
    DecodeKernelConfig,
    allocate_decode_workspace,
    choose_num_splits,
    decode_workspace_shape,
)
from vllm_moe_graphs.ops.moe_router import topk_softmax
from vllm_moe_graphs.ops.paged_decode import paged_decode_attention
from vllm_moe_graphs.ops.prefill import PrefillKernelConfig, paged_prefill_attention
from vllm_moe_graphs.ops.small_m_gemm import small_m_linear
from vllm_moe_graphs.ops.small_m_plan import (
    SmallMGemmConfig,
    choose_small_m_config,
    small_m_workspace_numel,
)

__all__ = [
    "SUPPORTED_BLOCK_SIZES",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_SIZES",
    "DecodeKernelConfig",
    "PrefillKernelConfig",
    "SmallMGemmConfig",
    "allocate_decode_workspace",
    "choose_num_splits",
    "choose_small_m_config",
    "decode_workspace_shape",
    "paged_decode_attention",
    "paged_prefill_attention",
    "small_m_linear",
    "small_m_workspace_numel",
    "split_kv_cache",
    "topk_softmax",
    "write_kv",
]
