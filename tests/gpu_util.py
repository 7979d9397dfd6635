"""Helpers shared by the GPU tier's end-to-end tests (engines run in subprocesses)."""

from __future__ import annotations

import json
import os
import zlib

import pytest


def require_cuda_and_vllm() -> None:
    """Skip unless a CUDA GPU and vLLM are present."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("vllm")


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


def redraw_weights(model, seed: int = 0) -> int:
    """Re-draw vLLM's dummy weights (U(-1e-3, 1e-3) everywhere, which makes q/k ~1000x too small
    after the q/k RMSNorm and the logits flat): norm gains 1, matrices N(0, 1/fan_in), seeded
    per parameter name, so identical in every run on the same GPU. For `LLM.apply_model`.
    Returns how many parameters were re-drawn."""
    import torch

    count = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_floating_point():
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() >= 2:
                gen = torch.Generator(device=p.device)
                gen.manual_seed(zlib.crc32(name.encode()) + seed)
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
            else:
                continue
            count += 1
    return count
