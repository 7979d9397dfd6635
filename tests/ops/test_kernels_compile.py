"""Every Triton kernel of `vllm_moe_graphs.ops`, launched by its own launcher on Qwen3's shapes
in bf16 as the H200 runs them, compiles to an sm_90 cubin with Triton's own ptxas: no GPU
needed. The CPU tier runs the kernels' Python under the interpreter, which accepts code that the
GPU compiler rejects (a runtime value where a constexpr belongs, an op or layout it cannot
lower); this catches that before a device call does. On a GPU machine every launch of the kernel
tests compiles for real, so the check is for CPU machines only.

How: under the interpreter each launch is recorded instead of run (kernel, argument types,
constexprs, warps, stages); a second process without `TRITON_INTERPRET` compiles each recorded
specialization with `triton.compile` for the H200's target, and checks that its shared memory
fits one H200 block (a launch past it fails out of resources)."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
import triton
import triton.language as tl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="CPU-side check: on a GPU the kernel tests compile")

_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
          torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
          torch.uint8: "u8", torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv"}
_OPTIONS = ("num_warps", "num_stages")
H200_SHARED_BYTES = 232448  # 227 KiB: the most shared memory one block may use on sm_90

_COMPILE = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

done = []
for spec in json.load(sys.stdin):
    kernel = getattr(importlib.import_module(spec["module"]), spec["name"])
    src = ASTSource(kernel, spec["signature"], spec["constants"])
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=spec["options"])
    assert ".target sm_90" in compiled.asm["ptx"] and compiled.asm["cubin"], spec["name"]
    done.append([spec["name"], compiled.metadata.shared])
print("COMPILED " + json.dumps(done))
"""


@triton.jit
def _tile_of_runtime_size_kernel(out_ptr, n):  # broken on purpose: tl.arange needs constexprs
    tl.store(out_ptr + tl.arange(0, n), 0)


def _compile(specs: list[dict]) -> subprocess.CompletedProcess:
    """`_COMPILE` on `specs` in a process without the interpreter (from the repository root)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", _COMPILE], input=json.dumps(specs), cwd=REPO,
                          capture_output=True, text=True, env=env, timeout=600)


def _spec(kernel: Any, args: tuple, kwargs: dict) -> dict:
    """A launch as `triton.compile` takes it: the signature of each argument's type, the
    constexprs, the launch options."""
    params = inspect.signature(kernel.fn).parameters
    values = {**dict(zip(params, args)), **{k: v for k, v in kwargs.items() if k in params}}
    signature, constants = {}, {}
    for name, param in params.items():
        value = values.get(name, param.default)
        if "constexpr" in str(param.annotation) or value is None:
            signature[name], constants[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise AssertionError(f"{kernel.fn.__name__}.{name}: argument {value!r} of no type")
    return {"module": kernel.fn.__module__, "name": kernel.fn.__name__, "signature": signature,
            "constants": constants, "options": {k: kwargs[k] for k in _OPTIONS if k in kwargs}}


@pytest.fixture
def launches(monkeypatch) -> list[dict]:
    """Launches of interpreted kernels, recorded (not run) while the fixture is live."""
    from triton.runtime.interpreter import InterpretedFunction

    recorded: list[dict] = []

    def run(self, *args, grid, warmup, **kwargs):
        spec = _spec(self, args, kwargs)
        if spec not in recorded:
            recorded.append(spec)

    monkeypatch.setattr(InterpretedFunction, "run", run)
    return recorded


def _launch_every_kernel() -> None:
    """Each launcher at Qwen3 shapes in bf16 (contents do not matter: nothing runs): KV write,
    decode attention split and unsplit (its reduce) and prefill attention at short and long
    queries, for both attention shapes; small-M GEMM unsplit, and split (its reduce) with the
    weight as the A operand and a bias; the MoE routing with and without a row count; RMSNorm
    with and without the residual and SiLU-and-mul at both shapes' widths."""
    from vllm_moe_graphs.ops import (
        DecodeKernelConfig,
        SmallMGemmConfig,
        decode_workspace_shape,
        paged_decode_attention,
        paged_prefill_attention,
        small_m_linear,
        split_kv_cache,
        write_kv,
    )
    from vllm_moe_graphs.ops import norm_act
    from vllm_moe_graphs.ops.moe_router import topk_softmax

    bf16, d, bs, nb = torch.bfloat16, 128, 16, 8
    table = torch.zeros(4, nb, dtype=torch.int32)
    lens = torch.ones(4, dtype=torch.int32)
    starts = torch.tensor([0, 3, 4], dtype=torch.int32)
    for hq, hkv in ((16, 8), (32, 4)):  # Qwen3-0.6B's and Qwen3-30B-A3B's attention heads
        key_cache, value_cache = split_kv_cache(torch.zeros(nb, hkv, bs, 2 * d, dtype=bf16), d)
        kv_rows = torch.zeros(4, hkv, d, dtype=bf16)
        write_kv(kv_rows, kv_rows, key_cache, value_cache, torch.zeros(4, dtype=torch.int64))
        query = torch.zeros(4, hq, d, dtype=bf16)
        for splits in (1, 4):
            workspace = torch.zeros(decode_workspace_shape(4, hq, d, splits))
            paged_decode_attention(torch.empty_like(query), query, key_cache, value_cache,
                                   table, lens, d ** -0.5, num_splits=splits,
                                   workspace=workspace, config=DecodeKernelConfig())
        for max_query_len in (3, 256):  # the tile follows the longest query
            paged_prefill_attention(torch.empty_like(query), query, key_cache, value_cache,
                                    table, starts, lens, d ** -0.5, max_query_len=max_query_len)
    x, weight = torch.zeros(8, 2048, dtype=bf16), torch.zeros(1024, 2048, dtype=bf16)
    for splits, swap_ab, bias in ((1, False, None), (4, True, torch.zeros(1024, dtype=bf16))):
        config = SmallMGemmConfig(64, 256, splits, 4, 3, swap_ab)
        small_m_linear(x, weight, bias, workspace=torch.zeros(splits * 16 * 1024), config=config)
    logits = torch.zeros(8, 128, dtype=bf16)  # Qwen3-30B-A3B's router: 128 experts, top-8
    topk_softmax(logits, 8, True)
    topk_softmax(logits, 8, True, real=torch.ones(1, dtype=torch.int32), sentinel=128)
    for hidden, inter in ((1024, 3072), (2048, 6144)):  # Qwen3-0.6B, Qwen3-30B-A3B (dense MLP)
        rows, w = torch.zeros(4, hidden, dtype=bf16), torch.zeros(hidden, dtype=bf16)
        norm_act.rms_norm(rows, w, 1e-6)
        norm_act.fused_add_rms_norm_(rows, torch.zeros_like(rows), w, 1e-6)
        norm_act.silu_and_mul(torch.zeros(4, 2 * inter, dtype=bf16))


