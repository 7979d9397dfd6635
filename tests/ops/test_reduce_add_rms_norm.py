"""`reduce_add_rms_norm`: split-K reduce + residual add + RMSNorm in one kernel, against the
unfused steps it replaces (the small-M GEMM's reduce, then vLLM's fused_add_rms_norm math).
CPU tier: the Triton interpreter in float32; GPU tier: bfloat16 on the H200, and inside a CUDA
graph."""

from __future__ import annotations

import pytest
import torch

from vllm_moe_graphs.ops import small_m_gemm as smg
from vllm_moe_graphs.ops.reduce_add_rms_norm import MAX_N, reduce_add_rms_norm
from vllm_moe_graphs.ops.small_m_gemm import (
    choose_small_m_config,
    small_m_linear,
    small_m_reduce,
    small_m_workspace_numel,
    split_k_plan,
)

EPS = 1e-6


def _reference(parts: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused steps, with the roundings of the kernels they stand for: the split sum in
    order 0..S-1 in float32 rounded to the activation dtype, the add rounded, the norm in
    float32 rounded, times the weight rounded."""
    acc = parts[0].clone()
    for p in parts[1:]:
        acc += p
    if bias is not None:
        acc += bias.float()
    dtype = residual.dtype
    o = acc.to(dtype)
    x = (o.float() + residual.float()).to(dtype)
    xf = x.float()
    inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    y = ((xf * inv).to(dtype).float() * weight.float()).to(dtype)
    return y, x


def _inputs(s: int, m: int, n: int, device: str, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    parts = torch.randn(s, m, n, generator=gen, device=device)
    residual = torch.randn(m, n, generator=gen, device=device).to(dtype)
    weight = (1 + 0.1 * torch.randn(n, generator=gen, device=device)).to(dtype)
    return parts, residual, weight


@pytest.mark.parametrize("s,m,n", [(1, 1, 64), (3, 5, 96), (8, 16, 256)])
def test_matches_the_unfused_steps(s, m, n, device):
    parts, residual, weight = _inputs(s, m, n, device, torch.float32, seed=s + m + n)
    bias = torch.randn(n, device=device) if s == 3 else None
    ref_y, ref_x = _reference(parts, residual, weight, bias)
    # room past the partials, poisoned
    ws = torch.cat([parts.flatten(), torch.full((7,), float("nan"), device=device)])
    out = torch.full((m, n), float("nan"), device=device)
    res = residual.clone()
    y, x = reduce_add_rms_norm(ws, s, res, weight, EPS, out=out, bias=bias)
    assert y is out and x is res
    assert torch.equal(x, ref_x)  # the residual: bitwise the unfused add
    torch.testing.assert_close(y, ref_y, rtol=1e-5, atol=1e-6)
    assert ref_y.abs().max() > 0.5  # not a vacuous all-zero comparison


def test_a_rows_bits_do_not_depend_on_m(device):
    parts, residual, weight = _inputs(4, 6, 128, device, torch.float32, seed=3)
    full_out = torch.empty(6, 128, device=device)
    full_res = residual.clone()
    reduce_add_rms_norm(parts.flatten(), 4, full_res, weight, EPS, out=full_out)
    one_out = torch.empty(1, 128, device=device)
    one_res = residual[:1].clone()
    reduce_add_rms_norm(parts[:, :1].flatten(), 4, one_res, weight, EPS, out=one_out)
    assert torch.equal(one_out[0], full_out[0]) and torch.equal(one_res[0], full_res[0])


def test_after_a_deferred_small_m_gemm_equals_reduce_then_norm(device):
    """The way the model uses it: small_m_linear(reduce=False) leaves the partials, the fused
    kernel finishes; the same as small_m_linear's own reduce followed by the norm."""
    m, n, k = 3, 64, 512
    gen = torch.Generator(device=device).manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    x, w = randn(m, k), randn(n, k) * 0.05
    residual, weight = randn(m, n), 1 + 0.1 * randn(n)
    cfg = choose_small_m_config(m, n, k, smg.DEFAULT_NUM_SMS)
    splits = split_k_plan(k, cfg.block_k, cfg.num_splits)[0]
    assert splits > 1
    ws = torch.empty(small_m_workspace_numel(m, n, cfg), device=device)
    deferred = small_m_linear(x, w, workspace=ws, config=cfg, reduce=False)
    res = residual.clone()
    y, _ = reduce_add_rms_norm(ws, splits, res, weight, EPS, out=deferred)
    o = small_m_linear(x, w, workspace=ws, config=cfg)  # reduced by the kernel's own reduce
    assert torch.equal(small_m_reduce(torch.empty(m, n, device=device), ws, splits), o)
    ref_x = o + residual
    ref_y = ref_x * torch.rsqrt(ref_x.pow(2).mean(-1, keepdim=True) + EPS) * weight
    assert torch.equal(res, ref_x)
    torch.testing.assert_close(y, ref_y, rtol=1e-5, atol=1e-6)


def test_bad_inputs_are_refused_with_the_fix():
    parts, residual, weight = _inputs(2, 2, 64, "cpu", torch.float32)
    out = torch.empty(2, 64)
    with pytest.raises(ValueError, match="same .M, N. shape"):
        reduce_add_rms_norm(parts.flatten(), 2, residual, weight, EPS, out=torch.empty(3, 64))
    with pytest.raises(ValueError, match=">= 256 elements"):
        reduce_add_rms_norm(parts.flatten()[:100], 2, residual, weight, EPS, out=out)
    with pytest.raises(ValueError, match="num_splits must be >= 1, got 0"):
        reduce_add_rms_norm(parts.flatten(), 0, residual, weight, EPS, out=out)
    with pytest.raises(ValueError, match=r"weight \(and bias\) must be \[64\]"):
        reduce_add_rms_norm(parts.flatten(), 2, residual, weight[:32], EPS, out=out)
    with pytest.raises(ValueError, match="one dtype"):
        reduce_add_rms_norm(parts.flatten(), 2, residual, weight.double(), EPS, out=out)
    with pytest.raises(ValueError, match="unit stride"):
        reduce_add_rms_norm(parts.flatten(), 2, residual, weight, EPS,
                            out=torch.empty(64, 2).t())
    big = torch.empty(1, MAX_N + 1)
    with pytest.raises(ValueError, match="unfused reduce"):
        reduce_add_rms_norm(torch.empty(MAX_N + 1), 1, big, torch.empty(MAX_N + 1), EPS,
                            out=big.clone())


# ----------------------------------------------------------------------------- GPU tier


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k", [(1024, 2048), (1024, 3072), (4096, 12288)])  # o/down 0.6B, 8B
def test_gpu_fused_equals_reduce_then_norm(n, k):
    gen = torch.Generator(device="cuda").manual_seed(k)
    x = torch.randn(16, k, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(n, k, generator=gen, device="cuda") * k ** -0.5).bfloat16()
    residual = torch.randn(16, n, generator=gen, device="cuda").bfloat16()
    weight = (1 + 0.1 * torch.randn(n, generator=gen, device="cuda")).bfloat16()
    cfg = choose_small_m_config(16, n, k, smg.device_num_sms(x.device))
    splits = split_k_plan(k, cfg.block_k, cfg.num_splits)[0]
    ws = torch.empty(small_m_workspace_numel(16, n, cfg), device="cuda")
    for m in (1, 8, 16):
        deferred = small_m_linear(x[:m], w, workspace=ws, config=cfg, reduce=False)
        parts = ws[:splits * m * n].view(splits, m, n).clone()
        res = residual[:m].clone()
        y, _ = reduce_add_rms_norm(ws, splits, res, weight, EPS, out=deferred)
        ref_y, ref_x = _reference(parts, residual[:m], weight)
        assert torch.equal(res, ref_x), f"{n}x{k} m={m}: residual differs from the unfused add"
        ulp = (y.float() - ref_y.float()).abs() / ref_y.float().abs().clamp_min(1e-3)
        assert float(ulp.max()) <= 2 ** -7, f"{n}x{k} m={m}: more than one bf16 ulp apart"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_cuda_graph_replay():
    n, k, m = 1024, 3072, 8
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(n, k, generator=gen, device="cuda") * k ** -0.5).bfloat16()
    residual = torch.randn(m, n, generator=gen, device="cuda").bfloat16()
    weight = torch.ones(n, device="cuda").bfloat16()
    cfg = choose_small_m_config(m, n, k, smg.device_num_sms(x.device))
    splits = split_k_plan(k, cfg.block_k, cfg.num_splits)[0]
    ws = torch.empty(small_m_workspace_numel(m, n, cfg), device="cuda")
    res = residual.clone()

    def step():
        out = small_m_linear(x, w, workspace=ws, config=cfg, reduce=False)
        return reduce_add_rms_norm(ws, splits, res, weight, EPS, out=out)[0]

    eager = step()
    eager_res = res.clone()
    res.copy_(residual)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()  # warm-up on the capture stream
        res.copy_(residual)
    stream.synchronize()
    with torch.cuda.graph(graph):
        captured = step()
    res.copy_(residual)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager) and torch.equal(res, eager_res)
