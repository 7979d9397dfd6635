"""The vllm_moe_graphs attention backend for vLLM 0.26 (`--attention-backend CUSTOM`).

Glue only: kernels live in `vllm_moe_graphs.ops`, planning in `metadata.py`. Shapes: query and
output [T, Hq, D]; key and value [T, Hkv, D]; kv_cache is TRITON_ATTN's logical
[NB, Hkv, BS, 2 * D] tensor in TRITON_ATTN's stride order (K and V packed on the last dim), so
vLLM's block manager, prefix caching and copy-on-write see exactly the layout they expect.

Scope: decoder self-attention of Qwen3 / Qwen3-MoE (causal, GQA; q/k already RMS-normed by the
model), fp16 / bf16 with an unquantized KV cache of the same dtype, head sizes 64 and 128, kernel
block sizes 16, 32 and 64. Everything else is refused at start-up: vLLM's backend selection asks
`validate_configuration` (which reads the class data and hooks below) and raises a ValueError
listing the reasons; what selection cannot see (alibi, soft cap, sinks, extra arguments, DCP) the
impl refuses with NotImplementedError naming the setting.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionImpl, AttentionType
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

from vllm_moe_graphs.capability import FP8_KV_CACHE_DTYPES  # the e4m3 cache, per-tensor scales
from vllm_moe_graphs.integration.attention import BACKEND_NAME
from vllm_moe_graphs.integration.attention.flash_attn import flash_attn_prefill
from vllm_moe_graphs.integration.attention.metadata import (
    MoeGraphsAttentionMetadata,
    MoeGraphsMetadataBuilder,
)
from vllm_moe_graphs.ops import (
    FP8_KV_DTYPE,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_HEAD_SIZES,
    paged_decode_attention,
    paged_prefill_attention,
    split_kv_cache,
    write_kv,
)

if TYPE_CHECKING:
    from vllm.config.cache import CacheDType
    from vllm.platforms.interface import DeviceCapability

SUPPORTED_KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "float16", "bfloat16", *FP8_KV_CACHE_DTYPES)
MIN_COMPUTE_CAPABILITY = 80  # bf16 tensor cores (Ampere); developed and tested on an H200
MIN_FP8_KV_COMPUTE_CAPABILITY = 89  # native e4m3 (fp8e4nv) in Triton, as vLLM's TRITON_ATTN
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
_WHO = "the vllm_moe_graphs attention backend (CUSTOM)"


class MoeGraphsAttentionBackend(AttentionBackend):
    """Capabilities are class data; vLLM's `validate_configuration` reads them at selection."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = list(SUPPORTED_KV_CACHE_DTYPES)
    supported_head_sizes: ClassVar[tuple[int, ...]] = SUPPORTED_HEAD_SIZES
    supported_kernel_block_sizes: ClassVar[tuple[int, ...]] = SUPPORTED_BLOCK_SIZES
    # vLLM calls impl.do_kv_cache_update(...) before forward (TRITON_ATTN does the same).
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[MoeGraphsAttentionImpl]:
        return MoeGraphsAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[MoeGraphsMetadataBuilder]:
        return MoeGraphsMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int]:
        # Exact sizes (no MultipleOf): a larger cache block is split into kernel blocks by vLLM.
        return list(SUPPORTED_BLOCK_SIZES)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(cls.supported_head_sizes)

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        if cache_dtype_str not in SUPPORTED_KV_CACHE_DTYPES:
            raise NotImplementedError(
                f"kv_cache_dtype={cache_dtype_str!r} is not supported by {_WHO}; supported: "
                f"{SUPPORTED_KV_CACHE_DTYPES}"
            )
        return TritonAttentionBackend.get_kv_cache_shape(
            num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str
        )

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        return TritonAttentionBackend.get_kv_cache_stride_order(include_num_layers_dimension)

    # ------------------------------------------------------------------------- selection hooks
    # Each False below becomes a named reason in vLLM's validate_configuration.

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER  # no encoder, encoder-only or cross attention

    @classmethod
    def is_mla(cls) -> bool:
        return False

    @classmethod
    def is_sparse(cls) -> bool:
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_alibi_sqrt(cls) -> bool:
        return False

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return False

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False  # unproven with KV transfer connectors: deny

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return capability.to_int() >= MIN_COMPUTE_CAPABILITY

    @classmethod
    def supports_combination(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: CacheDType | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        device_capability: DeviceCapability,
    ) -> str | None:
        if kv_cache_dtype in FP8_KV_CACHE_DTYPES:  # the KV write quantizes, the kernels read it
            if device_capability.to_int() < MIN_FP8_KV_COMPUTE_CAPABILITY:
                return (f"kv_cache_dtype {kv_cache_dtype} needs compute capability 8.9+ "
                        f"(native e4m3), this device has {device_capability.to_int()}")
            return None
        # Otherwise the KV write copies bits, it never converts: the cache holds the model dtype.
        model_dtype = _DTYPE_NAMES.get(dtype)
        if kv_cache_dtype not in (None, "auto") and model_dtype and kv_cache_dtype != model_dtype:
            return (
                f"kv_cache_dtype {kv_cache_dtype} differs from the model dtype {model_dtype} "
                "(use kv_cache_dtype auto)"
            )
        return None