def test_every_kernel_compiles_for_the_h200(launches) -> None:
    _launch_every_kernel()
    names = sorted({spec["name"] for spec in launches})
    assert names == ["_decode_reduce_kernel", "_paged_decode_kernel", "_paged_prefill_kernel",
                     "_rms_norm_kernel", "_silu_and_mul_kernel", "_small_m_gemm_kernel",
                     "_small_m_reduce_kernel", "_topk_softmax_kernel", "_write_kv_kernel"], names
    proc = _compile(launches)
    assert proc.returncode == 0, proc.stderr[-3000:]
    compiled = json.loads(proc.stdout.split("COMPILED ", 1)[1])
    assert len(compiled) == len(launches) >= 14, [spec["name"] for spec in launches]
    # a block's shared memory within the H200's limit, else its launch fails out of resources
    too_big = [(name, shared) for name, shared in compiled if shared > H200_SHARED_BYTES]
    assert not too_big, f"shared memory past the H200's {H200_SHARED_BYTES} bytes: {too_big}"


def test_fp8_kv_kernels_compile_for_the_h200(launches) -> None:
    """The FP8 KV cache variants (bf16 rows and queries, a float8e4nv cache, scales loaded from
    device memory) of the KV write, decode split and unsplit, and prefill compile for sm_90 too,
    within one block's shared memory."""
    from vllm_moe_graphs.ops import (
        FP8_KV_DTYPE,
        decode_workspace_shape,
        paged_decode_attention,
        paged_prefill_attention,
        split_kv_cache,
        write_kv,
    )

    bf16, d, bs, nb, hq, hkv = torch.bfloat16, 128, 16, 8, 32, 4  # Qwen3-30B-A3B's attention
    key_cache, value_cache = split_kv_cache(torch.zeros(nb, hkv, bs, 2 * d, dtype=FP8_KV_DTYPE), d)
    k_scale, v_scale = torch.ones(1), torch.ones(1)
    rows = torch.zeros(4, hkv, d, dtype=bf16)
    write_kv(rows, rows, key_cache, value_cache, torch.zeros(4, dtype=torch.int64), k_scale,
             v_scale)
    query, table, lens = torch.zeros(4, hq, d, dtype=bf16), torch.zeros(4, nb, dtype=torch.int32), \
        torch.ones(4, dtype=torch.int32)
    for splits in (1, 4):
        paged_decode_attention(torch.empty_like(query), query, key_cache, value_cache, table, lens,
                               d ** -0.5, num_splits=splits,
                               workspace=torch.zeros(decode_workspace_shape(4, hq, d, splits)),
                               k_scale=k_scale, v_scale=v_scale)
    paged_prefill_attention(torch.empty_like(query), query, key_cache, value_cache, table,
                            torch.tensor([0, 3, 4], dtype=torch.int32), lens, d ** -0.5,
                            max_query_len=256, k_scale=k_scale, v_scale=v_scale)
    assert all(spec["constants"].get("KV_FP8") for spec in launches
               if spec["name"] != "_decode_reduce_kernel"), launches
    proc = _compile(launches)
    assert proc.returncode == 0, proc.stderr[-3000:]
    compiled = json.loads(proc.stdout.split("COMPILED ", 1)[1])
    assert len(compiled) == len(launches) == 5, [spec["name"] for spec in launches]
    assert all(shared <= H200_SHARED_BYTES for _, shared in compiled), compiled


def test_a_constexpr_fed_a_runtime_value_fails_to_compile(launches) -> None:
    """The check can fail: a kernel whose tile size is a runtime argument is recorded like any
    launch but does not compile."""
    _tile_of_runtime_size_kernel[(1,)](torch.zeros(16), 16)
    assert [spec["name"] for spec in launches] == ["_tile_of_runtime_size_kernel"]
    proc = _compile(launches)
    assert proc.returncode != 0 and "arange" in proc.stderr, proc.stderr[-2000:]
