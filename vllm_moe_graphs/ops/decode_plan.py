"""Host-side planning of the paged decode kernel (`ops/paged_decode.py`): launch config, split
count per bucket, workspace shape and checks. Pure functions of host constants: no tensor data is
read, nothing is launched; `allocate_decode_workspace` is the one allocation, made once outside
any captured region.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# ----------------------------------------------------------------------------- tunables
# All of these are swept by `benchmarks/kernels/attn.py --sweep`; defaults are first guesses for
# an H200 (HBM bound: bytes in flight per SM matter more than FLOPs).
DEFAULT_BLOCK_N = 64  # tokens gathered per loop step (4 pages at BS=16)
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 2
MIN_TOKENS_PER_SPLIT = 64  # one BLOCK_N tile (H200, b1 c512: 8 splits beat 4)
MAX_SPLITS = 64  # upper bound for choose_num_splits (also sizes the reduce tile)
# B * Hkv * S up to this many programs per SM (H200 sweep, b8-64 x c512/2k, both shapes, in
# benchmarks/results/h200-attn-sweep-b8-64.txt: with 2, rounded up, 0.6B b8 ran 5 splits
# where 8 were 8-15% faster)
TARGET_PROGRAMS_PER_SM = 4
REDUCE_NUM_WARPS = 4
WORKSPACE_STATS = 2  # trailing (max, sum) columns of each workspace row


@dataclass(frozen=True, slots=True)
class DecodeKernelConfig:
    """Launch parameters of the split/non-split decode kernel (not of the reduce kernel)."""

    block_n: int = DEFAULT_BLOCK_N
    num_warps: int = DEFAULT_NUM_WARPS
    num_stages: int = DEFAULT_NUM_STAGES

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of 2 >= 16, got {self.block_n}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Split-K factor for a bucket: a pure function of host constants (never of seq_lens).

    The most splits whose (sequence, kv head, split) programs stay within TARGET_PROGRAMS_PER_SM
    per SM (rounded down: one split too many costs more than one too few once the batch alone
    nearly fills the GPU), but no split shorter than MIN_TOKENS_PER_SPLIT tokens of
    `max_context`, and at most MAX_SPLITS. Returns 1 (no split, no workspace needed) when the
    batch already fills the GPU.
    """
    if batch < 1 or num_kv_heads < 1 or num_sms < 1:
        raise ValueError(
            f"batch, num_kv_heads and num_sms must be >= 1, got {batch}, {num_kv_heads}, "
            f"{num_sms}"
        )
    programs = batch * num_kv_heads
    wanted = TARGET_PROGRAMS_PER_SM * num_sms // programs
    by_length = max(1, max_context // MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def decode_workspace_shape(
    max_batch: int, num_q_heads: int, head_size: int, max_splits: int
) -> tuple[int, int, int, int]:
    """[B_ws, Hq, S_ws, D + 2] float32: per split the unnormalised acc, then (max, sum)."""
    return (max_batch, num_q_heads, max_splits, head_size + WORKSPACE_STATS)


def allocate_decode_workspace(
    max_batch: int,
    num_q_heads: int,
    head_size: int,
    max_splits: int,
    device: torch.device | str,
) -> torch.Tensor:
    """Allocate once, at the largest bucket, outside any captured region."""
    # NOTE: allocates; never call it inside a captured region or per step.
    shape = decode_workspace_shape(max_batch, num_q_heads, head_size, max_splits)
    return torch.empty(shape, dtype=torch.float32, device=device)


def check_decode_workspace(
    workspace: torch.Tensor | None,
    batch: int,
    num_q_heads: int,
    head_size: int,
    num_splits: int,
    device: torch.device,
) -> None:
    if workspace is None:
        raise ValueError(
            f"num_splits={num_splits} needs a workspace: allocate_decode_workspace(max_batch, "
            f"{num_q_heads}, {head_size}, max_splits, device) once, outside graph capture"
        )
    need = decode_workspace_shape(batch, num_q_heads, head_size, num_splits)
    ok = (
        workspace.dim() == 4
        and workspace.shape[0] >= need[0]
        and workspace.shape[1] == need[1]
        and workspace.shape[2] >= need[2]
        and workspace.shape[3] == need[3]
        and workspace.stride(3) == 1
    )
    if not ok:
        raise ValueError(
            f"workspace shape {tuple(workspace.shape)} (strides {workspace.stride()}) cannot "
            f"hold {need}: expected [>= {need[0]}, {need[1]}, >= {need[2]}, {need[3]}] with a "
            "unit last stride"
        )
    if workspace.dtype != torch.float32:
        raise ValueError(f"workspace must be float32, got {workspace.dtype}")
    if workspace.device != device:
        raise ValueError(f"workspace is on {workspace.device}, query on {device}")
