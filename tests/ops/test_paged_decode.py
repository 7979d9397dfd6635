"""Paged decode attention vs the float64 reference (CPU interpreter tier, float32)."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_moe_graphs.ops import (
    DecodeKernelConfig,
    allocate_decode_workspace,
    choose_num_splits,
    decode_workspace_shape,
    paged_decode_attention,
)
from vllm_moe_graphs.ops import decode_plan as pd
from vllm_moe_graphs.ops.reference import reference_paged_decode

from .conftest import (
    assert_close_to_ref,
    make_block_table,
    make_kv_cache,
    pages_needed,
    poison_tail_slots,
    poisoned,
)

ATOL = RTOL = 2e-5  # float32 kernels vs float64 reference


def _setup(seq_lens, group, head_size, block_size, layout, device, num_kv_heads=2, extra_rows=0,
           seed=0):
    """Cache, block table and query for `seq_lens`; `extra_rows` pads B_max beyond B."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = pages_needed(seq_lens, block_size) + 3
    max_blocks = max(1, max(-(-n // block_size) for n in seq_lens)) + 1
    kv = make_kv_cache(layout, num_blocks, block_size, num_kv_heads, head_size, torch.float32,
                       device, gen)
    table = make_block_table(list(seq_lens) + [0] * extra_rows, block_size, num_blocks,
                             max_blocks, device, gen)
    poison_tail_slots(kv, table, seq_lens)
    lens = torch.tensor(list(seq_lens) + [0] * extra_rows, dtype=torch.int32, device=device)
    query = torch.randn(len(seq_lens), group * num_kv_heads, head_size, generator=gen).to(device)
    return kv, table, lens, query


def _run(kv, table, lens, query, scale, num_splits=1, config=None):
    out = poisoned(query)
    ws = None
    if num_splits > 1:
        shape = decode_workspace_shape(query.shape[0] + 1, query.shape[1], query.shape[2],
                                       num_splits + 1)
        ws = torch.full(shape, float("nan"), device=query.device)  # larger than needed, poisoned
    paged_decode_attention(out, query, kv.key_cache, kv.value_cache, table, lens, scale,
                           num_splits=num_splits, workspace=ws, config=config)
    return out


# (group, head_size, block_size, layout, num_kv_heads, seq_lens)
CASES = [
    (1, 64, 16, "nb2", 2, [1, 16, 33]),
    (2, 128, 16, "vllm_nhd", 2, [17, 32, 0, 5]),
    (4, 64, 32, "vllm_hnd", 2, [64, 1, 0, 40]),
    (8, 64, 32, "nb2", 1, [31, 96]),
    (16, 64, 16, "vllm_nhd", 1, [48, 7]),
    (3, 64, 16, "nb2", 2, [20, 16]),  # group that is not a power of 2
    (2, 64, 64, "vllm_nhd", 2, [64, 65, 130]),  # block size 64
    (1, 128, 32, "vllm_hnd", 1, [96, 2]),
]


@pytest.mark.parametrize("group,head_size,block_size,layout,num_kv_heads,seq_lens", CASES)
def test_decode_matches_reference(group, head_size, block_size, layout, num_kv_heads, seq_lens,
                                  device):
    kv, table, lens, query = _setup(seq_lens, group, head_size, block_size, layout, device,
                                    num_kv_heads=num_kv_heads, extra_rows=2)
    scale = 1.0 / math.sqrt(head_size)
    ref = reference_paged_decode(query, kv.key_cache, kv.value_cache, table, lens, scale)
    out = _run(kv, table, lens, query, scale, config=DecodeKernelConfig(block_n=32))
    assert_close_to_ref(out, ref, ATOL, RTOL, "non-split")
    out_split = _run(kv, table, lens, query, scale, num_splits=3,
                     config=DecodeKernelConfig(block_n=16))
    assert_close_to_ref(out_split, ref, ATOL, RTOL, "split 3")


@pytest.mark.parametrize("num_splits", [2, 3, 5, 8])
def test_split_equals_unsplit(num_splits, device):
    # 150 tokens with block_n 16: every split count here really cuts the context; seq 20 with
    # 8 splits leaves empty splits, seq 0 leaves all of them empty.
    kv, table, lens, query = _setup([150, 1, 0, 20, 47], 2, 64, 16, "vllm_nhd", device)
    cfg = DecodeKernelConfig(block_n=16)
    whole = _run(kv, table, lens, query, 0.2, config=cfg)
    split = _run(kv, table, lens, query, 0.2, num_splits=num_splits, config=cfg)
    assert_close_to_ref(split, whole, 1e-6, 1e-6, f"{num_splits} splits vs 1")
    ref = reference_paged_decode(query, kv.key_cache, kv.value_cache, table, lens, 0.2)
    assert_close_to_ref(split, ref, ATOL, RTOL, "split vs reference")


@pytest.mark.parametrize("block_n", [16, 32, 64, 128])
def test_block_n_tiles_several_pages(block_n, device):
    # block_n > block_size gathers several pages per step; < block_size reads a page in parts.
    kv, table, lens, query = _setup([70, 33, 128], 4, 64, 32, "nb2", device)
    ref = reference_paged_decode(query, kv.key_cache, kv.value_cache, table, lens, 0.125)
    out = _run(kv, table, lens, query, 0.125, config=DecodeKernelConfig(block_n=block_n))
    assert_close_to_ref(out, ref, ATOL, RTOL, f"block_n {block_n}")


@pytest.mark.parametrize("num_splits", [1, 4])
def test_padded_rows_give_zeros_and_read_no_kv(num_splits, device):
    kv, table, lens, query = _setup([0, 19, 0], 2, 64, 16, "vllm_nhd", device)
    query[0] = float("nan")  # padded rows may carry garbage queries
    query[2] = float("nan")
    out = _run(kv, table, lens, query, 0.125, num_splits=num_splits,
               config=DecodeKernelConfig(block_n=16))
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    ref = reference_paged_decode(query[1:2], kv.key_cache, kv.value_cache, table[1:2],
                                 lens[1:2], 0.125)
    assert_close_to_ref(out[1:2], ref, ATOL, RTOL, "live row next to padded rows")


def test_only_first_b_rows_of_b_max_are_used(device):
    # block_table / seq_lens sized for B_max = 6, query for B = 2: rows 2.. are never touched.
    kv, table, lens, query = _setup([40, 9], 2, 64, 16, "nb2", device, extra_rows=4)
    lens[2:] = 10_000  # would read far outside the table if the kernel looked at them
    ref = reference_paged_decode(query, kv.key_cache, kv.value_cache, table, lens, 0.125)
    out = _run(kv, table, lens, query, 0.125, num_splits=2)
    assert_close_to_ref(out, ref, ATOL, RTOL)


def test_unsupported_head_size_raises(device):
    q = torch.zeros(1, 2, 96, device=device)
    cache = torch.zeros(4, 16, 2, 96, device=device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    lens = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(NotImplementedError, match="96"):
        paged_decode_attention(q.clone(), q, cache, cache, table, lens, 1.0)


def test_unsupported_dtype_raises(device):
    q = torch.zeros(1, 2, 64, dtype=torch.float64, device=device)
    cache = torch.zeros(4, 16, 2, 64, dtype=torch.float64, device=device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    lens = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(NotImplementedError, match="float64"):
        paged_decode_attention(q.clone(), q, cache, cache, table, lens, 1.0)


def test_split_without_or_with_small_workspace_raises(device):
    kv, table, lens, query = _setup([5], 2, 64, 16, "nb2", device)
    args = (poisoned(query), query, kv.key_cache, kv.value_cache, table, lens, 1.0)
    with pytest.raises(ValueError, match="workspace"):
        paged_decode_attention(*args, num_splits=2)
    small = allocate_decode_workspace(1, query.shape[1], 64, 1, device)
    with pytest.raises(ValueError, match="workspace"):
        paged_decode_attention(*args, num_splits=2, workspace=small)


def test_mismatched_dtypes_raise(device):
    kv, table, lens, query = _setup([5], 2, 64, 16, "nb2", device)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention(poisoned(query).half(), query, kv.key_cache, kv.value_cache,
                               table, lens, 1.0)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(poisoned(query), query, kv.key_cache, kv.value_cache,
                               table, lens.long(), 1.0)


def test_workspace_shape_helpers():
    assert decode_workspace_shape(8, 32, 128, 16) == (8, 32, 16, 130)
    ws = allocate_decode_workspace(2, 4, 64, 3, "cpu")
    assert ws.shape == (2, 4, 3, 66) and ws.dtype == torch.float32


class TestChooseNumSplits:
    def test_large_batch_does_not_split(self):
        assert choose_num_splits(256, 8, 32768, 132) == 1
        assert choose_num_splits(64, 4, 32768, 132) == 2

    def test_small_batch_long_context_fills_the_gpu(self):
        s = choose_num_splits(1, 4, 32768, 132)
        assert 1 * 4 * s >= pd.TARGET_PROGRAMS_PER_SM * 132 or s == pd.MAX_SPLITS
        assert s <= pd.MAX_SPLITS

    @pytest.mark.parametrize("batch, kv_heads, context, best", [
        # the fastest split count of the H200 sweep at block_n 64 (132 SMs), where it was clear
        (8, 8, 512, 8), (8, 8, 2048, 8), (16, 8, 2048, 4), (32, 8, 512, 2), (64, 8, 512, 1),
        (64, 8, 2048, 1), (8, 4, 512, 8), (8, 4, 2048, 16), (16, 4, 2048, 8), (32, 4, 512, 4),
        (32, 4, 2048, 4), (64, 4, 2048, 2), (1, 8, 512, 8)])
    def test_matches_the_h200_sweep(self, batch, kv_heads, context, best):
        assert choose_num_splits(batch, kv_heads, context, 132) == best

    def test_short_context_does_not_split(self):
        assert choose_num_splits(1, 8, 100, 132) == 1
        assert choose_num_splits(1, 8, 2 * pd.MIN_TOKENS_PER_SPLIT, 132) == 2

    def test_monotone_in_batch_and_context(self):
        by_batch = [choose_num_splits(b, 8, 8192, 132) for b in (1, 2, 4, 8, 16, 32, 64, 128)]
        assert by_batch == sorted(by_batch, reverse=True)
        by_ctx = [choose_num_splits(4, 8, c, 132) for c in (1, 256, 1024, 4096, 32768)]
        assert by_ctx == sorted(by_ctx)

    def test_rejects_nonsense(self):
        with pytest.raises(ValueError):
            choose_num_splits(0, 8, 1024, 132)


def test_config_validation():
    with pytest.raises(ValueError, match="block_n"):
        DecodeKernelConfig(block_n=24)
