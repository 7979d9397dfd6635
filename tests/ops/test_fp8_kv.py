"""FP8 e4m3 KV cache (vLLM 0.26 `--kv-cache-dtype fp8`): the write quantizes as vLLM does, decode
and prefill read the cache through k_scale / v_scale, the scales are read from their tensors at
run time, and what is not supported raises naming it.

Query dtypes on the CPU tier: float32 and float16. bfloat16 runs with CUDA only: the
interpreter's tl.dot multiplies bf16 tiles as their raw uint16 bits.
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm_moe_graphs.ops import (
    FP8_KV_DTYPE,
    SUPPORTED_DTYPES,
    SUPPORTED_KV_CACHE_DTYPES,
    DecodeKernelConfig,
    PrefillKernelConfig,
    decode_workspace_shape,
    paged_decode_attention,
    paged_prefill_attention,
    split_kv_cache,
    write_kv,
)
from vllm_moe_graphs.ops.reference import (
    quantize_fp8_kv,
    reference_paged_decode,
    reference_paged_prefill,
    reference_write_kv,
)

from .conftest import (
    LAYOUTS,
    assert_close_to_ref,
    make_block_table,
    make_kv_cache,
    pages_needed,
    poison_tail_slots,
    poisoned,
)

CUDA = torch.cuda.is_available()
QUERY_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
K_SCALE, V_SCALE = 0.37, 1.5  # not powers of 2: fp8 * scale is rounded to the query dtype

# Tolerances against the float64 reference on the *same* FP8 cache, which it reads as
# fp8.to(float32) * scale: the write's e4m3 rounding is in both, so only the kernel's own
# arithmetic differs. With u the query dtype's unit roundoff (2^-24 float32, 2^-11 float16,
# 2^-9 bfloat16) the kernel rounds each dequantized K and V element, P before P @ V and the
# output, each by <= u relative. The output's own rounding is <= u|o| (the rtol); P's and V's
# are averaged by the softmax, <= 2u * |V| (|V| <= 1.5 * 4.5 here); K's moves a score by
# u * scale * sum_d |q_d k_d|, ~0.4u for independent roundings (q ~ N(0, 1), K = 0.37 codes,
# codes ~ N(0, 1)), and the output by twice that times |V - o|. Independent roundings do not all
# point one way (that worst case is ~100u * max|V|): atol = rtol = 8u, where the worst measured
# over 8 seeds of these cases is 1.3u (float16). float32 keeps the existing 2e-5; bfloat16 runs
# on a GPU only and gets 8 * 2^-8 (2u: not run on the CPU tier, so with margin).
TOL = {torch.float32: 2e-5, torch.float16: 8 * 2.0**-11, torch.bfloat16: 8 * 2.0**-8}


def _scales(device, k=K_SCALE, v=V_SCALE):
    return (torch.tensor([k], dtype=torch.float32, device=device),
            torch.tensor([v], dtype=torch.float32, device=device))


def _codes_match(out: torch.Tensor, ref: torch.Tensor) -> None:
    """FP8 caches equal byte for byte. On a GPU, x / scale is Triton's approximate division
    (div.full.f32, as in vLLM's own write), which may move a quotient within 2 ulp of an e4m3
    rounding tie to the other side: there a neighbouring code is accepted."""
    a, b = out.view(torch.uint8), ref.view(torch.uint8)
    if not CUDA:
        assert torch.equal(a, b), f"{(a != b).sum()} bytes differ"
        return
    diff = (out.float() - ref.float()).abs()
    step = ref.float().abs().clamp(min=2.0**-6) * 2.0**-3  # one e4m3 ulp
    assert ((a == b) | (diff <= step)).all() and (a != b).float().mean() < 1e-3


# ----------------------------------------------------------------------------- write


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
def test_write_kv_quantizes_as_vllm(layout, dtype, device):
    """e4m3(x / scale), nearest even at ties, saturating at +-448 for large values, subnormals,
    signed zeros; padding slots skipped and every other byte left alone."""
    torch.manual_seed(0)
    hkv, d, bs = 2, 64, 16
    kv = make_kv_cache(layout, 5, bs, hkv, d, FP8_KV_DTYPE, device)
    kv.kv_cache.view(torch.uint8).copy_(torch.randint(0, 256, kv.kv_cache.shape,
                                                      dtype=torch.uint8))
    expected = kv.kv_cache.clone()
    exp_k, exp_v = split_kv_cache(expected, d)
    k_scale, v_scale = _scales(device)
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_KV_DTYPE).float()
    codes = codes[codes.isfinite()].unique()
    ties = (codes[1:] + codes[:-1]) / 2  # midpoints between neighbouring e4m3 values
    num_tokens = 9
    key = torch.randn(num_tokens, hkv, d) * torch.tensor([1.0, 1e-2, 1e-3, 200.0]).repeat(
        num_tokens * hkv * d // 4).view(num_tokens, hkv, d)  # normal, subnormal, saturating
    key[0, 0, :2] = torch.tensor([0.0, -0.0])
    value = torch.randn(num_tokens, hkv, d) * 300.0
    value[2:5].view(-1)[: ties.numel()] = ties * V_SCALE  # exact in each dtype, so is / 1.5
    key, value = key.to(dtype).to(device), value.to(dtype).to(device)
    slots = torch.tensor([3, -1, 17, 40, 79, -1, 0, 33, 64], dtype=torch.int64, device=device)

    write_kv(key, value, kv.key_cache, kv.value_cache, slots, k_scale, v_scale)
    reference_write_kv(key, value, exp_k, exp_v, slots, k_scale, v_scale)
    _codes_match(kv.kv_cache, expected)
    live = slots[slots >= 0]
    written = kv.value_cache[live // bs, live % bs].float()
    assert written.abs().max() == 448.0, "values past 448 * v_scale saturate"


def test_write_kv_reads_the_scales_at_run_time(device):
    """The launch holds the scale tensors, not their values: a new value in the same tensor
    (what a captured graph replays) changes what is written."""
    kv = make_kv_cache("vllm_nhd", 3, 16, 2, 64, FP8_KV_DTYPE, device)
    key = torch.randn(4, 2, 64, device=device)
    slots = torch.arange(4, dtype=torch.int64, device=device)
    k_scale, v_scale = _scales(device)

    def launch() -> None:
        write_kv(key, key, kv.key_cache, kv.value_cache, slots, k_scale, v_scale)

    launch()
    _codes_match(kv.key_cache[0, :4], quantize_fp8_kv(key, k_scale))
    k_scale.fill_(0.05)
    launch()
    _codes_match(kv.key_cache[0, :4], quantize_fp8_kv(key, torch.tensor(0.05)))
    _codes_match(kv.value_cache[0, :4], quantize_fp8_kv(key, v_scale))


# ----------------------------------------------------------------------------- read


def _setup(seq_lens, q_rows, group, head_size, block_size, layout, qdtype, device,
           num_kv_heads=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = pages_needed(seq_lens, block_size) + 2
    max_blocks = max(-(-n // block_size) for n in seq_lens) + 1
    kv = make_kv_cache(layout, num_blocks, block_size, num_kv_heads, head_size, FP8_KV_DTYPE,
                       device, gen)  # codes ~ N(0, 1) in e4m3; page 0 holds e4m3 NaN
    table = make_block_table(seq_lens, block_size, num_blocks, max_blocks, device, gen)
    poison_tail_slots(kv, table, seq_lens)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    query = torch.randn(q_rows, group * num_kv_heads, head_size, generator=gen)
    return kv, table, lens, query.to(qdtype).to(device)


def _decode(kv, table, lens, query, k_scale, v_scale, num_splits, out=None):
    out = poisoned(query) if out is None else out
    ws = None
    if num_splits > 1:
        ws = torch.empty(decode_workspace_shape(*query.shape[:2], query.shape[2], num_splits),
                         device=query.device)
    return paged_decode_attention(out, query, kv.key_cache, kv.value_cache, table, lens,
                                  query.shape[-1] ** -0.5, num_splits=num_splits, workspace=ws,
                                  config=DecodeKernelConfig(block_n=16), k_scale=k_scale,
                                  v_scale=v_scale)


# (group, head_size, block_size, layout, seq_lens): multiply-reduce (G 1), tl.dot (G 4),
# a group that is not a power of 2, block size 64, a padded row
DECODE_CASES = [
    (1, 64, 16, "nb2", [1, 33, 0]),
    (4, 128, 16, "vllm_nhd", [17, 40]),
    (3, 64, 64, "vllm_hnd", [70, 5]),
]


@pytest.mark.parametrize("qdtype", QUERY_DTYPES)
@pytest.mark.parametrize("group,head_size,block_size,layout,seq_lens", DECODE_CASES)
def test_decode_on_fp8_cache_matches_reference(group, head_size, block_size, layout, seq_lens,
                                               qdtype, device):
    kv, table, lens, query = _setup(seq_lens, len(seq_lens), group, head_size, block_size,
                                    layout, qdtype, device)
    k_scale, v_scale = _scales(device)
    ref = reference_paged_decode(query, kv.key_cache, kv.value_cache, table, lens,
                                 head_size ** -0.5, k_scale=k_scale, v_scale=v_scale)
    for splits in (1, 3):
        out = _decode(kv, table, lens, query, k_scale, v_scale, splits)
        assert out.dtype == qdtype
        assert_close_to_ref(out, ref, TOL[qdtype], TOL[qdtype], f"{qdtype} splits {splits}")


# (group, head_size, block_size, layout, q_lens, seq_lens): prefix + new tokens, no prefix,
# a decode row; a non-pow2 group at block size 64
PREFILL_CASES = [
    (2, 64, 16, "vllm_nhd", [5, 7, 1], [25, 7, 34]),
    (3, 128, 64, "nb2", [20, 4], [84, 4]),
]


def _prefill(kv, table, lens, query, q_lens, k_scale, v_scale, config=None):
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32,
                       device=query.device)
    out = poisoned(query)
    paged_prefill_attention(out, query, kv.key_cache, kv.value_cache, table, qsl, lens,
                            query.shape[-1] ** -0.5, max_query_len=max(q_lens), config=config,
                            k_scale=k_scale, v_scale=v_scale)
    return out, qsl


@pytest.mark.parametrize("qdtype", QUERY_DTYPES)
@pytest.mark.parametrize("group,head_size,block_size,layout,q_lens,seq_lens", PREFILL_CASES)
def test_prefill_on_fp8_cache_matches_reference(group, head_size, block_size, layout, q_lens,
                                                seq_lens, qdtype, device):
    kv, table, lens, query = _setup(seq_lens, sum(q_lens), group, head_size, block_size,
                                    layout, qdtype, device)
    k_scale, v_scale = _scales(device)
    for cfg in (None, PrefillKernelConfig(block_m=16, block_n=16)):
        out, qsl = _prefill(kv, table, lens, query, q_lens, k_scale, v_scale, cfg)
        ref = reference_paged_prefill(query, kv.key_cache, kv.value_cache, table, qsl, lens,
                                      head_size ** -0.5, k_scale=k_scale, v_scale=v_scale)
        assert out.dtype == qdtype
        assert_close_to_ref(out, ref, TOL[qdtype], TOL[qdtype], f"{qdtype} {cfg}")


def test_attention_reads_the_scales_at_run_time(device):
    """New values in the same scale tensors (a graph replay) change decode and prefill: V twice
    as large doubles the output, a new k_scale gives the reference at that scale."""
    kv, table, lens, query = _setup([40, 9], 2, 4, 64, 16, "vllm_nhd", torch.float32, device)
    k_scale, v_scale = _scales(device)
    out = poisoned(query)
    first = _decode(kv, table, lens, query, k_scale, v_scale, 2, out=out).clone()
    v_scale.mul_(2.0)
    torch.testing.assert_close(_decode(kv, table, lens, query, k_scale, v_scale, 2, out=out),
                               2.0 * first, atol=1e-5, rtol=1e-5)
    k_scale.fill_(1.1)
    ref = reference_paged_decode(query, kv.key_cache, kv.value_cache, table, lens, 0.125,
                                 k_scale=k_scale, v_scale=v_scale)
    assert_close_to_ref(_decode(kv, table, lens, query, k_scale, v_scale, 2, out=out), ref,
                        TOL[torch.float32], TOL[torch.float32], "decode after k_scale 1.1")
    q_lens = [1, 9]
    before, qsl = _prefill(kv, table, lens, query.repeat(5, 1, 1)[:10], q_lens, k_scale, v_scale)
    v_scale.mul_(0.5)
    after, _ = _prefill(kv, table, lens, query.repeat(5, 1, 1)[:10], q_lens, k_scale, v_scale)
    torch.testing.assert_close(after, 0.5 * before, atol=1e-5, rtol=1e-5)


def test_write_then_attend_round_trip(device):
    """K/V written by write_kv and read by decode give what vLLM's semantics give (the reference
    quantizes and attends) within TOL, and stay within a first-order bound of the unquantized
    attention derived from the e4m3 rounding: an element x moves by at most
    2^-4 * max(|x|, 2^-6 * scale) (3 mantissa bits, nearest; subnormals below 2^-6), so a score
    s_j moves by ds <= 2^-4 * softmax scale * sum_d |q_d| (|k_jd| + 2^-6 * k_scale), and the
    output by <= 2^-4 * max(|V|, 2^-6 * v_scale) + 2 * max_j ds * max_j |v_j - o|."""
    hkv, d, bs, seq_lens, sm_scale = 2, 64, 16, [48, 13], 0.125
    kv, table, lens, query = _setup(seq_lens, 2, 2, d, bs, "vllm_nhd", torch.float32, device)
    gen = torch.Generator().manual_seed(1)
    key = (torch.randn(sum(seq_lens), hkv, d, generator=gen) * 0.5).to(device)
    value = torch.randn(sum(seq_lens), hkv, d, generator=gen).to(device)
    slots = torch.stack([table[b, p // bs] * bs + p % bs
                         for b, n in enumerate(seq_lens) for p in range(n)]).to(torch.int64)
    k_scale, v_scale = _scales(device, k=0.5 / 64, v=1.0 / 64)  # |x| / scale up to ~300
    expected = kv.kv_cache.clone()
    exp_k, exp_v = split_kv_cache(expected, d)
    write_kv(key, value, kv.key_cache, kv.value_cache, slots, k_scale, v_scale)
    reference_write_kv(key, value, exp_k, exp_v, slots, k_scale, v_scale)
    _codes_match(kv.kv_cache, expected)
    out = _decode(kv, table, lens, query, k_scale, v_scale, 2)
    ref = reference_paged_decode(query, exp_k, exp_v, table, lens, sm_scale, k_scale=k_scale,
                                 v_scale=v_scale)
    assert_close_to_ref(out, ref, TOL[torch.float32], TOL[torch.float32], "vLLM semantics")

    exact = make_kv_cache("vllm_nhd", kv.key_cache.shape[0], bs, hkv, d, torch.float32, device)
    reference_write_kv(key, value, exact.key_cache, exact.value_cache, slots)
    unquantized = reference_paged_decode(query, exact.key_cache, exact.value_cache, table, lens,
                                         sm_scale)
    start = 0
    for b, n in enumerate(seq_lens):
        k, v = key[start:start + n].double(), value[start:start + n].double()  # [n, Hkv, D]
        start += n
        q = query[b].double().view(hkv, -1, d)  # [Hkv, G, D]
        k_abs = k.abs() + 2.0**-6 * k_scale.item()
        ds = 2.0**-4 * sm_scale * torch.einsum("hgd,nhd->hgn", q.abs(), k_abs).max()
        v_max = max(v.abs().max().item(), 2.0**-6 * v_scale.item())
        bound = 2.0**-4 * v_max + 2 * ds.item() * 2 * v.abs().max().item()
        err = (out[b].double() - unquantized[b]).abs().max().item()
        assert 1e-4 < err <= bound, f"seq {b}: FP8 error {err} outside (1e-4, {bound}]"


# ----------------------------------------------------------------------------- errors


def _io(cache_dtype, device, query_dtype=torch.float16):
    cache = torch.zeros(4, 16, 2, 64, device=device).to(cache_dtype)
    query = torch.zeros(1, 4, 64, device=device).to(query_dtype)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    lens = torch.ones(1, dtype=torch.int32, device=device)
    return query.clone(), query, cache, cache, table, lens, 0.125


def test_supported_dtype_constants():
    assert FP8_KV_DTYPE == torch.float8_e4m3fn
    assert FP8_KV_DTYPE in SUPPORTED_KV_CACHE_DTYPES and FP8_KV_DTYPE not in SUPPORTED_DTYPES
    assert set(SUPPORTED_DTYPES) < set(SUPPORTED_KV_CACHE_DTYPES)


@pytest.mark.parametrize("cache_dtype,match", [
    (torch.float8_e5m2, "float8_e5m2.*float8_e4m3fn"),
    (torch.int8, "torch.int8.*float8_e4m3fn"),
    (torch.uint8, "uint8.*view"),
])
def test_unsupported_cache_dtypes_raise(cache_dtype, match, device):
    args = _io(cache_dtype, device)
    k_scale, v_scale = _scales(device)
    with pytest.raises(NotImplementedError, match=match):
        paged_decode_attention(*args, k_scale=k_scale, v_scale=v_scale)
    out, query, cache, _, table, lens, scale = args
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=device)
    with pytest.raises(NotImplementedError, match=match):
        paged_prefill_attention(out, query, cache, cache, table, qsl, lens, scale,
                                max_query_len=1, k_scale=k_scale, v_scale=v_scale)
    rows = torch.zeros(1, 2, 64, device=device)
    with pytest.raises(NotImplementedError, match=match):
        write_kv(rows, rows, cache, cache, torch.zeros(1, dtype=torch.int64, device=device),
                 k_scale, v_scale)


@pytest.mark.parametrize("k_scale,match", [
    (None, "float8_e4m3fn KV cache needs k_scale"),
    (0.5, "k_scale.*got float"),
    (torch.tensor([0.5], dtype=torch.float64), "k_scale must be a float32 tensor of one elem"),
    (torch.ones(2), "k_scale must be a float32 tensor of one element.*shape \\(2,\\)"),
])
def test_fp8_cache_needs_scale_tensors(k_scale, match, device):
    k_scale = k_scale.to(device) if isinstance(k_scale, torch.Tensor) else k_scale
    _, v_scale = _scales(device)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(*_io(FP8_KV_DTYPE, device), k_scale=k_scale, v_scale=v_scale)
    rows = torch.zeros(1, 2, 64, device=device)
    cache = _io(FP8_KV_DTYPE, device)[2]
    with pytest.raises(ValueError, match=match):
        write_kv(rows, rows, cache, cache, torch.zeros(1, dtype=torch.int64, device=device),
                 k_scale, v_scale)


def test_fp8_queries_and_rows_are_refused(device):
    k_scale, v_scale = _scales(device)
    with pytest.raises(NotImplementedError, match="float8_e4m3fn.*queries"):
        paged_decode_attention(*_io(FP8_KV_DTYPE, device, FP8_KV_DTYPE), k_scale=k_scale,
                               v_scale=v_scale)
    cache = _io(FP8_KV_DTYPE, device)[2]
    rows = torch.zeros(1, 2, 64, dtype=torch.float64, device=device)
    with pytest.raises(NotImplementedError, match="float64"):
        write_kv(rows, rows, cache, cache, torch.zeros(1, dtype=torch.int64, device=device),
                 k_scale, v_scale)


def test_unquantized_cache_ignores_scales_and_checks_dtypes(device):
    """As in vLLM, the scales of an unquantized cache are not read; its dtype must still be the
    query's."""
    args = _io(torch.float32, device, torch.float32)
    k_scale, v_scale = _scales(device)
    out = paged_decode_attention(*args, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(out, torch.zeros_like(out))
    with pytest.raises(ValueError, match="dtypes must match"):
        paged_decode_attention(*_io(torch.float32, device, torch.float16), k_scale=k_scale,
                               v_scale=v_scale)
