"""CPU tier for the attention backend's class data, its refusals (vLLM's selection, the impl, the
metadata builder) and its registration as vLLM's CUSTOM backend."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Must precede the first import of vllm_moe_graphs.ops (i.e. of @triton.jit).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("vllm")

# Raised inside triton's interpreter (scalar `__index__` on a 1-element array), not by us.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning")

from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backend import (  # noqa: E402
    AttentionCGSupport,
    AttentionType,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend  # noqa: E402
from vllm.v1.attention.backends.utils import set_kv_cache_layout  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402

from vllm_moe_graphs.integration.attention import BACKEND_QUALNAME  # noqa: E402
from vllm_moe_graphs.integration.attention.backend import (  # noqa: E402
    MoeGraphsAttentionBackend,
    MoeGraphsAttentionImpl,
)
from vllm_moe_graphs.integration.attention.metadata import MoeGraphsMetadataBuilder  # noqa: E402
from vllm_moe_graphs.integration.attention.registry import register_attention_backend  # noqa: E402

from tests.attention.backend_env import LAYER, Backend, _batch  # noqa: E402


# ----------------------------------------------------------------------------- class data


def test_backend_class_data():
    assert Backend.get_name() == "CUSTOM"
    assert AttentionBackendEnum[Backend.get_name()] is AttentionBackendEnum.CUSTOM
    assert ".".join(Backend.full_cls_name()) == BACKEND_QUALNAME  # what vLLM logs and resolves
    assert Backend.get_impl_cls() is MoeGraphsAttentionImpl
    assert Backend.get_builder_cls() is MoeGraphsMetadataBuilder
    assert Backend.supported_dtypes == [torch.float16, torch.bfloat16]
    assert Backend.supported_kv_cache_dtypes == ["auto", "float16", "bfloat16", "fp8",
                                                 "fp8_e4m3"]
    assert Backend.get_supported_head_sizes() == [64, 128]
    assert Backend.get_supported_kernel_block_sizes() == [16, 32, 64]
    assert Backend.forward_includes_kv_cache_update is False
    assert MoeGraphsMetadataBuilder._cudagraph_support is AttentionCGSupport.ALWAYS
    assert not Backend.is_mla() and not Backend.supports_sink()
    assert not Backend.supports_sliding_window()


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_kv_cache_layout_is_triton_attn(layout, env):
    try:
        set_kv_cache_layout(layout)
        with set_current_vllm_config(env.vllm_config):
            for layers in (False, True):
                assert Backend.get_kv_cache_stride_order(layers) == (
                    TritonAttentionBackend.get_kv_cache_stride_order(layers))
            assert Backend.indexes_kv_by_block_stride() == (
                TritonAttentionBackend.indexes_kv_by_block_stride())
    finally:
        set_kv_cache_layout(None)
    for args in [(100, 16, 8, 128), (7, 32, 4, 64), (3, 64, 1, 128)]:
        assert Backend.get_kv_cache_shape(*args) == TritonAttentionBackend.get_kv_cache_shape(*args)
    for fp8 in ("fp8", "fp8_e4m3"):  # the same layout, of bytes
        assert Backend.get_kv_cache_shape(100, 16, 8, 128, cache_dtype_str=fp8) == (
            TritonAttentionBackend.get_kv_cache_shape(100, 16, 8, 128, cache_dtype_str=fp8))
    with pytest.raises(NotImplementedError, match="kv_cache_dtype='fp8_e5m2'"):
        Backend.get_kv_cache_shape(100, 16, 8, 128, cache_dtype_str="fp8_e5m2")


# ----------------------------------------------------------------------------- refusals

H200 = DeviceCapability(9, 0)


def _validate(**overrides) -> list[str]:
    args = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None,
                use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
                use_per_head_quant_scales=False, device_capability=H200,
                attn_type=AttentionType.DECODER)
    args.update(overrides)
    return Backend.validate_configuration(**args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("block_size", [None, 16, 32, 64])
def test_selection_accepts_qwen3(dtype, head_size, block_size):
    assert _validate(dtype=dtype, head_size=head_size, block_size=block_size) == []
    kv = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    assert _validate(dtype=dtype, kv_cache_dtype=kv) == []
    for fp8 in ("fp8", "fp8_e4m3"):  # the KV write quantizes with the layer's scales
        assert _validate(dtype=dtype, kv_cache_dtype=fp8) == []


@pytest.mark.parametrize("overrides,reason", [
    ({"head_size": 96}, "head_size not supported"),
    ({"head_size": 256}, "head_size not supported"),
    ({"dtype": torch.float32}, "dtype not supported"),
    ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype not supported"),
    ({"kv_cache_dtype": "fp8_per_token_head"}, "kv_cache_dtype not supported"),
    ({"kv_cache_dtype": "fp8", "device_capability": DeviceCapability(8, 0)},
     "needs compute capability 8.9+"),
    ({"kv_cache_dtype": "int8_per_token_head"}, "kv_cache_dtype not supported"),
    ({"dtype": torch.float16, "kv_cache_dtype": "bfloat16"}, "differs from the model dtype"),
    ({"block_size": 8}, "block_size not supported"),
    ({"use_mla": True}, "MLA not supported"),
    ({"use_sparse": True}, "sparse not supported"),
    ({"has_sink": True}, "attention sinks not supported"),
    ({"has_sliding_window": True}, "sliding window not supported"),
    ({"attn_type": AttentionType.ENCODER}, "attention type AttentionType.ENCODER not supported"),
    ({"attn_type": AttentionType.ENCODER_ONLY}, "AttentionType.ENCODER_ONLY not supported"),
    ({"attn_type": AttentionType.ENCODER_DECODER}, "AttentionType.ENCODER_DECODER not supported"),
    ({"use_mm_prefix": True}, "multimodal"),
    ({"use_non_causal": True}, "non-causal attention not supported"),
    ({"use_batch_invariant": True}, "batch invariance not supported"),
    ({"use_kv_connector": True}, "KV connector not supported"),
    ({"use_pcp": True}, "PCP not supported"),
    ({"device_capability": DeviceCapability(7, 5)}, "compute capability not supported"),
])
def test_selection_refuses(overrides, reason):
    reasons = _validate(**overrides)
    assert any(reason in r for r in reasons), reasons


QWEN3_IMPL_ARGS = dict(num_heads=16, head_size=128, scale=128**-0.5, num_kv_heads=8,
                       alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto",
                       logits_soft_cap=None, attn_type=AttentionType.DECODER,
                       kv_sharing_target_layer_name=None)


def test_impl_accepts_qwen3():
    impl = MoeGraphsAttentionImpl(**QWEN3_IMPL_ARGS)
    assert (impl.num_heads, impl.num_kv_heads, impl.head_size) == (16, 8, 128)
    assert isinstance(impl.scale, float)
    MoeGraphsAttentionImpl(**{**QWEN3_IMPL_ARGS, "logits_soft_cap": 0, "sinks": None})
    assert not impl.kv_fp8
    for fp8 in ("fp8", "fp8_e4m3"):
        assert MoeGraphsAttentionImpl(**{**QWEN3_IMPL_ARGS, "kv_cache_dtype": fp8}).kv_fp8


@pytest.mark.parametrize("overrides,named", [
    ({"head_size": 96}, "head_size=96"),
    ({"alibi_slopes": [0.5] * 16}, "alibi"),
    ({"sliding_window": 4096}, "sliding window (sliding_window=4096)"),
    ({"kv_cache_dtype": "int8_per_token_head"}, "kv_cache_dtype='int8_per_token_head'"),
    ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype='fp8_e5m2'"),
    ({"logits_soft_cap": 30.0}, "logits soft cap (logits_soft_cap=30.0)"),
    ({"attn_type": AttentionType.ENCODER}, "attention type encoder "),
    ({"attn_type": AttentionType.ENCODER_ONLY}, "attention type encoder_only"),
    ({"attn_type": AttentionType.ENCODER_DECODER}, "attention type encoder_decoder"),
    ({"sinks": torch.zeros(16)}, "attention sinks"),
    ({"chunk_lookback": 8}, "chunk_lookback=8"),
    ({"block_m": 64}, "extra attention argument block_m=64"),
])
def test_impl_refuses(overrides, named):
    with pytest.raises(NotImplementedError, match="does not support") as err:
        MoeGraphsAttentionImpl(**{**QWEN3_IMPL_ARGS, **overrides})
    assert named in str(err.value)


def test_builder_refuses_unsupported_spec(env):
    def build(spec):
        return MoeGraphsMetadataBuilder(spec, [LAYER], env.vllm_config, env.device)

    base = dict(num_kv_heads=2, head_size=64, dtype=torch.float32)
    with pytest.raises(NotImplementedError, match="block size 128"):
        build(FullAttentionSpec(block_size=128, **base))
    with pytest.raises(NotImplementedError, match="value head size 128"):
        build(FullAttentionSpec(block_size=16, head_size_v=128, **base))
    with pytest.raises(NotImplementedError, match="sliding window"):
        build(SlidingWindowSpec(block_size=16, sliding_window=64, **base))


def test_builder_refuses_non_causal_and_cascade(env):
    batch = _batch(env, [1, 1], [5, 9])
    with pytest.raises(NotImplementedError, match="non-causal"):
        env.builder.build(0, batch.cm.replace(causal=False))
    with pytest.raises(NotImplementedError, match="cascade"):
        env.builder.build(16, batch.cm)


# ----------------------------------------------------------------------------- registration


@pytest.fixture
def custom_slot():
    """Leave vLLM's CUSTOM registration as the test found it."""
    custom = AttentionBackendEnum.CUSTOM
    saved = custom.get_path() if custom.is_overridden() else None
    custom.clear_override()
    yield custom
    custom.clear_override()
    if saved is not None:
        from vllm.v1.attention.backends.registry import register_backend

        register_backend(custom, saved)


