"""CPU tier for the attention backend on an FP8 KV cache (`--kv-cache-dtype fp8` /
`fp8_e4m3`): the impl views vLLM's uint8 cache as e4m3, its KV write quantizes with the layer's
`_k_scale` / `_v_scale` device tensors, and decode and mixed steps read it back through them,
against the float64 references on the dequantized cache (Triton kernels under
TRITON_INTERPRET=1). The metadata comes from the same builder as the unquantized tests': its
plan does not depend on the cache dtype."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Must precede the first import of vllm_moe_graphs.ops (i.e. of @triton.jit).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("vllm")

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning")

from vllm_moe_graphs.integration.attention.backend import MoeGraphsAttentionImpl  # noqa: E402
from vllm_moe_graphs.ops import FP8_KV_DTYPE, split_kv_cache  # noqa: E402
from vllm_moe_graphs.ops.reference import (  # noqa: E402
    quantize_fp8_kv,
    reference_paged_decode,
    reference_paged_prefill,
)

from tests.attention.backend_env import (  # noqa: E402
    BLOCK_SIZE,
    HEAD_SIZE,
    NUM_HEADS,
    NUM_KV_HEADS,
    _batch,
)
from tests.attention.test_backend_selection import QWEN3_IMPL_ARGS  # noqa: E402


class _Layer(torch.nn.Module):
    """What the impl reads of vLLM's Attention layer on an FP8 cache: its scale tensors."""

    def __init__(self, device: torch.device, k_scale: float, v_scale: float) -> None:
        super().__init__()
        self._k_scale = torch.tensor([k_scale], dtype=torch.float32, device=device)
        self._v_scale = torch.tensor([v_scale], dtype=torch.float32, device=device)


def _fp8_step(env, q_lens, seq_lens, *, kv_cache_dtype="fp8", k_scale=0.05, v_scale=0.02,
              v_scale_at_read=None):
    """One step on an FP8 cache: the batch's cached context quantized into a uint8 cache as
    vLLM allocates it, then the impl's KV write and forward (with `v_scale_at_read`, the layer's
    v scale tensor set to it in place between the two). Returns the output and the reference."""
    batch = _batch(env, q_lens, seq_lens)  # fills env's float cache: the context in float32
    md = env.builder.build(0, batch.cm)
    layer = _Layer(env.device, k_scale, v_scale)
    raw = torch.zeros(env.kv_cache.shape, dtype=torch.uint8, device=env.device)
    kv_cache = raw.as_strided(env.kv_cache.shape, env.kv_cache.stride())
    key_cache, value_cache = (c.view(FP8_KV_DTYPE) for c in split_kv_cache(kv_cache, HEAD_SIZE))
    written = torch.isfinite(env.key_cache)  # the context _batch placed
    key_cache[written] = quantize_fp8_kv(env.key_cache[written], layer._k_scale)
    value_cache[written] = quantize_fp8_kv(env.value_cache[written], layer._v_scale)
    impl = MoeGraphsAttentionImpl(**{**QWEN3_IMPL_ARGS, "num_heads": NUM_HEADS,
                                     "num_kv_heads": NUM_KV_HEADS, "head_size": HEAD_SIZE,
                                     "scale": HEAD_SIZE**-0.5, "kv_cache_dtype": kv_cache_dtype})
    n = batch.num_real_tokens
    key = batch.key.view(-1, NUM_KV_HEADS, HEAD_SIZE)
    value = batch.value.view(-1, NUM_KV_HEADS, HEAD_SIZE)
    impl.do_kv_cache_update(layer, key, value, kv_cache, batch.cm.slot_mapping)
    if v_scale_at_read is not None:
        layer._v_scale.fill_(v_scale_at_read)
    query = batch.query.view(-1, NUM_HEADS, HEAD_SIZE)
    out = torch.full_like(query, float("nan"))
    impl.forward(layer, query, key, value, kv_cache, md, out)
    slots = batch.cm.slot_mapping[:n]
    new_k = key_cache[slots // BLOCK_SIZE, slots % BLOCK_SIZE]
    torch.testing.assert_close(new_k.view(torch.uint8),
                               quantize_fp8_kv(key[:n], layer._k_scale).view(torch.uint8),
                               atol=1, rtol=0)  # one e4m3 code: the GPU's division may round
    b = batch.num_real_reqs
    table, lens = batch.cm.block_table_tensor[:b], batch.cm.seq_lens[:b]
    scales = dict(k_scale=layer._k_scale, v_scale=layer._v_scale)
    if max(q_lens) == 1:
        ref = reference_paged_decode(query[:n], key_cache, value_cache, table, lens,
                                     HEAD_SIZE**-0.5, **scales)
    else:
        ref = reference_paged_prefill(query[:n], key_cache, value_cache, table,
                                      batch.cm.query_start_loc[: b + 1], lens, HEAD_SIZE**-0.5,
                                      **scales)
    return out[:n], ref


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3"])
def test_fp8_decode_through_the_impl_matches_the_reference(env, kv_cache_dtype):
    out, ref = _fp8_step(env, [1, 1, 1], [70, 17, 129], kv_cache_dtype=kv_cache_dtype)
    assert torch.isfinite(out).all()
    # float32 model and query: the kernels' own roundings only (the e4m3 rounding is in both)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_fp8_mixed_step_through_the_impl_matches_the_reference(env):
    out, ref = _fp8_step(env, [1, 5, 1], [40, 21, 66])
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_fp8_scales_are_read_from_the_layer(env):
    """The layer's v scale tensor doubled in place after the write: the cached codes stand for
    twice the values, so the output doubles: the impl reads the layer's tensors at run time (as
    a replayed graph must), not constants taken when it was built."""
    out_a, ref_a = _fp8_step(env, [1, 1], [33, 48])
    out_b, ref_b = _fp8_step(env, [1, 1], [33, 48], v_scale_at_read=0.04)
    torch.testing.assert_close(out_a.double(), ref_a, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out_b.double(), ref_b, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out_b, 2 * out_a, atol=2e-5, rtol=2e-5)


def test_an_fp8_cache_without_scales_is_refused(env):
    impl = MoeGraphsAttentionImpl(**{**QWEN3_IMPL_ARGS, "num_heads": NUM_HEADS,
                                     "num_kv_heads": NUM_KV_HEADS, "head_size": HEAD_SIZE,
                                     "scale": HEAD_SIZE**-0.5, "kv_cache_dtype": "fp8"})
    kv_cache = torch.zeros(env.kv_cache.shape, dtype=torch.uint8, device=env.device)
    key = torch.zeros(1, NUM_KV_HEADS, HEAD_SIZE, device=env.device)
    with pytest.raises(AttributeError, match="_k_scale"):
        impl.do_kv_cache_update(torch.nn.Module(), key, key, kv_cache,
                                torch.zeros(1, dtype=torch.int64, device=env.device))
