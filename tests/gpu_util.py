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
