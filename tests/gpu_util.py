"""Helpers shared by the GPU tier's end-to-end tests (engines run in subprocesses)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import time
import zlib
from collections.abc import Iterator

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def require_cuda_and_vllm() -> None:
    """Skip unless a CUDA GPU and vLLM are present."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("vllm")


def engine_env(**extra: str) -> dict[str, str]:
    """The environment of a test engine's interpreter: this one's without the plugin's own
    variables (a test sets those it means), vLLM offline and quiet, the engine core in that
    interpreter (a test reaches it, and patches made there apply), then `extra`, and the
    repository first on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_GRAPHS_")}
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", PYTHONUNBUFFERED="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", **extra)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def engine_memory_kwargs(gpu_memory_utilization: float) -> dict:
    """vLLM memory arguments for a test engine. By default a share of the GPU, profiled as an
    operator's engine would be. With MOE_GRAPHS_TEST_KV_CACHE_GIB set (benchmarks/gpu/tests.sh
    sets it when it runs several pytest lanes at once on one GPU), a fixed KV cache instead:
    vLLM's memory profiling asserts that no other process frees GPU memory meanwhile, which
    engines of a parallel lane do; with `kv_cache_memory_bytes` vLLM still runs its profiling
    forward pass but skips that accounting."""
    gib = os.environ.get("MOE_GRAPHS_TEST_KV_CACHE_GIB")
    if not gib:
        return {"gpu_memory_utilization": gpu_memory_utilization}
    return {"gpu_memory_utilization": 0.05, "kv_cache_memory_bytes": int(float(gib) * 2**30)}


def serve_memory_args(gpu_memory_utilization: float) -> tuple[str, ...]:
    """engine_memory_kwargs() as `vllm serve` flags."""
    return tuple(x for k, v in engine_memory_kwargs(gpu_memory_utilization).items()
                 for x in ("--" + k.replace("_", "-"), str(v)))


def engine_timeout_s(default: float) -> float:
    """Seconds one test engine may run: MOE_GRAPHS_TEST_ENGINE_TIMEOUT_S overrides `default`."""
    return float(os.environ.get("MOE_GRAPHS_TEST_ENGINE_TIMEOUT_S") or default)


# The GPU tier's lanes (benchmarks/gpu/tests.sh) share one GPU. vLLM's `Worker.sleep` reads the
# device's free memory before and after it suspends the engine's memory and asserts it did not
# drop ("Memory usage increased after sleeping."): a device-wide reading, so an engine another
# lane starts, or wakes, in that window fails a test that says nothing about the plugin (the
# parity tests' sleep phases of both shapes on an H100, tier at e794503; each passed alone).
# With GPU_LANES_LOCK set (tests.sh sets it for lanes) a sleep or wake-up holds that lock file
# exclusively and an engine start holds it shared; a waiting sleep closes a gate (the lock file
# + ".gate") that new starts pass through, so a stream of starts cannot starve it. Unset, both
# are no-ops. Lane 0's kernel tests allocate outside engines, at most a few hundred MiB: a sleep
# frees the engine's KV cache (4 GiB in lanes) and more.
LANES_LOCK_ENV = "GPU_LANES_LOCK"


@contextlib.contextmanager
def _lanes_lock(exclusive: bool, what: str) -> Iterator[None]:
    path = os.environ.get(LANES_LOCK_ENV)
    if not path:
        yield
        return
    t0 = time.monotonic()
    with open(path + ".gate", "a") as gate, open(path, "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if not exclusive:
            fcntl.flock(gate, fcntl.LOCK_UN)  # a start lets the next one in at once
        waited = time.monotonic() - t0
        if waited >= 1.0:
            print(f"[gpu lanes] {what}: waited {waited:.1f} s for the other lanes",
                  file=sys.stderr, flush=True)
        yield  # closing both files releases both locks


def engine_starting() -> contextlib.AbstractContextManager[None]:
    """Hold around an engine's start on the GPU (it allocates weights and KV cache): shared with
    other starts, excluded from any lane's sleep or wake-up."""
    return _lanes_lock(False, "engine start")


def sleep_or_wake() -> contextlib.AbstractContextManager[None]:
    """Hold around an engine's sleep or wake-up: no other lane starts, sleeps or wakes one."""
    return _lanes_lock(True, "sleep or wake-up")


