"""CPU tier for the attention backend glue (no GPU; Triton kernels under TRITON_INTERPRET=1).

Everything on the vLLM side is real, built on CPU: a `VllmConfig` from a shrunken shipped Qwen3
shape, vLLM's own `Attention` layer carrying our backend, the layer's `FullAttentionSpec`,
`CommonAttentionMetadata` on CPU tensors and vLLM's forward context. The forward goes through
vLLM's `unified_kv_cache_update` / `unified_attention_with_output` into our impl and is compared
with the float64 references of `vllm_moe_graphs/ops/reference.py`. Float32 maths, tiny shapes.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Must precede the first import of vllm_moe_graphs.ops (i.e. of @triton.jit).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("vllm")

# Raised inside triton's interpreter (scalar `__index__` on a 1-element array), not by us.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning")

from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.layers.attention import Attention  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backend import (  # noqa: E402
    AttentionCGSupport,
    AttentionType,
    CommonAttentionMetadata,
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
from vllm_moe_graphs.integration.attention.metadata import (  # noqa: E402
    INTERPRETER_NUM_SMS,
    MoeGraphsAttentionMetadata,
    MoeGraphsMetadataBuilder,
)
from vllm_moe_graphs.integration.attention.registry import register_attention_backend  # noqa: E402
from vllm_moe_graphs.model_configs import shape_dir  # noqa: E402
from vllm_moe_graphs.ops import choose_num_splits, split_kv_cache  # noqa: E402
from vllm_moe_graphs.ops.reference import (  # noqa: E402
    reference_paged_decode,
    reference_paged_prefill,
)

from .test_gpu_backend_e2e import check, compare  # noqa: E402

Backend = MoeGraphsAttentionBackend
ATOL = RTOL = 2e-5  # float32 kernels vs float64 reference (as in tests/ops)
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 4, 2, 64  # GQA group 2
BLOCK_SIZE, NUM_BLOCKS, MAX_MODEL_LEN, MAX_NUM_SEQS = 16, 48, 256, 8
LAYER = "model.layers.0.self_attn.attn"
NULL_BLOCK = 0  # vLLM's reserved null block: padded block-table rows point at it




# ----------------------------------------------------------------------------- vLLM objects


def _vllm_config(tmp_dir, device: torch.device, **additional) -> VllmConfig:
    """A real VllmConfig over the qwen3-0.6b shape shrunk to Hq=4, Hkv=2, D=64 (one layer)."""
    with open(os.path.join(shape_dir("qwen3-0.6b"), "config.json")) as f:
        hf = json.load(f)
    hf.update(num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS, head_dim=HEAD_SIZE,
              hidden_size=256, intermediate_size=512, num_hidden_layers=1,
              max_position_embeddings=2 * MAX_MODEL_LEN, vocab_size=512,
              bos_token_id=0, eos_token_id=0)
    path = os.path.join(str(tmp_dir), "config.json")
    with open(path, "w") as f:
        json.dump(hf, f)
    model_config = ModelConfig(model=str(tmp_dir), skip_tokenizer_init=True, dtype="float32",
                               max_model_len=MAX_MODEL_LEN)
    return VllmConfig(
        model_config=model_config,
        device_config=DeviceConfig(device=device.type),
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        scheduler_config=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN,
                                         max_num_batched_tokens=MAX_MODEL_LEN,
                                         is_encoder_decoder=False),
        additional_config=dict(additional),
    )


@dataclasses.dataclass
class Env:
    vllm_config: VllmConfig
    layer: Attention
    builder: MoeGraphsMetadataBuilder
    kv_cache: torch.Tensor  # the per-layer tensor as vLLM allocates it
    key_cache: torch.Tensor  # [NB, BS, Hkv, D] views
    value_cache: torch.Tensor
    device: torch.device


def _allocate_kv_cache(device: torch.device) -> torch.Tensor:
    """As vLLM's runners do: backend shape, permuted into the backend's stride order."""
    shape = Backend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    order = Backend.get_kv_cache_stride_order()
    raw = torch.empty([shape[i] for i in order], dtype=torch.float32, device=device)
    return raw.permute(*[order.index(i) for i in range(len(order))])


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Env:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    vllm_config = _vllm_config(tmp_path_factory.mktemp("qwen3-tiny"), device)
    with set_current_vllm_config(vllm_config):
        layer = Attention(NUM_HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, num_kv_heads=NUM_KV_HEADS,
                          cache_config=vllm_config.cache_config, prefix=LAYER,
                          attn_backend=Backend)
        spec = layer.get_kv_cache_spec(vllm_config)
        builder = Backend.get_builder_cls()(spec, [LAYER], vllm_config, device)
        kv_cache = _allocate_kv_cache(device)
    layer.kv_cache = kv_cache  # what vLLM's bind_kv_cache does
    key_cache, value_cache = split_kv_cache(kv_cache, HEAD_SIZE)
    return Env(vllm_config, layer, builder, kv_cache, key_cache, value_cache, device)


@dataclasses.dataclass
class Batch:
    cm: CommonAttentionMetadata
    query: torch.Tensor  # [T, Hq * D]
    key: torch.Tensor  # [T, Hkv * D]
    value: torch.Tensor
    num_real_reqs: int
    num_real_tokens: int
    q_lens: list[int]
    seq_lens: list[int]


def _batch(env: Env, q_lens, seq_lens, *, pad_reqs=0, pad_tokens=0, seed=0) -> Batch:
    """A batch as vLLM's V1 runner pads it for a FULL graph: padded rows have q_len 0, seq_len 0
    and the null block; padded tokens carry slot -1. Cached context is random, every other cache
    slot is NaN, so a read of an unwritten slot or a write through slot -1 shows up."""
    gen = torch.Generator().manual_seed(seed)
    dev = env.device
    num_reqs, num_tokens = len(q_lens) + pad_reqs, sum(q_lens) + pad_tokens
    env.kv_cache.fill_(float("nan"))
    table = torch.full((num_reqs, env.builder.max_blocks), NULL_BLOCK, dtype=torch.int32)
    free = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
    slots = torch.full((num_tokens,), -1, dtype=torch.int64)
    token = 0
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        pages = [free.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        pos = torch.arange(seq_len)
        slot = table[i, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        ctx = seq_len - q_len  # cached prefix, already in the cache
        kv = torch.randn(2, ctx, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dev)
        env.key_cache[slot[:ctx] // BLOCK_SIZE, slot[:ctx] % BLOCK_SIZE] = kv[0]
        env.value_cache[slot[:ctx] // BLOCK_SIZE, slot[:ctx] % BLOCK_SIZE] = kv[1]
        slots[token : token + q_len] = slot[ctx:]
        token += q_len
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    starts += [starts[-1]] * pad_reqs  # non-decreasing, as vLLM pads query_start_loc
    qsl = torch.tensor(starts, dtype=torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=qsl.to(dev),
        query_start_loc_cpu=qsl,
        seq_lens=torch.tensor(list(seq_lens) + [0] * pad_reqs, dtype=torch.int32, device=dev),
        num_reqs=num_reqs,
        num_actual_tokens=num_tokens,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=table.to(dev),
        slot_mapping=slots.to(dev),
    )
    query = torch.randn(num_tokens, NUM_HEADS * HEAD_SIZE, generator=gen).to(dev)
    key = torch.randn(num_tokens, NUM_KV_HEADS * HEAD_SIZE, generator=gen).to(dev)
    value = torch.randn(num_tokens, NUM_KV_HEADS * HEAD_SIZE, generator=gen).to(dev)
    return Batch(cm, query, key, value, len(q_lens), sum(q_lens), list(q_lens), list(seq_lens))


def _run_layer(env: Env, batch: Batch, metadata: MoeGraphsAttentionMetadata) -> torch.Tensor:
    """vLLM's Attention.forward under a forward context: KV update, then our forward."""
    with set_current_vllm_config(env.vllm_config), set_forward_context(
        {LAYER: metadata}, env.vllm_config, num_tokens=batch.cm.num_actual_tokens,
        slot_mapping={LAYER: batch.cm.slot_mapping},
    ):
        out = env.layer(batch.query, batch.key, batch.value)
    return out.view(-1, NUM_HEADS, HEAD_SIZE)


