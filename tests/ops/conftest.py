"""Fixtures for the kernel tests.

Without CUDA the Triton kernels run under the interpreter on CPU tensors: TRITON_INTERPRET must
be set before `vllm_moe_graphs.ops` (i.e. before `@triton.jit` runs) is first imported, which
is why it is set at the top of this file. With CUDA the same CPU-tier tests run on the GPU.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402

POISON_PAGE = 0  # page 0 is NaN-filled and never given to a sequence
LAYOUTS = ("nb2", "vllm_nhd", "vllm_hnd")


def pytest_configure(config: pytest.Config) -> None:
    # Registered here as well as in setup.cfg so `-m gpu` / `-m "not gpu"` work from any rootdir.
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped cleanly without one")
    # Raised inside triton's interpreter (scalar `__index__` on a 1-element array), not by us.
    config.addinivalue_line(
        "filterwarnings", "ignore:Conversion of an array with ndim > 0:DeprecationWarning"
    )




@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class PagedKV:
    kv_cache: torch.Tensor  # the per-layer tensor, in the layout under test
    key_cache: torch.Tensor  # [NB, BS, Hkv, D] view into kv_cache
    value_cache: torch.Tensor  # [NB, BS, Hkv, D] view into kv_cache


def make_kv_cache(
    layout: str,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    generator: torch.Generator | None = None,
) -> PagedKV:
    """Random cache in one of the layouts; page POISON_PAGE holds NaN in K and V.

    nb2:      [NB, 2, BS, Hkv, D] contiguous (views kv[:, 0], kv[:, 1])
    vllm_nhd: vLLM 0.26 TRITON_ATTN default, logical [NB, Hkv, BS, 2D] over a physical
              [NB, BS, Hkv, 2D] buffer (stride order (0, 2, 1, 3))
    vllm_hnd: the same logical shape, physically contiguous (VLLM_KV_CACHE_LAYOUT=HND)
    """
    from vllm_moe_graphs.ops import split_kv_cache

    if layout == "nb2":
        shape = (num_blocks, 2, block_size, num_kv_heads, head_size)
        kv = torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype)
    elif layout == "vllm_nhd":
        shape = (num_blocks, block_size, num_kv_heads, 2 * head_size)
        kv = torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype)
        kv = kv.permute(0, 2, 1, 3)
    elif layout == "vllm_hnd":
        shape = (num_blocks, num_kv_heads, block_size, 2 * head_size)
        kv = torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype)
    else:
        raise ValueError(f"unknown layout {layout}")
    kv = kv.to(device)
    key_cache, value_cache = split_kv_cache(kv, head_size)
    key_cache[POISON_PAGE] = float("nan")
    value_cache[POISON_PAGE] = float("nan")
    return PagedKV(kv, key_cache, value_cache)


def make_block_table(
    seq_lens: list[int],
    block_size: int,
    num_blocks: int,
    max_blocks: int,
    device: torch.device | str,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """[B, max_blocks] int32: distinct random pages per sequence; unused entries -> poison page."""
    table = torch.full((len(seq_lens), max_blocks), POISON_PAGE, dtype=torch.int32)
    free = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    for b, n in enumerate(seq_lens):
        need = -(-n // block_size)
        assert need <= max_blocks and need <= len(free), "test setup: not enough pages"
        table[b, :need] = torch.tensor([free.pop() for _ in range(need)], dtype=torch.int32)
    return table.to(device)


def poison_tail_slots(kv: PagedKV, table: torch.Tensor, seq_lens: list[int]) -> None:
    """NaN into the slots past each sequence's end in its last page (stale data in vLLM)."""
    block_size = kv.key_cache.shape[1]
    for b, n in enumerate(seq_lens):
        if n % block_size:
            page = int(table[b, n // block_size])
            kv.key_cache[page, n % block_size :] = float("nan")
            kv.value_cache[page, n % block_size :] = float("nan")


def pages_needed(seq_lens: list[int], block_size: int) -> int:
    return sum(-(-n // block_size) for n in seq_lens)


def poisoned(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def assert_close_to_ref(
    out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float, what: str = ""
) -> None:
    assert torch.isfinite(out).all(), f"{what}: non-finite output (unwritten or NaN)"
    torch.testing.assert_close(
        out.double(), ref.double(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}"
    )