def test_registration_resolves_custom(custom_slot):
    assert register_attention_backend() == BACKEND_QUALNAME
    assert register_attention_backend() == BACKEND_QUALNAME  # idempotent
    assert custom_slot.get_path() == BACKEND_QUALNAME
    backend_cls = custom_slot.get_class()  # vLLM's own lookup, as its selector does
    assert backend_cls is MoeGraphsAttentionBackend
    assert AttentionBackendEnum[backend_cls.get_name()] is custom_slot


def test_registration_refuses_to_steal_custom(custom_slot):
    from vllm.v1.attention.backends.registry import register_backend

    register_backend(custom_slot, "other_plugin.attention.OtherBackend")
    with pytest.raises(RuntimeError, match="other_plugin.attention.OtherBackend"):
        register_attention_backend()
    assert custom_slot.get_path() == "other_plugin.attention.OtherBackend"


def test_registration_is_light():
    """In a fresh process: neither the backend, the kernels nor CUDA are touched."""
    code = textwrap.dedent("""
        import sys
        from vllm_moe_graphs.integration.attention.registry import register_attention_backend
        path = register_attention_backend()
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        assert AttentionBackendEnum.CUSTOM.get_path() == path
        heavy = [m for m in ("vllm_moe_graphs.integration.attention.backend",
                             "vllm_moe_graphs.integration.attention.metadata",
                             "vllm_moe_graphs.ops", "vllm.v1.attention.backends.triton_attn")
                 if m in sys.modules]
        import torch
        print("RESULT", heavy, torch.cuda.is_initialized())
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULT [] False" in proc.stdout