def _reference(env: Env, batch: Batch) -> torch.Tensor:
    n, b = batch.num_real_tokens, batch.num_real_reqs
    query = batch.query.view(-1, NUM_HEADS, HEAD_SIZE)[:n]
    table, seq_lens = batch.cm.block_table_tensor[:b], batch.cm.seq_lens[:b]
    scale = HEAD_SIZE**-0.5
    if max(batch.q_lens) == 1:
        return reference_paged_decode(query, env.key_cache, env.value_cache, table, seq_lens,
                                      scale)
    return reference_paged_prefill(query, env.key_cache, env.value_cache, table,
                                   batch.cm.query_start_loc[: b + 1], seq_lens, scale)


def _assert_kv_written(env: Env, batch: Batch) -> None:
    """New K/V landed at their slots; padded tokens (slot -1) wrote nothing."""
    slots = batch.cm.slot_mapping[: batch.num_real_tokens]
    key = batch.key.view(-1, NUM_KV_HEADS, HEAD_SIZE)[: batch.num_real_tokens]
    value = batch.value.view(-1, NUM_KV_HEADS, HEAD_SIZE)[: batch.num_real_tokens]
    torch.testing.assert_close(env.key_cache[slots // BLOCK_SIZE, slots % BLOCK_SIZE], key,
                               atol=0, rtol=0)
    torch.testing.assert_close(env.value_cache[slots // BLOCK_SIZE, slots % BLOCK_SIZE], value,
                               atol=0, rtol=0)
    filled = int(torch.isfinite(env.key_cache).all(dim=-1).all(dim=-1).sum())
    assert filled == sum(batch.seq_lens), "a padded token or stray write touched the cache"


def _assert_matches_reference(env: Env, batch: Batch, out: torch.Tensor) -> None:
    rows = batch.num_real_tokens
    assert torch.isfinite(out[:rows]).all(), "non-finite output: unwritten row or NaN slot read"
    torch.testing.assert_close(out[:rows].double(), _reference(env, batch), atol=ATOL, rtol=RTOL)


# ----------------------------------------------------------------------------- class data


def test_backend_class_data():
    assert Backend.get_name() == "CUSTOM"
    assert AttentionBackendEnum[Backend.get_name()] is AttentionBackendEnum.CUSTOM
    assert ".".join(Backend.full_cls_name()) == BACKEND_QUALNAME  # what vLLM logs and resolves
    assert Backend.get_impl_cls() is MoeGraphsAttentionImpl
    assert Backend.get_builder_cls() is MoeGraphsMetadataBuilder
    assert Backend.supported_dtypes == [torch.float16, torch.bfloat16]
    assert Backend.supported_kv_cache_dtypes == ["auto", "float16", "bfloat16"]
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
    with pytest.raises(NotImplementedError, match="kv_cache_dtype='fp8'"):
        Backend.get_kv_cache_shape(100, 16, 8, 128, cache_dtype_str="fp8")


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


@pytest.mark.parametrize("overrides,reason", [
    ({"head_size": 96}, "head_size not supported"),
    ({"head_size": 256}, "head_size not supported"),
    ({"dtype": torch.float32}, "dtype not supported"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype not supported"),
    ({"kv_cache_dtype": "fp8_e4m3"}, "kv_cache_dtype not supported"),
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


@pytest.mark.parametrize("overrides,named", [
    ({"head_size": 96}, "head_size=96"),
    ({"alibi_slopes": [0.5] * 16}, "alibi"),
    ({"sliding_window": 4096}, "sliding window (sliding_window=4096)"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype='fp8'"),
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


# ----------------------------------------------------------------------------- plan


def test_build_decode_batch(env):
    # FULL-graph style: 3 real decode rows padded to 4 (q_len 0, seq_len 0, null block).
    batch = _batch(env, [1, 1, 1], [17, 1, 40], pad_reqs=1, pad_tokens=1)
    md = env.builder.build(0, batch.cm)
    assert md.decode and md.num_reqs == 4 and md.num_actual_tokens == 4
    assert md.context_bucket == MAX_MODEL_LEN  # default buckets are all >= max_model_len
    num_sms = env.builder.num_sms
    assert md.num_splits == choose_num_splits(4, NUM_KV_HEADS, MAX_MODEL_LEN, num_sms)
    if md.num_splits > 1:
        assert tuple(md.workspace.shape) == (4, NUM_HEADS, md.num_splits, HEAD_SIZE + 2)
    else:
        assert md.workspace is None
    torch.testing.assert_close(md.seq_lens, batch.cm.seq_lens, atol=0, rtol=0)
    torch.testing.assert_close(md.query_start_loc, batch.cm.query_start_loc, atol=0, rtol=0)
    cols = -(-40 // BLOCK_SIZE)
    torch.testing.assert_close(md.block_table[:, :cols], batch.cm.block_table_tensor[:, :cols],
                               atol=0, rtol=0)
    assert md.seq_lens.tolist()[3] == 0 and md.block_table[3, 0].item() == NULL_BLOCK


def test_build_uses_persistent_buffers(env):
    """Same addresses for every step (what a captured graph reads), data refreshed each build."""
    first = env.builder.build(0, _batch(env, [1, 1], [30, 5], seed=1).cm)
    ptrs = (first.query_start_loc.data_ptr(), first.seq_lens.data_ptr(),
            first.block_table.data_ptr())
    second_batch = _batch(env, [1, 1], [3, 70], seed=2)
    second = env.builder.build(0, second_batch.cm)
    assert (second.query_start_loc.data_ptr(), second.seq_lens.data_ptr(),
            second.block_table.data_ptr()) == ptrs
    assert second.seq_lens.tolist() == [3, 70]
    if first.workspace is not None and second.workspace is not None:
        assert first.workspace.data_ptr() == second.workspace.data_ptr()
    assert second.block_table.stride(0) == env.builder.max_blocks  # one stride for every step


def _in_place(env: Env, batch: Batch, extra_cols: int = 3):
    """vLLM-style persistent buffers at the largest batch (a wider block table than ours, to
    show the row stride is read), filled with `batch`; the batch's metadata re-pointed at
    views of them, as V1's _build_attention_metadata hands them over."""
    dev, n = env.device, batch.cm.num_reqs
    qsl = torch.full((MAX_NUM_SEQS + 1,), -7, dtype=torch.int32, device=dev)
    seq = torch.full((MAX_NUM_SEQS,), -7, dtype=torch.int32, device=dev)
    table = torch.full((MAX_NUM_SEQS, env.builder.max_blocks + extra_cols), -7,
                       dtype=torch.int32, device=dev)
    qsl[: n + 1] = batch.cm.query_start_loc
    seq[:n] = batch.cm.seq_lens
    table[:n, : env.builder.max_blocks] = batch.cm.block_table_tensor
    cm = batch.cm.replace(query_start_loc=qsl[: n + 1], seq_lens=seq[:n],
                          block_table_tensor=table[:n])
    return (qsl, seq, table), dataclasses.replace(batch, cm=cm)


@pytest.mark.parametrize("q_lens,seq_lens,pad", [
    ([1, 1], [70, 129], 0),  # split-K on CPU
    ([1, 1, 1], [17, 1, 40], 1),  # a padded FULL-graph row
    ([1, 7, 20], [33, 40, 20], 1),  # mixed: the prefill kernel
])
def test_build_in_place_reads_vllm_buffers(env, q_lens, seq_lens, pad):
    builder = env.builder
    batch = _batch(env, q_lens, seq_lens, pad_reqs=pad, pad_tokens=pad)
    (qsl, seq, table), batch = _in_place(env, batch)
    own = (builder._query_start_loc.clone(), builder._seq_lens.clone(),
           builder._block_table.clone())
    builder.read_in_place(qsl, seq, table)
    try:
        md = builder.build(0, batch.cm)
        assert (md.query_start_loc.data_ptr(), md.seq_lens.data_ptr(),
                md.block_table.data_ptr()) == (qsl.data_ptr(), seq.data_ptr(), table.data_ptr())
        assert md.block_table.stride(0) == builder.max_blocks + 3
        for before, after in zip(own, (builder._query_start_loc, builder._seq_lens,
                                       builder._block_table)):
            assert torch.equal(before, after), "in place, the builder's buffers stay untouched"
        out = _run_layer(env, batch, md)
        _assert_kv_written(env, batch)
        _assert_matches_reference(env, batch, out)
        # a step whose metadata views other tensors gets the copies, as without read_in_place
        other = builder.build(0, _batch(env, q_lens, seq_lens, pad_reqs=pad, pad_tokens=pad).cm)
        assert other.seq_lens.data_ptr() == builder._seq_lens.data_ptr()
    finally:
        builder._in_place = None


def test_read_in_place_refuses_what_is_not_a_vllm_buffer(env):
    dev = env.device
    good = torch.zeros(MAX_NUM_SEQS, dtype=torch.int32, device=dev)
    table = torch.zeros(MAX_NUM_SEQS, 4, dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match="seq_lens must be a 1-D int32 tensor"):
        env.builder.read_in_place(good, good.long(), table)
    with pytest.raises(ValueError, match="block_table must be a 2-D int32"):
        env.builder.read_in_place(good, good, table.t())
    assert env.builder._in_place is None


def test_build_mixed_batch(env):
    # decode row + chunked prefill (cached prefix) + fresh prefill, one padded request
    batch = _batch(env, [1, 7, 20], [33, 40, 20], pad_reqs=1, pad_tokens=4)
    md = env.builder.build(0, batch.cm)
    assert not md.decode and md.num_splits == 1 and md.workspace is None
    assert (md.num_reqs, md.num_actual_tokens, md.max_query_len) == (4, 32, 20)
    assert md.query_start_loc.tolist() == [0, 1, 8, 28, 28]
    assert md.seq_lens.tolist() == [33, 40, 20, 0]


def test_context_bucket_from_plugin_config(tmp_path):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = _vllm_config(tmp_path, device, moe_graphs={"context_buckets": [64, 128, 4096]})
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                             head_size=HEAD_SIZE, dtype=torch.float32)
    builder = MoeGraphsMetadataBuilder(spec, [LAYER], cfg, device)
    assert builder.context_buckets == (64, 128, MAX_MODEL_LEN)
    for max_seq_len, bucket in [(1, 64), (64, 64), (65, 128), (129, 256), (256, 256)]:
        cm = CommonAttentionMetadata(
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device),
            query_start_loc_cpu=torch.tensor([0, 1], dtype=torch.int32),
            seq_lens=torch.tensor([max_seq_len], dtype=torch.int32, device=device),
            num_reqs=1, num_actual_tokens=1, max_query_len=1, max_seq_len=max_seq_len,
            block_table_tensor=torch.zeros(1, builder.max_blocks, dtype=torch.int32,
                                           device=device),
            slot_mapping=torch.zeros(1, dtype=torch.int64, device=device),
        )
        md = builder.build(0, cm)
        assert md.context_bucket == bucket
        assert md.num_splits == choose_num_splits(1, NUM_KV_HEADS, bucket, builder.num_sms)
        # a step planned for a graph key plans the key's bucket, whatever its longest context
        builder.plan_for(MAX_MODEL_LEN)
        md = builder.build(0, cm)
        assert md.context_bucket == MAX_MODEL_LEN
        assert md.num_splits == choose_num_splits(1, NUM_KV_HEADS, MAX_MODEL_LEN,
                                                  builder.num_sms)
        builder.plan_for(None)


@pytest.mark.parametrize("choice,level", [("flash_attn", "WARNING"), ("auto", "INFO")])
def test_flash_attn_prefill_falls_back_to_ours_where_fa3_is_absent(tmp_path, caplog, choice,
                                                                   level):
    """prefill_attention flash_attn, or the default auto, where vLLM's FA3 cannot run (here:
    no GPU): the builder says why once (a warning when FA3 was asked for by name) and plans
    steps with prefill tokens for the plugin's kernel."""
    import logging

    from vllm_moe_graphs.integration.attention.flash_attn import flash_attn_problem

    assert flash_attn_problem()  # no FA3 on a CPU machine
    device = torch.device("cpu")
    cfg = _vllm_config(tmp_path, device, moe_graphs={"prefill_attention": choice})
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                             head_size=HEAD_SIZE, dtype=torch.float32)
    with caplog.at_level(logging.INFO, logger="vllm.moe_graphs"):
        builder = MoeGraphsMetadataBuilder(spec, [LAYER], cfg, device)
    assert builder.flash_attn is None
    said = [r for r in caplog.records if f"prefill_attention {choice}: FlashAttention 3 is "
            "not available (" in r.getMessage() and "use the plugin's kernel" in r.getMessage()]
    assert [r.levelname for r in said] == [level], caplog.records
    assert "fa3_schedule" not in builder.persistent_buffers()


def test_build_for_cudagraph_capture(env):
    batch = _batch(env, [1, 1, 1], [17, 1, 40], pad_reqs=1, pad_tokens=1)
    md = env.builder.build_for_cudagraph_capture(batch.cm)
    assert md.seq_lens.tolist() == [1, 1, 1, 0]  # seq_len = q_len: smallest valid context
    mixed = _batch(env, [1, 7, 20], [33, 40, 20], pad_reqs=1, pad_tokens=4)
    assert env.builder.build_for_cudagraph_capture(mixed.cm).seq_lens.tolist() == [1, 7, 20, 0]


def test_workspace_covers_every_batch(env):
    builder = env.builder
    assert builder.num_sms == (INTERPRETER_NUM_SMS if env.device.type == "cpu"
                               else torch.cuda.get_device_properties(env.device)
                               .multi_processor_count)
    for batch in range(1, MAX_NUM_SEQS + 1):
        splits = builder.num_splits(batch, MAX_MODEL_LEN)
        if splits > 1:
            assert builder._workspace_view(batch, splits).shape[0] == batch


def test_decode_keys_share_a_graph_where_the_builder_plans_one_launch(env):
    """`runner/buffers.decode_split_plan` hands the graph runner our builder's split counts: a
    decode step picks the key of the smallest context bucket the builder plans the same split
    count for, and keys with different counts stay apart."""
    from types import SimpleNamespace

    from vllm_moe_graphs.config import PluginConfig
    from vllm_moe_graphs.graphs import DecodeGraphRunner
    from vllm_moe_graphs.integration.runner.buffers import decode_split_plan

    builder = env.builder
    group = SimpleNamespace(get_metadata_builder=lambda: builder)
    assert decode_split_plan(SimpleNamespace(attn_groups=[])) is None
    plan = decode_split_plan(SimpleNamespace(attn_groups=[[group]]))
    cfg = PluginConfig(decode_batch_buckets=(1, 2, 4, 8), context_buckets=(64, 128, 256))
    graphs = DecodeGraphRunner(None, cfg, capture_fn=lambda *a, **k: None, new_pool=object,
                               decode_plan=plan)
    seen = set()
    for batch in cfg.decode_batch_buckets:
        for context in cfg.context_buckets:
            key = graphs.decide(batch, context, True).key
            splits = builder.num_splits(batch, context)
            assert builder.num_splits(batch, key.context_bucket) == splits
            assert key.context_bucket == min(c for c in cfg.context_buckets
                                             if builder.num_splits(batch, c) == splits)
            seen.add((batch, splits))
    assert len(graphs.all_keys()) == len(seen), graphs.all_keys()
    if env.device.type == "cpu":  # 4 stand-in SMs: batches 4 and 8 plan fewer splits
        assert len(seen) == 9, seen


# ----------------------------------------------------------------------------- run


@pytest.mark.parametrize("q_lens,seq_lens,pad", [
    ([1, 1], [70, 129], 0),  # few rows: split-K (with 4 stand-in SMs on CPU)
    ([1, 1, 1, 1], [17, 1, 40, 64], 2),  # padded to 6 rows: no split
])
def test_forward_decode_matches_reference(env, q_lens, seq_lens, pad):
    batch = _batch(env, q_lens, seq_lens, pad_reqs=pad, pad_tokens=pad)
    md = env.builder.build(0, batch.cm)
    assert md.decode
    out = _run_layer(env, batch, md)
    _assert_kv_written(env, batch)
    _assert_matches_reference(env, batch, out)
    padded = out[batch.num_real_reqs : md.num_reqs]
    assert torch.equal(padded, torch.zeros_like(padded)), "padded decode rows must be zeros"


def test_forward_decode_exercises_split_k(env):
    md = env.builder.build(0, _batch(env, [1, 1], [70, 129]).cm)
    if env.device.type == "cpu":
        assert md.num_splits > 1 and md.workspace is not None


def test_forward_mixed_matches_reference(env):
    batch = _batch(env, [1, 7, 20, 1], [33, 40, 20, 2], pad_reqs=1, pad_tokens=3)
    md = env.builder.build(0, batch.cm)
    assert not md.decode
    out = _run_layer(env, batch, md)
    _assert_kv_written(env, batch)
    _assert_matches_reference(env, batch, out)


def test_prefill_kernel_serves_a_decode_step(env):
    """A FULL graph captured on a mixed batch replays the prefill kernel for a decode step: the
    buffers build() filled for decode must serve it too."""
    batch = _batch(env, [1, 1, 1], [17, 1, 40], pad_reqs=1, pad_tokens=1)
    md = env.builder.build(0, batch.cm)
    out = _run_layer(env, batch, dataclasses.replace(md, decode=False))
    _assert_matches_reference(env, batch, out)


def test_profiling_run_without_metadata_or_cache():
    impl = MoeGraphsAttentionImpl(num_heads=NUM_HEADS, head_size=HEAD_SIZE, scale=0.125,
                                  num_kv_heads=NUM_KV_HEADS)
    query = torch.randn(3, NUM_HEADS, HEAD_SIZE)
    key = torch.randn(3, NUM_KV_HEADS, HEAD_SIZE)
    empty_cache = torch.tensor([])  # vLLM's placeholder before the KV cache is bound
    impl.do_kv_cache_update(None, key, key, empty_cache, torch.zeros(3, dtype=torch.int64))
    output = torch.full_like(query, math.nan)
    impl.forward(None, query, key, key, empty_cache, None, output)
    assert torch.equal(output, torch.zeros_like(output))


# ----------------------------------------------------------------------------- GPU verdict logic


def _run(tokens_and_tops):
    return [{"tokens": [t for t, _ in seq], "top": [top for _, top in seq]}
            for seq in tokens_and_tops]


def test_e2e_comparison_verdicts():
    """The comparison the GPU e2e test relies on: agreement, near-ties, genuine divergence."""
    same = [(5, [[5, -1.0], [6, -1.5]]), (7, [[7, -0.5], [8, -2.0]])]
    ref = _run([same] * 20)
    summary = compare(ref, _run([same] * 20))
    assert summary["first_token_agreement"] == 1.0 and summary["prompts_diverged"] == 0
    assert summary["max_abs_logprob_diff"] == 0.0 and check(summary) == []

    # second token flips between two tokens 0.02 nats apart in both runs: a near-tie
    tie_ref = [(5, [[5, -1.0], [6, -1.5]]), (7, [[7, -0.70], [8, -0.72]])]
    tie_test = [(5, [[5, -1.01], [6, -1.5]]), (8, [[8, -0.70], [7, -0.71]])]
    summary = compare(_run([tie_ref] * 20), _run([tie_test] * 20))
    assert summary["prompts_diverged"] == summary["prompts_diverged_at_near_tie"] == 20
    assert summary["first_token_agreement"] == 1.0
    assert abs(summary["max_abs_logprob_diff"] - 0.01) < 1e-9 and check(summary) == []

    # first token replaced by one outside the reference's top 2 in 2 of 20 prompts: genuine
    wrong = [(9, [[9, -0.2], [3, -3.0]]), (7, [[7, -0.5], [8, -2.0]])]
    summary = compare(ref, _run([wrong] * 2 + [same] * 18))
    assert summary["first_token_agreement"] == summary["first_token_agreement_tie_aware"] == 0.9
    failures = check(summary)
    assert any("not a near-tie" in f for f in failures)
    assert any("near-ties allowed" in f for f in failures)

    # same tokens, logprobs far apart: attention numerically wrong without a flip
    off = [(5, [[5, -2.0], [6, -2.5]]), (7, [[7, -0.5], [8, -2.0]])]
    failures = check(compare(ref, _run([off] * 20)))
    assert any("logprob difference" in f for f in failures)
