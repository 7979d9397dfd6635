"""GPU tier: the kernels compiled for real, in bf16/fp16, against the float64 reference.

Marked `gpu`; skipped cleanly without CUDA. The decode grid covers batch {1, 7, 64, 256} x
context {1, 100, 2048, 32768} (256 x 32768 pruned: 17 GB of KV for one case), each pair with
two rotating (head size, block size, dtype, GQA) configurations, ragged lengths and padded rows,
both without split and with the split chosen for the bucket. Budget: well under 2 minutes on an
H200, most of it Triton compilation.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from vllm_moe_graphs.ops import (
    allocate_decode_workspace,
    choose_num_splits,
    paged_decode_attention,
    paged_prefill_attention,
    split_kv_cache,
    write_kv,
)
from vllm_moe_graphs.ops.reference import (
    reference_paged_decode,
    reference_paged_prefill,
    reference_write_kv,
)

DEVICE = "cuda"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOL = {torch.bfloat16: (1.5e-2, 1.5e-2), torch.float16: (2e-3, 4e-3)}  # (atol, rtol)
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16}

# (head_size, block_size, dtype, group, num_kv_heads)
CONFIGS = [
    (128, 16, torch.bfloat16, 2, 8),  # Qwen3-0.6B
    (128, 16, torch.bfloat16, 8, 4),  # Qwen3-30B-A3B
    (64, 32, torch.float16, 4, 2),
    (128, 64, torch.float16, 1, 4),
    (64, 16, torch.bfloat16, 16, 1),
    (128, 32, torch.float16, 4, 8),  # Qwen3-8B
    (64, 64, torch.bfloat16, 2, 2),
]
BATCHES = (1, 7, 64, 256)
CONTEXTS = (1, 100, 2048, 32768)
PAIRS = [(b, c) for b, c in itertools.product(BATCHES, CONTEXTS) if not (b == 256 and c == 32768)]
DECODE_CASES = [
    (b, c, CONFIGS[(2 * i + j) % len(CONFIGS)])
    for i, (b, c) in enumerate(PAIRS)
    for j in range(2)
]


def _num_sms() -> int:
    return torch.cuda.get_device_properties(DEVICE).multi_processor_count


def _ragged_lens(batch: int, context: int, block_size: int, gen: torch.Generator) -> list[int]:
    """Random lengths in [1, context] with the bucket max, 1, block multiples and padded rows."""
    lens = torch.randint(1, context + 1, (batch,), generator=gen).tolist()
    specials = [context, 1, min(context, block_size), min(context, 2 * block_size)]
    for i, v in enumerate(specials[: batch]):
        lens[i] = v
    if batch >= 7:
        lens[3] = 0  # padded rows inside the batch
        lens[-1] = 0
    return lens


def _paged(lens, block_size, num_kv_heads, head_size, dtype, gen, extra_rows=0):
    """vLLM 0.26 NHD cache with randomly scattered pages; unused table entries -> page 0."""
    pages = [-(-n // block_size) for n in lens] + [0] * extra_rows
    num_blocks = sum(pages) + 2
    max_blocks = max(max(pages), 1) + 1
    cuda_gen = torch.Generator(device=DEVICE).manual_seed(int(torch.randint(0, 2**31, (1,),
                                                                         generator=gen)))
    raw = torch.randn(num_blocks, block_size, num_kv_heads, 2 * head_size, generator=cuda_gen,
                      device=DEVICE, dtype=torch.float32).to(dtype)
    kv_cache = raw.permute(0, 2, 1, 3)  # logical [NB, Hkv, BS, 2D] like get_kv_cache_shape
    key_cache, value_cache = split_kv_cache(kv_cache, head_size)
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    table = torch.zeros(len(pages), max_blocks, dtype=torch.int32)
    offset = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[offset : offset + n].int()
        offset += n
    return kv_cache, key_cache, value_cache, table.to(DEVICE)


def _cfg_id(cfg) -> str:
    head_size, block_size, dtype, group, num_kv_heads = cfg
    return f"d{head_size}-bs{block_size}-{str(dtype)[6:]}-g{group}-kv{num_kv_heads}"


@pytest.mark.parametrize(
    "batch,context,cfg", DECODE_CASES,
    ids=[f"b{b}-c{c}-{_cfg_id(cfg)}" for b, c, cfg in DECODE_CASES],
)
def test_decode_grid(batch, context, cfg):
    head_size, block_size, dtype, group, num_kv_heads = cfg
    gen = torch.Generator().manual_seed(batch * 100_003 + context)
    lens = _ragged_lens(batch, context, block_size, gen)
    _, kc, vc, table = _paged(lens, block_size, num_kv_heads, head_size, dtype, gen, extra_rows=3)
    seq_lens = torch.tensor(lens + [0, 0, 0], dtype=torch.int32, device=DEVICE)
    query = torch.randn(batch, group * num_kv_heads, head_size, generator=gen).to(DEVICE, dtype)
    scale = 1.0 / math.sqrt(head_size)
    ref = reference_paged_decode(query, kc, vc, table, seq_lens, scale)
    atol, rtol = TOL[dtype]

    splits = choose_num_splits(batch, num_kv_heads, context, _num_sms())
    ws = allocate_decode_workspace(batch, query.shape[1], head_size, max(splits, 2), DEVICE)
    for num_splits in sorted({1, splits, 2 if context >= 2 else 1}):
        out = torch.full_like(query, float("nan"))
        ws.fill_(float("nan"))
        paged_decode_attention(out, query, kc, vc, table, seq_lens, scale,
                               num_splits=num_splits, workspace=ws)
        assert torch.isfinite(out).all(), f"non-finite output with {num_splits} splits"
        torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol,
                                   msg=lambda m: f"num_splits={num_splits}: {m}")
    zero_rows = [i for i, n in enumerate(lens) if n == 0]
    assert (out[zero_rows] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_size,block_size", [(64, 16), (128, 32), (128, 64)])
def test_write_kv_byte_exact(dtype, head_size, block_size):
    gen = torch.Generator().manual_seed(1)
    num_kv_heads, num_tokens, num_blocks = 8, 300, 64
    kv_cache = torch.empty(num_blocks, block_size, num_kv_heads, 2 * head_size, dtype=dtype,
                           device=DEVICE).permute(0, 2, 1, 3)
    bits = kv_cache.view(BITS[dtype])
    bits.copy_(torch.randint(-(2**15), 2**15 - 1, bits.shape, generator=gen,
                             dtype=torch.int16).to(DEVICE))  # every bit pattern, NaNs included
    expected = kv_cache.clone()
    kc, vc = split_kv_cache(kv_cache, head_size)
    ek, ev = split_kv_cache(expected, head_size)
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(DEVICE, dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(DEVICE, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::7] = -1
    slots = slots.to(DEVICE)
    write_kv(key, value, kc, vc, slots)
    reference_write_kv(key, value, ek, ev, slots)
    torch.cuda.synchronize()
    assert torch.equal(kv_cache.view(BITS[dtype]), expected.view(BITS[dtype]))


@pytest.mark.parametrize("cfg", CONFIGS[:4], ids=[_cfg_id(c) for c in CONFIGS[:4]])
def test_prefill_mixed_batch(cfg):
    head_size, block_size, dtype, group, num_kv_heads = cfg
    gen = torch.Generator().manual_seed(7)
    # chunked prefill with prefix, a fresh prompt (q_len == context), decode rows, long prefix
    q_lens = [200, 77, 1, 1, 5, 1]
    seq_lens_l = [900, 77, 1, 3000, 5, 64]
    _, kc, vc, table = _paged(seq_lens_l, block_size, num_kv_heads, head_size, dtype, gen)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32,
                       device=DEVICE)
    seq_lens = torch.tensor(seq_lens_l, dtype=torch.int32, device=DEVICE)
    query = torch.randn(sum(q_lens), group * num_kv_heads, head_size, generator=gen).to(DEVICE,
                                                                                      dtype)
    scale = 1.0 / math.sqrt(head_size)
    out = torch.full_like(query, float("nan"))
    paged_prefill_attention(out, query, kc, vc, table, qsl, seq_lens, scale,
                            max_query_len=max(q_lens))
    ref = reference_paged_prefill(query, kc, vc, table, qsl, seq_lens, scale)
    atol, rtol = TOL[dtype]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)


def _captured(step) -> torch.cuda.CUDAGraph:
    """`step` run once on a side stream (the Triton compiles happen outside the capture), then
    captured into a graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def test_cuda_graph_replay_with_new_lengths_and_tables():
    """Capture write_kv + decode (non-split and split) once, then replay on new data in place."""
    head_size, block_size, dtype, group, num_kv_heads = 128, 16, torch.bfloat16, 4, 4
    batch, max_context = 8, 4096
    num_q_heads = group * num_kv_heads
    max_blocks = max_context // block_size
    num_blocks = batch * max_blocks + 1
    gen = torch.Generator().manual_seed(3)
    kv_cache = torch.randn(num_blocks, block_size, num_kv_heads, 2 * head_size, generator=gen,
                           dtype=torch.float32).to(DEVICE, dtype).permute(0, 2, 1, 3)
    kc, vc = split_kv_cache(kv_cache, head_size)
    splits = max(2, choose_num_splits(batch, num_kv_heads, max_context, _num_sms()))
    ws = allocate_decode_workspace(batch, num_q_heads, head_size, splits, DEVICE)
    scale = 1.0 / math.sqrt(head_size)

    # static buffers: addresses never change, contents are rewritten before each replay
    query = torch.zeros(batch, num_q_heads, head_size, dtype=dtype, device=DEVICE)
    new_k = torch.zeros(batch, num_kv_heads, head_size, dtype=dtype, device=DEVICE)
    new_v = torch.zeros_like(new_k)
    slot_mapping = torch.full((batch,), -1, dtype=torch.int64, device=DEVICE)
    seq_lens = torch.ones(batch, dtype=torch.int32, device=DEVICE)  # small at capture
    table = torch.zeros(batch, max_blocks, dtype=torch.int32, device=DEVICE)
    out_whole = torch.zeros_like(query)
    out_split = torch.zeros_like(query)

    def step():
        write_kv(new_k, new_v, kc, vc, slot_mapping)
        paged_decode_attention(out_whole, query, kc, vc, table, seq_lens, scale)
        paged_decode_attention(out_split, query, kc, vc, table, seq_lens, scale,
                               num_splits=splits, workspace=ws)

    graph = _captured(step)

    for round_ in range(3):
        lens = torch.randint(1, max_context + 1, (batch,), generator=gen)
        lens[round_] = 0  # a padded row
        lens[-1] = max_context
        perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).int()
        table.copy_(perm[: batch * max_blocks].view(batch, max_blocks))
        pos = (lens - 1).clamp(min=0)  # the new token is the last one of each sequence
        slots = table.cpu()[torch.arange(batch), pos // block_size].long() * block_size
        slots += pos % block_size
        slots[lens == 0] = -1
        slot_mapping.copy_(slots)
        seq_lens.copy_(lens.int())
        query.copy_(torch.randn(query.shape, generator=gen).to(dtype))
        new_k.copy_(torch.randn(new_k.shape, generator=gen).to(dtype))
        new_v.copy_(torch.randn(new_v.shape, generator=gen).to(dtype))
        out_whole.fill_(float("nan"))
        out_split.fill_(float("nan"))
        expected_cache = kv_cache.clone()
        ek, ev = split_kv_cache(expected_cache, head_size)
        reference_write_kv(new_k, new_v, ek, ev, slot_mapping)

        graph.replay()
        torch.cuda.synchronize()

        assert torch.equal(kv_cache.view(torch.int16), expected_cache.view(torch.int16))
        ref = reference_paged_decode(query, kc, vc, table, seq_lens, scale)
        atol, rtol = TOL[dtype]
        for name, out in (("whole", out_whole), ("split", out_split)):
            assert torch.isfinite(out).all(), f"round {round_} {name}: non-finite"
            torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol,
                                       msg=lambda m: f"round {round_} {name}: {m}")
        assert (out_whole[round_] == 0).all() and (out_split[round_] == 0).all()


