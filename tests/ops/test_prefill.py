"""Varlen / chunked prefill over the paged cache vs the float64 reference (CPU tier, float32)."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_moe_graphs.ops import PrefillKernelConfig, paged_decode_attention, paged_prefill_attention
from vllm_moe_graphs.ops.reference import reference_paged_prefill

from .conftest import (
    assert_close_to_ref,
    make_block_table,
    make_kv_cache,
    pages_needed,
    poison_tail_slots,
    poisoned,
)

ATOL = RTOL = 2e-5


def _setup(q_lens, seq_lens, group, head_size, block_size, layout, device, num_kv_heads=2,
           extra_tokens=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = pages_needed(seq_lens, block_size) + 2
    max_blocks = max(-(-n // block_size) for n in seq_lens) + 1
    kv = make_kv_cache(layout, num_blocks, block_size, num_kv_heads, head_size, torch.float32,
                       device, gen)
    table = make_block_table(seq_lens, block_size, num_blocks, max_blocks, device, gen)
    poison_tail_slots(kv, table, seq_lens)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32,
                       device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    num_tokens = sum(q_lens) + extra_tokens
    query = torch.randn(num_tokens, group * num_kv_heads, head_size, generator=gen).to(device)
    return kv, table, qsl, lens, query


def _run(kv, table, qsl, lens, query, scale, max_query_len, config=None):
    out = poisoned(query)
    paged_prefill_attention(out, query, kv.key_cache, kv.value_cache, table, qsl, lens, scale,
                            max_query_len=max_query_len, config=config)
    return out


# (group, head_size, block_size, layout, q_lens, seq_lens)
CASES = [
    # prefix context + new tokens, no prefix (q_len == seq_len), a decode row, an empty row
    (1, 64, 16, "nb2", [5, 7, 1, 0], [25, 7, 34, 12]),
    (2, 128, 16, "vllm_nhd", [16, 3], [16, 40]),
    (4, 64, 32, "vllm_hnd", [33, 1, 1], [70, 1, 64]),
    (8, 64, 16, "nb2", [9, 2], [9, 50]),
    (3, 64, 64, "vllm_nhd", [20, 4], [84, 4]),  # non-pow2 group, block size 64
]


@pytest.mark.parametrize("group,head_size,block_size,layout,q_lens,seq_lens", CASES)
def test_prefill_matches_reference(group, head_size, block_size, layout, q_lens, seq_lens, device):
    kv, table, qsl, lens, query = _setup(q_lens, seq_lens, group, head_size, block_size, layout,
                                         device, extra_tokens=3)
    scale = 1.0 / math.sqrt(head_size)
    ref = reference_paged_prefill(query, kv.key_cache, kv.value_cache, table, qsl, lens, scale)
    n = int(qsl[-1])
    for cfg in (None, PrefillKernelConfig(block_m=16, block_n=16)):
        out = _run(kv, table, qsl, lens, query, scale, max(q_lens), cfg)
        assert_close_to_ref(out[:n], ref[:n], ATOL, RTOL, f"config {cfg}")
        assert out[n:].isnan().all(), "rows past query_start_loc[B] must be left alone"


def test_max_query_len_only_picks_the_tile(device):
    # max_query_len sizes BLOCK_Q (and so the grid), never the result: loose bounds work, and
    # so does an understated one (BLOCK_Q 1 with M padded to 16 rows that belong to no token).
    kv, table, qsl, lens, query = _setup([6, 2], [30, 2], 2, 64, 16, "nb2", device)
    ref = reference_paged_prefill(query, kv.key_cache, kv.value_cache, table, qsl, lens, 0.1)
    for mql in (1, 6, 8, 64):
        out = _run(kv, table, qsl, lens, query, 0.1, mql)
        assert_close_to_ref(out, ref, ATOL, RTOL, f"max_query_len {mql}")


def test_all_decode_rows_match_decode_kernel(device):
    seq_lens = [1, 17, 40, 16]
    kv, table, qsl, lens, query = _setup([1] * 4, seq_lens, 4, 64, 16, "vllm_nhd", device)
    pre = _run(kv, table, qsl, lens, query, 0.125, 1)
    dec = poisoned(query)
    paged_decode_attention(dec, query, kv.key_cache, kv.value_cache, table, lens, 0.125)
    assert_close_to_ref(pre, dec, 1e-6, 1e-6)


def test_causal_mask_ignores_future_tokens(device):
    # Changing KV at positions after a query token must not change that token's output.
    kv, table, qsl, lens, query = _setup([8], [20], 2, 64, 16, "nb2", device)
    before = _run(kv, table, qsl, lens, query, 0.125, 8)
    last_page = table[0, 1].long()  # positions 16..19 (the last 4 query tokens)
    kv.key_cache[last_page] += 5.0
    kv.value_cache[last_page] -= 3.0
    after = _run(kv, table, qsl, lens, query, 0.125, 8)
    # query tokens at absolute positions 12..15 are rows 0..3: they cannot see 16..19
    torch.testing.assert_close(after[:4], before[:4], atol=0, rtol=0)
    assert not torch.allclose(after[4:], before[4:])


def test_unsupported_head_size_raises(device):
    q = torch.zeros(2, 2, 256, device=device)
    cache = torch.zeros(2, 16, 2, 256, device=device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 2], dtype=torch.int32, device=device)
    lens = torch.tensor([2], dtype=torch.int32, device=device)
    with pytest.raises(NotImplementedError, match="256"):
        paged_prefill_attention(q.clone(), q, cache, cache, table, qsl, lens, 1.0,
                                max_query_len=2)


def test_a_graph_bucket_launch_serves_any_mix_it_holds(device):
    """What a graph key of a mixed step launches: T_bucket query rows, B_bucket requests and a
    tile (max_query_len) fixed by the key, whatever the step holds. Requests past the real ones
    are padding (q_len 0, seq_len 0, block table row 0), tokens past the real ones belong to no
    request: the real rows equal the unpadded launch's, padding rows are never written."""
    t_bucket, b_bucket, key_max_query_len = 32, 8, 16
    for q_lens, seq_lens in (([5, 1, 9], [12, 30, 9]), ([1, 1, 1, 1, 1], [3, 70, 16, 1, 40]),
                             ([16], [50])):
        kv, table, qsl, lens, query = _setup(q_lens, seq_lens, 2, 64, 16, "vllm_nhd", device,
                                             extra_tokens=t_bucket - sum(q_lens))
        pad = b_bucket - len(q_lens)
        n = int(qsl[-1])
        qsl_pad = torch.cat([qsl, qsl.new_full((pad,), n)])
        lens_pad = torch.cat([lens, lens.new_zeros(pad)])
        table_pad = torch.cat([table, table.new_zeros(pad, table.shape[1])])
        ref = reference_paged_prefill(query, kv.key_cache, kv.value_cache, table, qsl, lens, 0.1)
        out = _run(kv, table_pad, qsl_pad, lens_pad, query, 0.1, key_max_query_len)
        assert_close_to_ref(out[:n], ref[:n], ATOL, RTOL, f"q_lens {q_lens}")
        assert out[n:].isnan().all(), "padding tokens must not be written"
