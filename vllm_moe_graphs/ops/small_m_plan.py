"""Host-side planning of the small-M GEMM (`ops/small_m_gemm.py`): launch config from
(N, K, SMs), the split-K plan, workspace size and checks. Pure functions of host ints: no tensor
data is read, nothing is launched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_moe_graphs.ops.kv_write import next_power_of_2

MAX_M = 16  # rows per call: the whole M fits one padded tile
BLOCK_M = 16  # the padded M of every tl.dot (the smallest M tl.dot accepts)

# ----------------------------------------------------------------------------- tunables
# All swept by `benchmarks/kernels/gemm.py --sweep`; first guesses for an H200 (HBM bound: the
# weight bytes in flight per SM matter, the MMA work does not).
DEFAULT_BLOCK_N = 64
DEFAULT_BLOCK_K = 128
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 3
TARGET_PROGRAMS_PER_SM = 2  # split K until (N tiles) * S reaches this many programs per SM
MIN_K_TILES_PER_SPLIT = 2  # shorter splits spend more in the pipeline prologue than they win
MAX_SPLITS = 32
DEFAULT_NUM_SMS = 132  # H100/H200 SXM; used only off CUDA (the interpreter) by config=None


@dataclass(frozen=True, slots=True)
class SmallMGemmConfig:
    """Launch parameters of `small_m_linear`. block_k and num_splits fix the K reduction
    order: results are bitwise reproducible for one config, not across configs."""

    block_n: int = DEFAULT_BLOCK_N
    block_k: int = DEFAULT_BLOCK_K
    num_splits: int = 1
    num_warps: int = DEFAULT_NUM_WARPS
    num_stages: int = DEFAULT_NUM_STAGES
    swap_ab: bool = False  # compute out^T = weight @ x^T (weight as the MMA's A operand)

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of 2 >= 16, got {v}")
        if not 1 <= self.num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {self.num_splits}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")


def split_k_plan(k: int, block_k: int, num_splits: int) -> tuple[int, int]:
    """(splits, k_per_split) actually launched: chunks are whole BLOCK_K tiles and none is
    empty, so splits <= num_splits (e.g. K = 3 tiles asked for 2 splits -> 2 chunks of 2, 1)."""
    k_tiles = max(1, math.ceil(k / block_k))
    tiles_per_split = math.ceil(k_tiles / max(1, num_splits))
    return math.ceil(k_tiles / tiles_per_split), tiles_per_split * block_k


def auto_num_splits(n: int, k: int, block_n: int, block_k: int, num_sms: int) -> int:
    """The split rule: enough splits that (N tiles) * S reaches TARGET_PROGRAMS_PER_SM programs
    per SM, but >= MIN_K_TILES_PER_SPLIT BLOCK_K tiles per split and <= MAX_SPLITS splits.
    Rounds the chunk *down* to whole tiles, so S lands at or above the target (the last chunk
    may be shorter), never below it through rounding."""
    k_tiles = math.ceil(k / block_k)
    wanted = math.ceil(TARGET_PROGRAMS_PER_SM * num_sms / math.ceil(n / block_n))
    tiles_per_split = max(
        MIN_K_TILES_PER_SPLIT, k_tiles // wanted, math.ceil(k_tiles / MAX_SPLITS)
    )
    return math.ceil(k_tiles / tiles_per_split)


def choose_small_m_config(m: int, n: int, k: int, num_sms: int) -> SmallMGemmConfig:
    """Config for an [m, k] x [n, k]^T product: a pure function of host ints.

    Default tiles (BLOCK_K shrunk for small K) and `auto_num_splits`. `m` is checked but
    deliberately unused: a config that moved with M would change the K reduction order and
    break bitwise equality of a row across batch sizes (the kernel is weight-bandwidth bound at
    every M <= MAX_M, so M has little to gain here).
    """
    if not 1 <= m <= MAX_M:
        raise ValueError(f"m must be in [1, {MAX_M}], got {m}")
    if n < 1 or k < 1 or num_sms < 1:
        raise ValueError(f"n, k and num_sms must be >= 1, got {n}, {k}, {num_sms}")
    block_n = DEFAULT_BLOCK_N
    block_k = max(16, min(DEFAULT_BLOCK_K, next_power_of_2(k)))
    splits = auto_num_splits(n, k, block_n, block_k, num_sms)
    return SmallMGemmConfig(block_n=block_n, block_k=block_k, num_splits=splits)


def small_m_workspace_numel(max_m: int, n: int, config: SmallMGemmConfig) -> int:
    """float32 elements of workspace that every call with M <= max_m and this N and config
    needs (0 without split-K). Allocate once, outside graph capture, for the largest (M, N)."""
    if not 1 <= max_m <= MAX_M:
        raise ValueError(f"max_m must be in [1, {MAX_M}], got {max_m}")
    return 0 if config.num_splits == 1 else config.num_splits * max_m * n


def device_num_sms(device: torch.device) -> int:
    """SMs of `device` (DEFAULT_NUM_SMS off CUDA, i.e. under the interpreter)."""
    if device.type == "cuda":
        # cached by torch after the first call: no sync, no driver round trip
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


def check_small_m_workspace(
    workspace: torch.Tensor | None,
    m: int,
    n: int,
    cfg: SmallMGemmConfig,
    device: torch.device,
) -> None:
    need = small_m_workspace_numel(max(m, 1), n, cfg)
    if workspace is None:
        raise ValueError(
            f"num_splits={cfg.num_splits} splits K and needs a float32 workspace of >= {need} "
            f"elements: allocate torch.empty(small_m_workspace_numel({MAX_M}, {n}, config), "
            "dtype=torch.float32) once, outside graph capture, or pass a config with "
            "num_splits=1"
        )
    if workspace.dtype != torch.float32:
        raise ValueError(f"workspace must be float32, got {workspace.dtype}")
    if not workspace.is_contiguous() or workspace.numel() < need:
        raise ValueError(
            f"workspace must be contiguous with >= {need} elements (small_m_workspace_numel("
            f"{m}, {n}, config)), got shape {tuple(workspace.shape)} strides {workspace.stride()}"
        )
    if workspace.device != device:
        raise ValueError(f"workspace is on {workspace.device}, x on {device}")
