"""RMSNorm and SiLU-and-mul with torch.compile's rounding (`ops/norm_act.py`), against
pure-torch references of the two roundings: stock's compiled code (fp32 residual sum, one
rounding per output) and vLLM's uncompiled CUDA kernels (bf16 sum, two roundings).

Under the interpreter the sums run in numpy's order, not the GPU's: the outputs are checked to
within one bf16 step of the compiled reference, and only where the two references differ by
more than that are they told apart; the residual sum is an elementwise fp32 add rounded once,
exact on both."""

from __future__ import annotations

import os

import pytest
import torch

from vllm_moe_graphs.ops import norm_act

EPS = 1e-6
# Triton's interpreter converts fp32 to bf16 by truncation, the GPU to the nearest: the
# references round as the kernel's platform does, so their rounding *places* can be compared.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _to(t, dtype):
    """fp32 `t` to `dtype` as the kernel's platform rounds (see INTERPRETED)."""
    if INTERPRETED and dtype == torch.bfloat16:
        return (t.float().view(torch.int32) & -65536).view(torch.float32).to(dtype)
    return t.to(dtype)


def _compiled_norm(x, w, residual=None):
    """Stock's compiled rounding: the fp32 sum normalised, one rounding."""
    h = x.float() + (residual.float() if residual is not None else 0)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * w.float()
    return _to(y, x.dtype), _to(h, x.dtype)


def _uncompiled_norm(x, w, residual=None):
    """vLLM's CUDA kernel's rounding: the bf16 sum normalised, rounded, times the weight."""
    h = _to(x.float() + residual.float(), x.dtype) if residual is not None else x
    hf = h.float()
    y = _to(hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS), x.dtype)
    return _to(y.float() * w.float(), x.dtype)


def _inputs(rows, n, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype)
    r = (torch.randn(rows, n, generator=g) * 20).to(dtype)  # a large residual
    w = (1 + 0.2 * torch.randn(n, generator=g)).to(dtype)
    return x.to(device), r.to(device), w.to(device)


def _ulps(a, b):
    """Largest difference in units of the bf16 step at b's magnitude."""
    step = torch.finfo(torch.bfloat16).eps * b.float().abs().clamp_min(1e-3)
    return float(((a.float() - b.float()).abs() / step).max())


def _same(a, b):
    """Share of elements equal in both."""
    return float((a.cpu() == b.cpu()).float().mean())


@pytest.mark.parametrize("rows,n", [(1, 1024), (5, 2048), (3, 96)])
def test_fused_add_rms_norm_rounds_as_the_compiled_model(rows, n, device):
    x, r, w = _inputs(rows, n, torch.bfloat16, device)
    ref, ref_sum = _compiled_norm(x, w, r)
    xo, ro = x.clone(), r.clone()
    out, res = norm_act.fused_add_rms_norm_(xo, ro, w, EPS)
    assert out.data_ptr() == xo.data_ptr() and res.data_ptr() == ro.data_ptr()  # in place
    assert torch.equal(res, ref_sum)  # the sum, rounded once
    assert _ulps(out, ref) <= 1.0
    # outputs of the compiled rounding (reduction order aside), not of vLLM's CUDA kernel
    assert _same(out, ref) > 0.97 > 0.9 > _same(out, _uncompiled_norm(x, w, r))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_without_residual_leaves_its_input(dtype, device):
    x, _, w = _inputs(4, 1024, dtype, device, seed=1)
    before = x.clone()
    out = norm_act.rms_norm(x, w, EPS)
    assert torch.equal(x, before) and out.data_ptr() != x.data_ptr()
    ref = _compiled_norm(x, w)[0]
    assert _ulps(out, ref) <= 1.0 and _same(out, ref) > 0.97


def test_strided_rows_and_empty_batches(device):
    x, r, w = _inputs(6, 256, torch.bfloat16, device, seed=2)
    wide = torch.zeros(6, 512, dtype=torch.bfloat16, device=device)
    wide[:, :256] = x
    view = wide[:, :256]  # row stride 512
    assert _ulps(norm_act.rms_norm(view, w, EPS), _compiled_norm(x, w)[0]) <= 1.0
    empty = x[:0]
    assert norm_act.rms_norm(empty, w, EPS).shape == (0, 256)
    assert norm_act.silu_and_mul(torch.empty(0, 64, dtype=torch.bfloat16, device=device)
                                 ).shape == (0, 32)


@pytest.mark.parametrize("rows,d", [(1, 64), (3, 1536), (2, 3000)])  # 3000: loop with a tail
def test_silu_and_mul_rounds_once(rows, d, device):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(rows, 2 * d, generator=g) * 4).to(torch.bfloat16).to(device)
    a, b = x[:, :d].float(), x[:, d:].float()
    ref = _to(a * torch.sigmoid(a) * b, torch.bfloat16)
    out = norm_act.silu_and_mul(x)
    assert out.shape == (rows, d)
    assert _ulps(out, ref) <= 1.0 and _same(out, ref) > 0.97
    twice = _to(_to(a * torch.sigmoid(a), torch.bfloat16).float() * b, torch.bfloat16)
    assert _same(out, twice) < 0.95  # not vLLM's two roundings


def test_inputs_the_kernels_refuse_are_named():
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    assert norm_act.unsupported(x, torch.ones(8, dtype=torch.bfloat16)) is None
    assert "dtype torch.float32" in norm_act.unsupported(x.float())
    assert "rows with unit column stride" in norm_act.unsupported(torch.zeros(2, 4, 8, dtype=torch.bfloat16))
    assert "rows with unit column stride" in norm_act.unsupported(x.t())
    assert "weight torch.float32" in norm_act.unsupported(x, torch.ones(8))
    with pytest.raises(ValueError, match="weight torch.bfloat16 \\(4,\\)"):
        norm_act.rms_norm(x, torch.ones(4, dtype=torch.bfloat16), EPS)
    with pytest.raises(ValueError, match="even row width, got 7"):
        norm_act.silu_and_mul(torch.zeros(2, 7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="residual torch.bfloat16 \\(3, 8\\)"):
        norm_act.fused_add_rms_norm_(x, torch.zeros(3, 8, dtype=torch.bfloat16),
                                     torch.ones(8, dtype=torch.bfloat16), EPS)
