"""CPU tier for the attention backend's run: the forward through vLLM's `unified_kv_cache_update` /
`unified_attention_with_output` into our impl against the float64 references (decode, split-K,
mixed, the prefill kernel on a decode step) and vLLM's profiling run without metadata or cache
(Triton kernels under TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Must precede the first import of vllm_moe_graphs.ops (i.e. of @triton.jit).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import math  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("vllm")

# Raised inside triton's interpreter (scalar `__index__` on a 1-element array), not by us.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning")


from vllm_moe_graphs.integration.attention.backend import MoeGraphsAttentionImpl  # noqa: E402

from tests.attention.backend_env import (  # noqa: E402
    HEAD_SIZE,
    NUM_HEADS,
    NUM_KV_HEADS,
    _assert_kv_written,
    _assert_matches_reference,
    _batch,
    _run_layer,
)


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