def test_prefill_graph_replays_any_mix_of_its_bucket():
    """One capture of the varlen kernel at a bucket (T query rows, B requests, a fixed tile),
    replayed for mixes it was not captured with: chunked prefill with a cached prefix, fresh
    prompts, decode rows, fewer requests than B (the rest padding: q_len 0, seq_len 0). The grid
    is a function of the bucket only; each program finds its request in the persistent
    query_start_loc, so every replay matches the reference on the real rows and leaves the
    padding rows alone."""
    head_size, block_size, dtype, group, num_kv_heads = 128, 16, torch.bfloat16, 4, 4
    t_bucket, b_bucket, key_max_query_len, max_context = 256, 8, 64, 2048
    gen = torch.Generator().manual_seed(11)
    max_blocks = max_context // block_size
    num_blocks = b_bucket * max_blocks + 1
    kv_cache = torch.randn(num_blocks, block_size, num_kv_heads, 2 * head_size, generator=gen,
                           dtype=torch.float32).to(DEVICE, dtype).permute(0, 2, 1, 3)
    kc, vc = split_kv_cache(kv_cache, head_size)
    scale = 1.0 / math.sqrt(head_size)
    query = torch.zeros(t_bucket, group * num_kv_heads, head_size, dtype=dtype, device=DEVICE)
    out = torch.zeros_like(query)
    qsl = torch.zeros(b_bucket + 1, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.zeros(b_bucket, dtype=torch.int32, device=DEVICE)
    table = torch.zeros(b_bucket, max_blocks, dtype=torch.int32, device=DEVICE)

    def step():
        paged_prefill_attention(out, query, kc, vc, table, qsl, seq_lens, scale,
                                max_query_len=key_max_query_len)

    graph = _captured(step)

    mixes = [([200, 1, 1, 1], [1500, 40, 1, 2048]),  # a chunk with a prefix next to decodes
             ([64, 64, 64, 64], [64, 128, 64, 1000]),  # prompts and chunks, no decode row
             ([1] * 8, [7, 2048, 1, 500, 33, 16, 17, 900]),  # all decode, every row real
             ([3], [3])]  # one short prompt, seven padding requests
    for q_lens, lens in mixes:
        n, pad = sum(q_lens), b_bucket - len(q_lens)
        starts = [0] + torch.tensor(q_lens).cumsum(0).tolist()
        qsl.copy_(torch.tensor(starts + [n] * pad, dtype=torch.int32))
        seq_lens.copy_(torch.tensor(lens + [0] * pad, dtype=torch.int32))
        perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).int()
        table.copy_(perm[: b_bucket * max_blocks].view(b_bucket, max_blocks))
        query.copy_(torch.randn(query.shape, generator=gen).to(dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_paged_prefill(query[:n], kc, vc, table[:len(q_lens)],
                                      qsl[:len(q_lens) + 1], seq_lens[:len(q_lens)], scale)
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(out[:n].double(), ref, atol=atol, rtol=rtol)
        assert out[n:].isnan().all(), f"padding rows written for {q_lens}"