def shape_dir(tmp_path, shape: str, num_layers: int) -> tuple[str, int]:
    """A config directory of a shipped Qwen3 shape cut to `num_layers` layers (every per-layer
    shape real); returns (path, vocab size)."""
    from vllm_moe_graphs.model_configs import read_hf_config

    hf = read_hf_config(shape)
    hf["num_hidden_layers"] = num_layers
    path = tmp_path / f"{shape}-{num_layers}l"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hf))
    return str(path), int(hf["vocab_size"])


# FP8 weights as vLLM 0.26 holds them once loaded and processed on a Hopper GPU (EP 1), which is
# when `LLM.apply_model` runs the re-draw (module paths read in vllm/model_executor/layers/):
#   block FP8 checkpoint (`weight_block_size [128, 128]`, quantization/fp8.py):
#     dense `weight` [N, K] e4m3 row-major + `weight_scale_inv` [ceil(N/128), ceil(K/128)] fp32;
#     MoE `w13_weight` [E, 2I, H] / `w2_weight` [E, H, I] e4m3 + `w13_weight_scale_inv`
#     [E, 2I/128, H/128] / `w2_weight_scale_inv` [E, H/128, I/128] fp32. Real weight = fp8 * the
#     block's scale_inv (per_block_cast_to_fp8: scale_inv = block amax / 448); the Triton MoE and
#     the Cutlass / DeepGEMM dense kernels keep these shapes.
#   online FP8 (`--quantization fp8` on a bf16 checkpoint, quantization/online/fp8.py): the loader
#     (dummy loader too) quantizes per tensor; dense `weight` is stored transposed, [K, N] with
#     strides (1, K) (`qweight.t()`), + `weight_scale` [1] fp32; MoE `w13_weight` [E, 2I, H] /
#     `w2_weight` [E, H, I] e4m3 + `w13_weight_scale` / `w2_weight_scale` [E] fp32 (per expert).
# N = output features, K = input features (fan_in), E = experts, H = hidden, I = moe intermediate.
_FP8_MAX = 448.0  # float8_e4m3fn
_BLOCK_AMAX_MIN = 1e-4  # per_block_cast_to_fp8's clamp of a block's amax
_TENSOR_SCALE_MIN = 1.0 / (_FP8_MAX * 512.0)  # QuantFP8's least per-tensor scale
_SCALE_SUFFIXES = ("_scale", "_scale_inv", "_scale_ub")  # weight, input, KV-cache scales


def redraw_weights(model, seed: int = 0) -> int:
    """Re-draw vLLM's dummy weights (U(-1e-3, 1e-3) everywhere, which makes q/k ~1000x too small
    after the q/k RMSNorm and the logits flat): norm gains 1, matrices N(0, 1/fan_in), seeded
    per parameter name, so identical in every run on the same GPU. For `LLM.apply_model`.

    FP8 weights (float8_e4m3fn) are drawn as the bf16 matrix of the same name would be (same
    seed, same values), quantized as their format does, and written with their scale in place:
    block FP8 per 128x128 block, online FP8 per tensor (per expert for the MoE), in the
    layouts listed above this function. Scale parameters (names ending in `_scale`,
    `_scale_inv`, `_scale_ub`: weight, activation and KV-cache scales) are never drawn; a
    weight's scale is written with its weight, the others are left alone. A float8 parameter
    in any other layout raises ValueError naming it. Every write is a copy into the existing
    tensors (CUDA graphs and vLLM hold their addresses). Returns how many parameters were
    re-drawn (an FP8 weight and its scale count once)."""
    import torch

    count = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_floating_point() or name.endswith(_SCALE_SUFFIXES):
                continue
            if p.element_size() == 1:  # a float8 dtype
                _redraw_fp8(model, name, p, seed)
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=_generator(name, seed, p.device))
            else:
                continue
            count += 1
    return count


def _generator(name: str, seed: int, device):
    import torch

    gen = torch.Generator(device=device)
    gen.manual_seed(zlib.crc32(name.encode()) + seed)
    return gen


