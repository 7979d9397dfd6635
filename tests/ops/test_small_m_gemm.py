"""Small-M GEMM (decode linear layers) vs torch: CPU interpreter tier in float32, GPU tier in
bf16/fp16 at the Qwen3 decode shapes, and the benchmark's CPU-side CLI."""

from __future__ import annotations

import math
import pathlib
import subprocess
import sys

import pytest
import torch

from vllm_moe_graphs.ops import (
    SmallMGemmConfig,
    choose_small_m_config,
    small_m_linear,
    small_m_workspace_numel,
)
from vllm_moe_graphs.ops import small_m_plan as smg

from .conftest import assert_close_to_ref, poisoned

REPO = pathlib.Path(__file__).resolve().parents[2]
ATOL = RTOL = 2e-5  # float32 (ieee tl.dot) vs the float64 reference
# Small tiles keep the interpreter fast and make the small shapes span several tiles.
SMALL = SmallMGemmConfig(block_n=16, block_k=32)


def _make(m, n, k, device, seed=0, bias=True, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / math.sqrt(k)
    b = torch.randn(n, generator=gen) if bias else None
    to = dict(device=device, dtype=dtype)
    return x.to(**to), w.to(**to), (b.to(**to) if bias else None)


def _ref(x, w, b):
    """torch's x @ w.T + b, in float64."""
    out = x.double() @ w.double().T
    return out if b is None else out + b.double()


def _workspace(n, cfg, device):
    """Poisoned, sized for MAX_M: the reduce may only read what this call wrote."""
    return torch.full((max(1, small_m_workspace_numel(16, n, cfg)),), float("nan"), device=device)


def _run(x, w, b, cfg, device):
    out = poisoned(torch.empty(x.shape[0], w.shape[0], device=device, dtype=x.dtype))
    ret = small_m_linear(x, w, b, out=out, workspace=_workspace(w.shape[0], cfg, device),
                         config=cfg)
    assert ret is out
    return out


def assert_same_row(got: torch.Tensor, want: torch.Tensor) -> None:
    """A row's result does not depend on how many rows share the launch.

    Bit for bit on the GPU, which is what the kernel promises. Under TRITON_INTERPRET=1 `tl.dot`
    is numpy's BLAS, whose blocking depends on M and on the CPU, so there only float32 rounding
    (a few ulps) is allowed."""
    if got.is_cuda:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


# (n, k, config): unaligned N and K, several N and K tiles, split-K with a partial last tile
CASES = [
    (40, 72, SMALL),
    (64, 128, SmallMGemmConfig(block_n=32, block_k=64)),
    (48, 200, SmallMGemmConfig(block_n=16, block_k=32, num_splits=3)),  # chunks 96, 96, 8
]


@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("n,k,cfg", CASES)
def test_matches_torch(m, n, k, cfg, device):
    x, w, b = _make(m, n, k, device)
    assert_close_to_ref(_run(x, w, b, cfg, device), _ref(x, w, b), ATOL, RTOL, "bias")
    assert_close_to_ref(_run(x, w, None, cfg, device), _ref(x, w, None), ATOL, RTOL, "no bias")


@pytest.mark.parametrize("num_splits", [2, 4, 32])  # 32 > K tiles: clamped to 7 splits of 1
def test_split_k_and_swap_ab_match(num_splits, device):
    x, w, b = _make(5, 48, 200, device)
    ref = _ref(x, w, b)
    for swap_ab in (False, True):
        cfg = SmallMGemmConfig(block_n=16, block_k=32, num_splits=num_splits, swap_ab=swap_ab)
        assert_close_to_ref(_run(x, w, b, cfg, device), ref, ATOL, RTOL, f"swap_ab {swap_ab}")


def test_split_plan_never_leaves_empty_splits():
    assert smg.split_k_plan(200, 32, 3) == (3, 96)
    assert smg.split_k_plan(200, 32, 32) == (7, 32)
    assert smg.split_k_plan(96, 32, 2) == (2, 64)  # 3 tiles: 2 + 1, not 2 + 1 + 0
    assert smg.split_k_plan(72, 128, 4) == (1, 128)


def test_strided_x_and_out_rows(device):
    m, n, k = 4, 40, 72
    x_buf = torch.randn(m, k + 37, device=device)
    x = x_buf[:, 5 : 5 + k]  # row stride k + 37
    _, w, b = _make(m, n, k, device)
    out_buf = torch.full((m, n + 9), -7.0, device=device)
    out = out_buf[:, 3 : 3 + n]  # row stride n + 9
    for cfg in (SMALL, SmallMGemmConfig(block_n=16, block_k=32, num_splits=2)):
        small_m_linear(x, w, b, out=out, workspace=_workspace(n, cfg, device), config=cfg)
        assert_close_to_ref(out, _ref(x, w, b), ATOL, RTOL, f"splits {cfg.num_splits}")
        assert (out_buf[:, :3] == -7.0).all() and (out_buf[:, 3 + n :] == -7.0).all()


@pytest.mark.parametrize("num_splits", [1, 3])
def test_rows_past_m_are_never_touched(num_splits, device):
    # x and out are the first 5 rows of 16-row bucket buffers holding stale rows: those must
    # neither leak into the result nor be written.
    x_buf, w, b = _make(16, 48, 200, device)
    x_buf[5:] = float("nan")
    out_buf = torch.full((16, 48), -7.0, device=device)
    cfg = SmallMGemmConfig(block_n=16, block_k=32, num_splits=num_splits)
    small_m_linear(x_buf[:5], w, b, out=out_buf[:5], workspace=_workspace(48, cfg, device),
                   config=cfg)
    assert_close_to_ref(out_buf[:5], _ref(x_buf[:5], w, b), ATOL, RTOL)
    assert (out_buf[5:] == -7.0).all(), "rows past M were written"


@pytest.mark.parametrize("cfg", [SMALL, SmallMGemmConfig(block_n=16, block_k=32, num_splits=3),
                                 SmallMGemmConfig(block_n=16, block_k=32, num_splits=3,
                                                  swap_ab=True)])
def test_row_bits_do_not_depend_on_m(cfg, device):
    x, w, b = _make(16, 48, 200, device)
    full = _run(x, w, b, cfg, device)
    assert_same_row(_run(x[:1], w, b, cfg, device)[0], full[0])
    assert_same_row(_run(x[:5], w, b, cfg, device), full[:5])
    assert_same_row(_run(x[7:8], w, b, cfg, device)[0], full[7])


def test_deterministic(device):
    x, w, b = _make(6, 48, 200, device)
    cfg = SmallMGemmConfig(block_n=16, block_k=32, num_splits=4)
    assert torch.equal(_run(x, w, b, cfg, device), _run(x, w, b, cfg, device))


def test_default_config_and_allocated_out(device):
    x, w, b = _make(3, 40, 72, device)
    out = small_m_linear(x, w, b)  # config=None: 1 K tile, no split, no workspace needed
    assert out.shape == (3, 40) and out.dtype == x.dtype
    assert_close_to_ref(out, _ref(x, w, b), ATOL, RTOL)
    empty = small_m_linear(x[:0], w, b)
    assert empty.shape == (0, 40)


class TestErrors:
    def test_m_above_max_points_to_torch(self, device):
        x, w, _ = _make(17, 40, 72, device)
        with pytest.raises(ValueError, match="M=17.*torch.nn.functional.linear"):
            small_m_linear(x, w)

    def test_shapes(self, device):
        x, w, b = _make(2, 40, 72, device)
        with pytest.raises(ValueError, match=r"2-D \[M, K\]"):
            small_m_linear(x[None], w)
        with pytest.raises(ValueError, match="does not match x"):
            small_m_linear(x, w[:, :64])
        with pytest.raises(ValueError, match="bias must be a contiguous"):
            small_m_linear(x, w, b[:39])
        with pytest.raises(ValueError, match=r"out must have shape \(2, 40\)"):
            small_m_linear(x, w, out=torch.empty(2, 41, device=device))

    def test_dtypes(self, device):
        x, w, b = _make(2, 40, 72, device)
        with pytest.raises(ValueError, match="weight dtype"):
            small_m_linear(x, w.half())
        with pytest.raises(ValueError, match="bias dtype"):
            small_m_linear(x, w, b.half())
        with pytest.raises(ValueError, match="out dtype"):
            small_m_linear(x, w, out=torch.empty(2, 40, device=device, dtype=torch.half))
        with pytest.raises(NotImplementedError, match="float64"):
            small_m_linear(x.double(), w.double())

    def test_strides(self, device):
        x, w, _ = _make(2, 40, 72, device)
        with pytest.raises(ValueError, match="x needs a unit stride on K"):
            small_m_linear(x.T.contiguous().T, w)
        with pytest.raises(ValueError, match="weight needs a unit stride on K"):
            small_m_linear(x, w.T.contiguous().T)
        with pytest.raises(ValueError, match="out needs a unit stride on N"):
            small_m_linear(x, w, out=torch.empty(40, 2, device=device).T)

    def test_workspace(self, device):
        x, w, _ = _make(2, 64, 1024, device)
        with pytest.raises(ValueError, match="small_m_workspace_numel"):
            small_m_linear(x, w)  # the default config splits K 4 ways here
        cfg = SmallMGemmConfig(num_splits=4)
        with pytest.raises(ValueError, match=">= 512 elements"):
            small_m_linear(x, w, workspace=torch.empty(511, device=device), config=cfg)
        with pytest.raises(ValueError, match="float32"):
            small_m_linear(x, w, workspace=torch.empty(512, device=device).half(), config=cfg)

    def test_config(self):
        with pytest.raises(ValueError, match="block_n"):
            SmallMGemmConfig(block_n=24)
        with pytest.raises(ValueError, match="block_k"):
            SmallMGemmConfig(block_k=8)
        with pytest.raises(ValueError, match="num_splits"):
            SmallMGemmConfig(num_splits=0)
        with pytest.raises(ValueError, match="num_warps"):
            SmallMGemmConfig(num_warps=3)
        with pytest.raises(ValueError, match="m must be"):
            choose_small_m_config(17, 1024, 1024, 132)


# The decode shapes that matter (N, K): Qwen3-0.6B, Qwen3-8B, Qwen3-30B-A3B attention.
QWEN3_SHAPES = [
    (4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072),
    (6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288),
    (5120, 2048), (2048, 4096),
]


class TestChooseConfig:
    @pytest.mark.parametrize("n,k", QWEN3_SHAPES)
    def test_fills_the_gpu_without_tiny_splits(self, n, k):
        cfg = choose_small_m_config(1, n, k, 132)
        programs = math.ceil(n / cfg.block_n) * cfg.num_splits
        k_tiles = math.ceil(k / cfg.block_k)
        splits, k_per_split = smg.split_k_plan(k, cfg.block_k, cfg.num_splits)
        assert splits == cfg.num_splits, "choose must return the split count it launches"
        assert k_per_split >= smg.MIN_K_TILES_PER_SPLIT * cfg.block_k or splits == 1
        assert programs >= smg.TARGET_PROGRAMS_PER_SM * 132 or splits in (
            math.ceil(k_tiles / smg.MIN_K_TILES_PER_SPLIT), smg.MAX_SPLITS
        ), f"{n}x{k}: {programs} programs with {cfg}"

    def test_independent_of_m(self):
        for n, k in QWEN3_SHAPES:
            assert len({choose_small_m_config(m, n, k, 132) for m in range(1, 17)}) == 1

    def test_big_n_does_not_split_small_n_does(self):
        assert choose_small_m_config(1, 24576, 4096, 132).num_splits == 1
        assert choose_small_m_config(1, 1024, 3072, 132).num_splits > 4

    def test_workspace_numel(self):
        cfg = SmallMGemmConfig(num_splits=4)
        assert small_m_workspace_numel(16, 1024, cfg) == 4 * 16 * 1024
        assert small_m_workspace_numel(16, 1024, SmallMGemmConfig()) == 0
        with pytest.raises(ValueError, match="max_m"):
            small_m_workspace_numel(17, 1024, cfg)


# ----------------------------------------------------------------------------- benchmark CLI


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "benchmarks.kernels.gemm", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_benchmark_help():
    res = _bench("--help")
    assert res.returncode == 0, res.stderr
    for opt in ("--out", "--shapes", "--ms", "--sweep", "--sweep-block-k", "--sweep-splits"):
        assert opt in res.stdout, f"{opt} missing from --help"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_benchmark_exits_2_without_cuda(tmp_path):
    res = _bench("--out", str(tmp_path / "r.json"))
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert "no CUDA device" in res.stderr
    assert not (tmp_path / "r.json").exists()


# ----------------------------------------------------------------------------- GPU tier

GPU_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}  # atol = rtol; outputs are ~N(0, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k", QWEN3_SHAPES)
def test_gpu_qwen3_shapes(n, k):
    dtype = torch.float16 if (n, k) == (2048, 4096) else torch.bfloat16
    x, w, b = _make(16, n, k, "cuda", seed=n + k, dtype=dtype)
    cfg = choose_small_m_config(16, n, k, smg.device_num_sms(x.device))
    ws = torch.empty(max(1, small_m_workspace_numel(16, n, cfg)), device="cuda")
    tol = GPU_TOL[dtype]
    full = small_m_linear(x, w, b, workspace=ws, config=cfg)
    for m in (1, 2, 5, 16):
        bias = b if m != 2 else None
        ref = torch.nn.functional.linear(x[:m].float(), w.float(),
                                         None if bias is None else bias.float())
        out = small_m_linear(x[:m], w, bias, workspace=ws, config=cfg)
        assert_close_to_ref(out, ref, tol, tol, f"{n}x{k} m={m}")
        if bias is not None:  # bitwise: same rows with any M, and run to run
            assert torch.equal(out, full[:m]), f"{n}x{k}: rows moved with M={m}"
    assert torch.equal(small_m_linear(x, w, b, workspace=ws, config=cfg), full)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_cuda_graph_replay():
    n, k = 1024, 3072  # splits K: the reduce kernel and the workspace are in the graph
    x, w, b = _make(8, n, k, "cuda", dtype=torch.bfloat16)
    cfg = choose_small_m_config(8, n, k, smg.device_num_sms(x.device))
    assert cfg.num_splits > 1
    ws = torch.empty(small_m_workspace_numel(16, n, cfg), device="cuda")
    out = torch.empty(8, n, device="cuda", dtype=torch.bfloat16)
    small_m_linear(x, w, b, out=out, workspace=ws, config=cfg)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        small_m_linear(x, w, b, out=out, workspace=ws, config=cfg)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, small_m_linear(x, w, b, workspace=ws, config=cfg))
