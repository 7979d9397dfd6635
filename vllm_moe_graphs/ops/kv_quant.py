"""KV cache dtypes: the activation dtypes the kernels compute in, the FP8 e4m3 cache of vLLM
0.26's `--kv-cache-dtype fp8` / `fp8_e4m3`, its per-tensor scales, and the in-kernel quantize /
dequantize helpers every paged kernel shares.

vLLM's semantics (`v1/attention/ops/triton_reshape_and_cache_flash.py` writes,
`triton_unified_attention.py` `_cast_kv_tile` reads; both with `layer._k_scale` /
`layer._v_scale`, float32 device tensors of one element):
    write: cache = e4m3(x / scale), round to nearest even, saturating at +-448
    read:  k = (cache.to(float32) * scale).to(query dtype)
vLLM allocates the cache as uint8 and its backend views it as torch.float8_e4m3fn before any
kernel sees it; so do our callers (a uint8 cache is refused with that remedy).

The scales are always read from device memory inside the kernels (pointers, never Python floats),
so a captured CUDA graph stays valid when a scale tensor's value changes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Query, output and new K/V rows; a cache of one of these dtypes holds the values unquantized.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
FP8_KV_DTYPE: torch.dtype = torch.float8_e4m3fn  # vLLM's "fp8" / "fp8_e4m3" on CUDA
SUPPORTED_KV_CACHE_DTYPES: tuple[torch.dtype, ...] = (*SUPPORTED_DTYPES, FP8_KV_DTYPE)
FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_E4M3_MAX = tl.constexpr(FP8_E4M3_MAX)  # the same, for use inside kernels

_FP8_HINT = (
    f"FP8 KV caches are supported as {FP8_KV_DTYPE} (vLLM --kv-cache-dtype fp8 / fp8_e4m3, "
    "per-tensor k_scale/v_scale)"
)


def is_fp8_kv_cache(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


def check_dtype(dtype: torch.dtype) -> None:
    """An activation dtype: query, output, new K/V rows."""
    if dtype not in SUPPORTED_DTYPES:
        raise NotImplementedError(
            f"dtype {dtype} is not supported by the vllm_moe_graphs attention kernels for "
            f"queries, outputs and new K/V rows (supported: {SUPPORTED_DTYPES})"
        )


def check_kv_cache_dtype(dtype: torch.dtype) -> None:
    """A cache dtype: one of SUPPORTED_DTYPES (unquantized) or FP8_KV_DTYPE."""
    if dtype in SUPPORTED_KV_CACHE_DTYPES:
        return
    if dtype == torch.uint8:
        raise NotImplementedError(
            f"KV cache dtype {dtype}: vLLM stores FP8 caches as uint8 bytes; view them as "
            f"{FP8_KV_DTYPE} first (kv_cache.view({FP8_KV_DTYPE})), as vLLM's TRITON_ATTN does. "
            f"Supported cache dtypes: {SUPPORTED_KV_CACHE_DTYPES}"
        )
    raise NotImplementedError(
        f"KV cache dtype {dtype} is not supported by the vllm_moe_graphs attention kernels "
        f"(supported: {SUPPORTED_KV_CACHE_DTYPES}); {_FP8_HINT}; float8_e5m2, int8 and "
        "per-token-head quantized caches are not implemented"
    )


def check_kv_scales(
    cache_dtype: torch.dtype,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    device: torch.device,
) -> bool:
    """Whether the cache is FP8; if so, k_scale and v_scale must be float32 tensors of one
    element on `device` (a Python float would be baked into a captured graph). For unquantized
    caches the scales are not read, as in vLLM, whatever they are."""
    if not is_fp8_kv_cache(cache_dtype):
        return False
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(scale, torch.Tensor):
            raise ValueError(
                f"an {cache_dtype} KV cache needs {name} as a float32 tensor of one element on "
                f"the cache's device (vLLM's layer._{name}), got {type(scale).__name__}"
            )
        if scale.dtype != torch.float32 or scale.numel() != 1:
            raise ValueError(
                f"{name} must be a float32 tensor of one element, got {scale.dtype} of shape "
                f"{tuple(scale.shape)}"
            )
        if scale.device != device:
            raise ValueError(f"{name} is on {scale.device}, the KV cache on {device}")
    return True


# ----------------------------------------------------------------------------- in-kernel helpers


@triton.jit
def quantize_e4m3(x, scale):
    """fp32 tile `x` / fp32 scalar `scale` -> float8e4nv, round to nearest even, saturating at
    +-448 (vLLM's write: x / scale, then the cast `cvt.rn.satfinite.e4m3x2.f32` on sm_89+).

    The value is rounded to the e4m3 grid in fp32 first, so the cast itself is exact: Triton's
    interpreter converts fp32 -> fp8 with truncation and a lost mantissa carry, while on the GPU
    the exact cast is the same instruction. Rounding: with ulp the e4m3 spacing at |x| (2^(e-3)
    for |x| in [2^e, 2^(e+1)), e >= -6; 2^-9 below, the subnormals), |x| + 2^23 * ulp lies where
    fp32's own spacing is ulp, so that one fp32 add rounds |x| to the grid, nearest even."""
    y = tl.clamp(x / scale, -_E4M3_MAX, _E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
    bits = y.to(tl.int32, bitcast=True)
    biased_exp = (bits >> 23) & 0xFF
    # 2^23 * ulp as fp32 bits: biased exponent max(e, -6) + 127 - 3 + 23
    magic = ((tl.maximum(biased_exp, 127 - 6) + 20) << 23).to(tl.float32, bitcast=True)
    mag = (tl.abs(y) + magic) - magic  # exact: a multiple of ulp below 2^24 * ulp
    # the sign back as a bit (unary minus is 0 - x, which would turn -0.0 into +0.0)
    signed = mag.to(tl.int32, bitcast=True) | (bits & -2147483648)
    return signed.to(tl.float32, bitcast=True).to(tl.float8e4nv)


@triton.jit
def load_kv_scales(k_scale_ptr, v_scale_ptr, KV_FP8: tl.constexpr):
    """An FP8 cache's (k_scale, v_scale), read from device memory; (1.0, 1.0), unused, for an
    unquantized cache (its pointers are None)."""
    if KV_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    else:
        k_scale = 1.0
        v_scale = 1.0
    return k_scale, v_scale


@triton.jit
def dequantize_kv(x, scale, DTYPE: tl.constexpr):
    """float8e4nv tile -> DTYPE: x.to(float32) * scale, rounded to DTYPE (vLLM's read)."""
    return (x.to(tl.float32) * scale).to(DTYPE)