def _redraw_fp8(model, name: str, weight, seed: int) -> None:
    """Re-draw one FP8 weight and its scale (layouts above `redraw_weights`)."""
    import torch

    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    own = dict(module.named_parameters(recurse=False))
    block_scale, tensor_scale = own.get(leaf + "_scale_inv"), own.get(leaf + "_scale")
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: {weight.dtype} weights are not re-drawn (float8_e4m3fn only)")
    if weight.dim() not in (2, 3):
        raise ValueError(f"{name}: a {weight.dim()}-D float8 weight; expected [N, K] or [E, N, K]")
    if block_scale is not None:
        logical = weight  # [N, K] or [E, N, K], as the kernels read it
        scale = block_scale
        _check_block_layout(name, weight, scale, getattr(module, "weight_block_size", None))
    elif tensor_scale is not None:
        # per-tensor dense weights are stored [K, N] (a transpose), MoE weights [E, N, K]
        logical = weight if weight.dim() == 3 else weight.t()
        scale = tensor_scale
        _check_tensor_layout(name, weight, scale, module)
    else:
        raise ValueError(f"{name}: a float8 weight with neither `{leaf}_scale_inv` (block FP8) "
                         f"nor `{leaf}_scale` (per-tensor FP8) beside it; layout unknown")
    if not logical.is_contiguous():
        raise ValueError(f"{name}: stored with strides {tuple(weight.stride())}, not the layout "
                         f"vLLM's FP8 kernels use for shape {tuple(weight.shape)}")
    # NOTE: transient memory: a bf16 copy of the weight, float32 copies of one [N, K] matrix
    dtype = getattr(module, "orig_dtype", torch.bfloat16)
    drawn = torch.empty(logical.shape, dtype=dtype, device=weight.device)  # [.., N, K]
    drawn.normal_(0.0, logical.shape[-1] ** -0.5, generator=_generator(name, seed, drawn.device))
    stacked = logical.dim() == 3  # [E, N, K]: one expert's [N, K] at a time
    for w, x, s in zip(logical.unbind(0) if stacked else [logical],
                       drawn.unbind(0) if stacked else [drawn],
                       scale.unbind(0) if stacked else [scale]):
        if block_scale is not None:
            q, sc = quantize_blocks(x, module.weight_block_size)
        else:
            q, sc = _quantize_tensor(x)
        w.copy_(q)
        s.copy_(sc.reshape(s.shape))


def _check_block_layout(name: str, weight, scale, block) -> None:
    import torch

    if block is None or len(block) != 2:
        raise ValueError(f"{name}: a block-FP8 weight whose layer has weight_block_size={block}")
    n, k = weight.shape[-2:]
    want = (*weight.shape[:-2], -(-n // block[0]), -(-k // block[1]))
    if scale.dtype != torch.float32 or tuple(scale.shape) != want:
        raise ValueError(f"{name}: block scale_inv is {scale.dtype} {tuple(scale.shape)}; "
                         f"expected torch.float32 {want} for blocks {list(block)}")


def _check_tensor_layout(name: str, weight, scale, module) -> None:
    import torch

    if scale.dtype != torch.float32:
        raise ValueError(f"{name}: per-tensor scale is {scale.dtype}; expected torch.float32")
    if weight.dim() == 3:
        if tuple(scale.shape) != (weight.shape[0],):
            raise ValueError(f"{name}: per-expert scale of shape {tuple(scale.shape)}; expected "
                             f"({weight.shape[0]},) for weights {tuple(weight.shape)}")
        return
    want = (getattr(module, "input_size_per_partition", None),
            getattr(module, "output_size_per_partition", None))
    if scale.numel() != 1 or tuple(weight.shape) != want:
        raise ValueError(f"{name}: per-tensor weight {tuple(weight.shape)} with scale "
                         f"{tuple(scale.shape)}; expected the [K, N] = {want} transpose and "
                         f"one scale")


def quantize_blocks(x, block):
    """[N, K] -> (float8_e4m3fn [N, K], float32 [ceil(N/bn), ceil(K/bk)]) as vLLM's
    per_block_cast_to_fp8 (use_ue8m0=False): scale_inv = block amax / 448, q = x / scale_inv."""
    import torch

    n, k = x.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = x.new_zeros(nb * bn, kb * bk)
    padded[:n, :k] = x
    blocks = padded.view(nb, bn, kb, bk)
    amax = blocks.abs().float().amax(dim=(1, 3), keepdim=True).clamp(min=_BLOCK_AMAX_MIN)
    scale = amax / _FP8_MAX  # [nb, 1, kb, 1]
    q = (blocks.float() * (1.0 / scale)).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(nb * bn, kb * bk)[:n, :k], scale.view(nb, kb)


def _quantize_tensor(x):
    """[N, K] -> (float8_e4m3fn [N, K], float32 [1]) as vLLM's dynamic per-tensor quantization
    (scaled_fp8_quant; QuantFP8.forward_native): scale = amax / 448, q = x / scale."""
    import torch

    scale = (x.abs().max().unsqueeze(-1).to(torch.float32) / _FP8_MAX).clamp(
        min=_TENSOR_SCALE_MIN)
    q = (x.to(torch.float32) * scale.reciprocal()).clamp(-_FP8_MAX, _FP8_MAX)
    return q.to(torch.float8_e4m3fn), scale
