"""KV write: byte-exact scatter into the paged cache, padding slots skipped."""

from __future__ import annotations

import pytest
import torch

from vllm_moe_graphs.ops import split_kv_cache, write_kv
from vllm_moe_graphs.ops.reference import reference_write_kv

from .conftest import LAYOUTS, make_kv_cache

_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _random_bytes_cache(kv: torch.Tensor) -> None:
    """Fill a cache with random bit patterns (NaNs and infs included) in place."""
    bits = kv.view(_BITS[kv.dtype])
    info = torch.iinfo(bits.dtype)
    bits.copy_(torch.randint(info.min, info.max, bits.shape, dtype=bits.dtype))


def _slots(num_tokens: int, num_blocks: int, block_size: int, pad_every: int) -> torch.Tensor:
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[::pad_every] = -1
    return slots.to(torch.int64)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "dtype,head_size,block_size,num_kv_heads",
    [
        (torch.float32, 64, 16, 2),
        (torch.bfloat16, 128, 32, 1),
        (torch.float16, 64, 64, 3),  # head count that is not a power of 2
    ],
)
def test_write_kv_byte_exact_and_skips_padding(layout, dtype, head_size, block_size,
                                               num_kv_heads, device):
    torch.manual_seed(0)
    kv = make_kv_cache(layout, 6, block_size, num_kv_heads, head_size, dtype, device)
    _random_bytes_cache(kv.kv_cache)  # poison: every byte not written must stay as it is
    expected = kv.kv_cache.clone()
    exp_k, exp_v = split_kv_cache(expected, head_size)

    num_tokens = 11
    key = torch.randn(num_tokens, num_kv_heads, head_size).to(dtype).to(device)
    value = torch.randn(num_tokens, num_kv_heads, head_size).to(dtype).to(device)
    key[1, 0, 3] = float("nan")  # payloads travel as bits, not values
    slots = _slots(num_tokens, 6, block_size, pad_every=4).to(device)
    assert (slots == -1).sum() == 3

    write_kv(key, value, kv.key_cache, kv.value_cache, slots)
    reference_write_kv(key, value, exp_k, exp_v, slots)
    bits = _BITS[dtype]
    assert torch.equal(kv.kv_cache.view(bits), expected.view(bits))
    # and the written rows are really there
    live = slots[slots >= 0]
    blk, off = live // block_size, live % block_size
    assert torch.equal(kv.key_cache[blk, off].view(bits), key[slots >= 0].view(bits))
    assert torch.equal(kv.value_cache[blk, off].view(bits), value[slots >= 0].view(bits))


def test_write_kv_from_strided_qkv_views(device):
    # vLLM hands K and V over as column slices of the fused qkv projection.
    num_tokens, hq, hkv, d, bs = 5, 4, 2, 64, 16
    kv = make_kv_cache("vllm_nhd", 4, bs, hkv, d, torch.float32, device)
    _random_bytes_cache(kv.kv_cache)
    expected = kv.kv_cache.clone()
    exp_k, exp_v = split_kv_cache(expected, d)
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, device=device)
    _, key, value = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    key, value = key.view(num_tokens, hkv, d), value.view(num_tokens, hkv, d)
    assert not key.is_contiguous()
    slots = torch.tensor([3, -1, 17, 40, 63], dtype=torch.int64, device=device)
    write_kv(key, value, kv.key_cache, kv.value_cache, slots)
    reference_write_kv(key, value, exp_k, exp_v, slots)
    assert torch.equal(kv.kv_cache.view(torch.int32), expected.view(torch.int32))


def test_all_padding_writes_nothing(device):
    kv = make_kv_cache("nb2", 3, 16, 2, 64, torch.float16, device)
    _random_bytes_cache(kv.kv_cache)
    before = kv.kv_cache.clone()
    key = torch.randn(4, 2, 64, device=device).half()
    write_kv(key, key, kv.key_cache, kv.value_cache,
             torch.full((4,), -1, dtype=torch.int64, device=device))
    assert torch.equal(kv.kv_cache.view(torch.int16), before.view(torch.int16))


def test_dtype_mismatch_raises(device):
    kv = make_kv_cache("nb2", 3, 16, 2, 64, torch.bfloat16, device)
    key = torch.randn(2, 2, 64, device=device)  # float32 into a bf16 cache
    slots = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="float32"):
        write_kv(key, key, kv.key_cache, kv.value_cache, slots)


def test_slot_mapping_must_be_int64(device):
    kv = make_kv_cache("nb2", 3, 16, 2, 64, torch.float32, device)
    key = torch.randn(2, 2, 64, device=device)
    with pytest.raises(ValueError, match="int64"):
        write_kv(key, key, kv.key_cache, kv.value_cache,
                 torch.zeros(2, dtype=torch.int32, device=device))


def test_unsupported_head_size_raises(device):
    cache = torch.zeros(2, 16, 2, 80, device=device)
    key = torch.zeros(1, 2, 80, device=device)
    with pytest.raises(NotImplementedError, match="80"):
        write_kv(key, key, cache, cache, torch.zeros(1, dtype=torch.int64, device=device))


def test_split_kv_cache_rejects_unknown_shape():
    with pytest.raises(ValueError, match="unrecognised"):
        split_kv_cache(torch.zeros(2, 16, 2, 100), 64)
