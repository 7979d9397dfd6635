"""GPU tier: `ops/norm_act.py` against what stock vLLM runs, on the GPU: vLLM's `native`
RMSNorm and SiLU-and-mul compiled by torch.compile (Inductor, stock's defaults) and vLLM's
uncompiled CUDA kernels (`vllm_c`, `torch.ops._C`). The plugin's kernels must round as the
compiled code does: the residual sum bit-identical, outputs equal but for the odd last-bit flip
of a different reduction order, and measurably further from vLLM's CUDA kernels."""

from __future__ import annotations

import pytest
import torch

from tests.gpu_util import require_cuda_and_vllm

pytestmark = pytest.mark.gpu
EPS = 1e-6


@pytest.fixture(autouse=True)
def _needs_cuda_and_vllm():
    require_cuda_and_vllm()
    import vllm._custom_ops  # noqa: F401  (loads vllm._C: torch.ops._C)


def _same(a, b):
    return float((a == b).float().mean())


def _inputs(rows, n, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(rows, n, generator=g, device="cuda") * 3).bfloat16()
    r = (torch.randn(rows, n, generator=g, device="cuda") * 20).bfloat16()
    w = (1 + 0.2 * torch.randn(n, generator=g, device="cuda")).bfloat16()
    return x, r, w


@pytest.mark.parametrize("rows,n", [(1, 1024), (64, 1024), (7, 2048), (512, 2048)])
def test_norms_round_as_stock_compiles_them(rows, n):
    from vllm import ir

    from vllm_moe_graphs.ops import norm_act

    native_add = torch.compile(ir.ops.fused_add_rms_norm.impls["native"].impl_fn, dynamic=False)
    native = torch.compile(ir.ops.rms_norm.impls["native"].impl_fn, dynamic=False)
    x, r, w = _inputs(rows, n)
    stock_out, stock_sum = native_add(x.clone(), r.clone(), w, EPS)
    out, total = norm_act.fused_add_rms_norm_(x.clone(), r.clone(), w, EPS)
    assert torch.equal(total, stock_sum)
    assert _same(out, stock_out) > 0.99
    assert float((out.float() - stock_out.float()).abs().max()) <= \
        2 ** -7 * float(stock_out.float().abs().max())
    vllm_out, vllm_sum = x.clone(), r.clone()
    torch.ops._C.fused_add_rms_norm(vllm_out, vllm_sum, w, EPS)  # what runs uncompiled
    assert _same(vllm_out, stock_out) < _same(out, stock_out) - 0.05
    assert _same(norm_act.rms_norm(x, w, EPS), native(x, w, EPS)) > 0.99


@pytest.mark.parametrize("rows,d", [(1, 3072), (64, 3072), (9, 768)])
def test_silu_and_mul_rounds_as_stock_compiles_it(rows, d):
    from vllm.model_executor.layers.activation import SiluAndMul

    from vllm_moe_graphs.ops import norm_act

    g = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(rows, 2 * d, generator=g, device="cuda") * 4).bfloat16()
    stock = torch.compile(SiluAndMul.forward_native, dynamic=False)(x)
    out = norm_act.silu_and_mul(x)
    assert _same(out, stock) > 0.99
    uncompiled = torch.empty_like(out)
    torch.ops._C.silu_and_mul(uncompiled, x)
    assert _same(uncompiled, stock) < _same(out, stock) - 0.05
