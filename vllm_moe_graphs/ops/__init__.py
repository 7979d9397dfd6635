"""The plugin's Triton kernels: attention over vLLM 0.26's paged KV cache (paged decode with GQA
and split-K, KV write, varlen/chunked prefill; caches of the model's dtype or FP8 e4m3 with
per-tensor scales, `kv_quant`), the small-M GEMM of decode-time linear layers, the MoE routing
that sends padding rows to a sentinel expert (`moe_router`), and token sampling with vLLM's
semantics that a CUDA graph can capture (`sampling`, plain torch; the batches it serves:
`sampling_plan`). `reference` holds pure-torch references for tests and benchmarks; import it
explicitly.

Importing this package imports triton (not vLLM). Under `TRITON_INTERPRET=1` the kernels run
on CPU tensors; that variable must be set before this package is first imported.
"""

from __future__ import annotations

from vllm_moe_graphs.ops.kv_quant import (
    FP8_KV_DTYPE,
    SUPPORTED_DTYPES,
    SUPPORTED_KV_CACHE_DTYPES,
)
from vllm_moe_graphs.ops.kv_write import (
    SUPPORTED_BLOCK_SIZES,
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
from vllm_moe_graphs.ops.sampling import K_CAP, SampledTokens, SamplingTensors, sample
from vllm_moe_graphs.ops.sampling_plan import SamplingRefusal, Servability, servable
from vllm_moe_graphs.ops.small_m_gemm import small_m_linear
from vllm_moe_graphs.ops.small_m_plan import (
    SmallMGemmConfig,
    choose_small_m_config,
    small_m_workspace_numel,
)

__all__ = [
    "FP8_KV_DTYPE",
    "K_CAP",
    "SUPPORTED_BLOCK_SIZES",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_SIZES",
    "SUPPORTED_KV_CACHE_DTYPES",
    "DecodeKernelConfig",
    "PrefillKernelConfig",
    "SampledTokens",
    "SamplingRefusal",
    "SamplingTensors",
    "Servability",
    "SmallMGemmConfig",
    "allocate_decode_workspace",
    "choose_num_splits",
    "choose_small_m_config",
    "decode_workspace_shape",
    "paged_decode_attention",
    "paged_prefill_attention",
    "sample",
    "servable",
    "small_m_linear",
    "small_m_workspace_numel",
    "split_kv_cache",
    "topk_softmax",
    "write_kv",
]