class MoeGraphsAttentionImpl(AttentionImpl[MoeGraphsAttentionMetadata]):
    """KV write + one kernel launch per layer; all planning happened in the builder."""

    supports_dcp: bool = False
    supports_pcp: bool = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **extra_impl_args: Any,
    ) -> None:
        refused = unsupported_settings(
            head_size=head_size,
            alibi_slopes=alibi_slopes,
            sliding_window=sliding_window,
            kv_cache_dtype=kv_cache_dtype,
            logits_soft_cap=logits_soft_cap,
            attn_type=attn_type,
            dcp_world_size=self.dcp_world_size,  # set by AttentionImplBase.__new__
            extra_impl_args=extra_impl_args,
        )
        if refused:
            raise NotImplementedError(
                f"{_WHO} does not support: {'; '.join(refused)}. Choose another backend "
                "(e.g. --attention-backend TRITON_ATTN) for this model or configuration."
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)  # a Python float: the kernels reject tensors (host sync)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_fp8 = kv_cache_dtype in FP8_KV_CACHE_DTYPES
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [NB, Hkv, BS, 2 * D] logical
        slot_mapping: torch.Tensor,  # [>= T'] int64, -1 = padded token
    ) -> None:
        if kv_cache.numel() == 0:
            return  # no cache bound yet (memory profiling)
        key_cache, value_cache = self._caches(kv_cache)
        # NOTE: padded tokens carry slot -1 and are skipped inside the kernel; the grid is the
        # token count (a shape), never filtered on the host.
        num_tokens = min(key.shape[0], slot_mapping.shape[0])
        write_kv(key[:num_tokens], value[:num_tokens], key_cache, value_cache, slot_mapping,
                 **self._scales(layer))

    def _caches(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value cache views; an FP8 cache (vLLM allocates it as uint8 bytes) viewed
        as e4m3, as vLLM's TRITON_ATTN does."""
        key_cache, value_cache = split_kv_cache(kv_cache, self.head_size)
        if self.kv_fp8 and key_cache.dtype != FP8_KV_DTYPE:
            key_cache, value_cache = key_cache.view(FP8_KV_DTYPE), value_cache.view(FP8_KV_DTYPE)
        return key_cache, value_cache

    def _scales(self, layer: torch.nn.Module) -> dict[str, torch.Tensor]:
        """An FP8 cache's per-tensor scales, the layer's own device tensors (their addresses stay,
        so a captured graph reads the values of the moment); none for an unquantized cache."""
        return {"k_scale": layer._k_scale, "v_scale": layer._v_scale} if self.kv_fp8 else {}

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,  # [T, Hq, D]
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,  # [NB, Hkv, BS, 2 * D] logical
        attn_metadata: MoeGraphsAttentionMetadata,
        output: torch.Tensor,  # [T, Hq, D]
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(f"fused output quantization is not supported by {_WHO}")
        if attn_metadata is None:
            return output.fill_(0)  # memory-profiling run: no metadata, no cache
        # NOTE: graph safety. Views, shapes and host constants from the metadata only: no
        # allocation, no host sync, no .item(); the kernels read the builder's persistent buffers.
        key_cache, value_cache = self._caches(kv_cache)
        scales = self._scales(layer)
        md = attn_metadata
        if md.decode:
            rows = md.num_reqs  # one query token per row; rows past the real batch have length 0
            paged_decode_attention(
                output[:rows],
                query[:rows],
                key_cache,
                value_cache,
                md.block_table,
                md.seq_lens,
                self.scale,
                num_splits=md.num_splits,
                workspace=md.workspace,
                **scales,
            )
        elif md.fa3_schedule is not None and not self.kv_fp8:  # FA3 (prefill_attention)
            tokens = md.num_actual_tokens
            flash_attn_prefill(output[:tokens], query[:tokens], key_cache, value_cache, md,
                               self.scale)
        else:
            tokens = md.num_actual_tokens
            paged_prefill_attention(
                output[:tokens],
                query[:tokens],
                key_cache,
                value_cache,
                md.block_table,
                md.query_start_loc,
                md.seq_lens,
                self.scale,
                max_query_len=md.max_query_len,
                **scales,
            )
        return output


def unsupported_settings(
    *,
    head_size: int,
    alibi_slopes: Any,
    sliding_window: int | None,
    kv_cache_dtype: str,
    logits_soft_cap: float | None,
    attn_type: str,
    dcp_world_size: int = 1,
    extra_impl_args: dict[str, Any] | None = None,
) -> list[str]:
    """One entry per unsupported setting, naming it and its value; empty when supported."""
    refused = []
    if head_size not in SUPPORTED_HEAD_SIZES:
        refused.append(f"head_size={head_size} (supported: {SUPPORTED_HEAD_SIZES})")
    if alibi_slopes is not None:
        refused.append("alibi (alibi_slopes)")
    if sliding_window is not None:
        refused.append(f"sliding window (sliding_window={sliding_window})")
    if kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        refused.append(
            f"kv_cache_dtype={kv_cache_dtype!r} (supported: {SUPPORTED_KV_CACHE_DTYPES}; "
            "e5m2, per-token-head and integer KV caches are not implemented)"
        )
    if logits_soft_cap:  # None and 0 both mean no soft cap
        refused.append(f"logits soft cap (logits_soft_cap={logits_soft_cap})")
    if attn_type != AttentionType.DECODER:
        refused.append(
            f"attention type {getattr(attn_type, 'value', attn_type)} (only decoder "
            "self-attention; no encoder, encoder-only or cross attention)"
        )
    if dcp_world_size > 1:
        refused.append(f"decode context parallelism (DCP world size {dcp_world_size})")
    for name, value in (extra_impl_args or {}).items():
        if name == "sinks" and value is not None:
            refused.append("attention sinks (sinks)")
        elif name == "chunk_lookback" and value not in (None, -1):
            refused.append(f"chunked attention with lookback (chunk_lookback={value})")
        elif name not in ("sinks", "chunk_lookback") and value is not None:
            refused.append(f"extra attention argument {name}={value!r}")
    return refused
