"""vLLM's top-k/top-p sampling kernel compiled on its own thread, waited for by the profile run
(integration/startup/sampler_warm_up.py): the thread and hook plumbing on CPU, the variant on a
GPU."""

from __future__ import annotations

import inspect
import logging
import threading
import types

import pytest
import torch

from tests.gpu_util import require_cuda_and_vllm
from vllm_moe_graphs.integration.startup import sampler_warm_up
from vllm_moe_graphs.integration.startup.sampler_warm_up import (
    SamplerCompile,
    profile_variant,
    start_for_profile_run,
    start_sampler_compile,
)


def _kernel(*keys: str) -> types.SimpleNamespace:
    """What `SamplerCompile` reads of a Triton JIT function: its per-device caches (kernel
    cache first)."""
    return types.SimpleNamespace(device_caches={0: ({k: 1 for k in keys}, {})})


def _launch(kernel: types.SimpleNamespace, key: str) -> bool:
    """A launch as Triton's JIT runs one: a variant it holds launches; else the cache hook is
    asked (with the keyword arguments Triton passes), and unless it says skip, the variant is
    compiled and launched. True when it launched."""
    from triton import knobs
    from triton.runtime.jit import JitFunctionInfo

    cache = kernel.device_caches[0][0]
    if key not in cache:
        hook = knobs.runtime.jit_cache_hook
        info = JitFunctionInfo(*sampler_warm_up.KERNEL, kernel)
        if hook is not None and hook(key=key, repr="r", fn=info, compile={"key": key},
                                     is_manual_warmup=False, already_compiled=False):
            return False
        cache[key] = 1
    return True


def test_profile_variant_binds_to_vllms_kernel():
    """The arguments name every parameter of the installed vLLM's `_topk_topp_kernel` without a
    default, in its order, as `apply_top_k_top_p_triton` passes them."""
    from vllm.v1.sample.ops import topk_topp_triton

    kernel = getattr(topk_topp_triton, sampler_warm_up.KERNEL[1])
    assert topk_topp_triton.__name__ == sampler_warm_up.KERNEL[0]
    fn = getattr(kernel, "fn", kernel)
    args, kwargs = profile_variant(rows=256, vocab_size=151936)
    bound = inspect.signature(fn).bind(*args, **kwargs)
    required = [p.name for p in inspect.signature(fn).parameters.values()
                if p.default is inspect.Parameter.empty]
    assert list(bound.arguments) == required
    assert bound.arguments["LOGITS_STRIDE_0"] == bound.arguments["VOCAB_SIZE"] == 151936
    assert bound.arguments["K"] is torch.int32 and bound.arguments["P"] is torch.float32


def test_profile_launches_are_skipped_until_compiled_then_joined(caplog):
    """Inside `profiling` a launch that would compile on the engine's thread is skipped while
    the compile runs; once it is done the variant launches; the hook before is back after, and
    `join` waits for the thread and logs once."""
    from triton import knobs

    release = threading.Event()
    kernel = _kernel()
    asked = []
    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda **kw: asked.append(kw["key"])

    def compile_variant() -> None:
        assert release.wait(10)
        assert _launch(kernel, "ours")  # Triton's warmup asks the hook too, on this thread

    try:
        job = SamplerCompile(kernel, compile_variant)
        with job.profiling():
            assert not _launch(kernel, "ours") and not _launch(kernel, "ours")
            release.set()
            job._thread.join(10)
            assert _launch(kernel, "ours")
        assert asked == ["ours"]  # the compile's own thread went to the hook before
        with caplog.at_level(logging.INFO, logger="vllm.moe_graphs"):
            job.join()
            job.join()
        assert caplog.text.count("compiled on its own thread in") == 1
        assert "(1 launch(es) skipped" in caplog.text
        assert job.skipped == {"ours"} and job.unforeseen == 0 and job.error is None
    finally:
        knobs.runtime.jit_cache_hook = previous


def test_skipped_variant_the_thread_did_not_build_is_logged(caplog):
    kernel = _kernel()
    job = SamplerCompile(kernel, lambda: _launch(kernel, "ours"))
    with job.profiling():
        job._thread.join(10)
        assert _launch(kernel, "ours") and not _launch(kernel, "theirs")
    with caplog.at_level(logging.INFO, logger="vllm.moe_graphs"):
        job.join()
    assert job.unforeseen == 1 and job.waited is not None
    assert "skipped 1 variant(s) of vLLM's top-k/top-p sampling kernel that" in caplog.text


def test_compile_error_is_logged_and_left_to_vllms_sampler_warm_up(caplog):
    kernel = _kernel()

    def fail() -> None:
        raise RuntimeError("ptxas died")

    job = SamplerCompile(kernel, fail)
    with caplog.at_level(logging.INFO, logger="vllm.moe_graphs"):
        job.join()
    assert isinstance(job.error, RuntimeError) and job.seconds is not None
    assert "did not compile on its own thread (RuntimeError: ptxas died)" in caplog.text


def test_runner_skips_in_its_profile_run_and_joins_after_its_capture(monkeypatch):
    """`MoeGraphsModelRunner`: vLLM's profile run (here: one launch of the kernel) runs inside
    `profiling`; `capture_model` joins the compile after the warm-up, before vLLM's sampler
    warm-up that follows it."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_moe_graphs.config import PluginConfig
    from vllm_moe_graphs.integration.runner.model_runner import MoeGraphsModelRunner

    kernel, release, launched = _kernel(), threading.Event(), []
    runner = MoeGraphsModelRunner.__new__(MoeGraphsModelRunner)  # __init__ needs a VllmConfig
    runner.sampler_compile = job = SamplerCompile(
        kernel, lambda: release.wait(10) and _launch(kernel, "ours"))
    monkeypatch.setattr(GPUModelRunner, "profile_run",
                        lambda self: launched.append(_launch(kernel, "ours")))
    runner.profile_run()
    runner.sampling_variants = None
    runner.moe_graphs = types.SimpleNamespace(
        capture_model=lambda: 0,
        config=PluginConfig.from_dict({"compile_sampling_variants": False}))
    release.set()
    assert runner.capture_model() == 0
    assert launched == [False] and job.waited is not None and job.skipped == {"ours"}
    assert kernel.device_caches[0][0] == {"ours": 1} and job.unforeseen == 0


@pytest.mark.parametrize("rows,device", [(7, "cuda"), (256, "cpu")])
def test_no_compile_where_the_profile_run_does_not_launch_the_kernel(monkeypatch, rows, device):
    """Below 8 rows vLLM sorts in PyTorch; off CUDA the kernel's tiles differ. (vLLM's kernel
    stands in as an object with `warmup`: on a machine without a GPU vLLM has no Triton kernel
    at all, and the answer would be None whatever the rows and device.)"""
    monkeypatch.setattr(sampler_warm_up, "sampling_kernel",
                        lambda: types.SimpleNamespace(warmup=None))
    assert start_sampler_compile(rows, 151936, torch.device(device)) is None


def test_no_compile_with_serial_warm_up_or_a_pooling_model():
    runner = types.SimpleNamespace(is_pooling_model=False, device=torch.device("cuda"))
    assert start_for_profile_run(runner, compile_threads=0) is None
    runner.is_pooling_model = True
    assert start_for_profile_run(runner, compile_threads=8) is None


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [8, 16])
@pytest.mark.parametrize("vocab", [151936, 1000])
def test_gpu_profile_run_variant_is_the_one_compiled(rows, vocab):
    """vLLM's `apply_top_k_top_p_triton` on what its profile run samples (float32 logits of
    `rows` rows, top-k = vocab - 1 and top-p 0.9 on every row) inside `profiling`, once the
    thread's compile is done: the launch finds that variant and skips nothing; after `join`,
    masks as a launch of vLLM's own does (every logit kept: top-k vocab - 1 with top-p 0.9
    keeps at least the largest)."""
    require_cuda_and_vllm()
    from vllm.v1.sample.ops.topk_topp_triton import apply_top_k_top_p_triton

    device = torch.device("cuda", torch.cuda.current_device())
    job = start_sampler_compile(rows, vocab, device)
    assert job is not None and job.kernel is sampler_warm_up.sampling_kernel()
    job._thread.join()
    logits = torch.randn(rows, vocab, device=device)
    k = torch.full((rows,), vocab - 1, device=device)
    p = torch.full((rows,), 0.9, device=device)
    with job.profiling():
        masked = apply_top_k_top_p_triton(logits.clone(), k, p)
    job.join()
    torch.cuda.synchronize()
    assert job.error is None, job.error
    assert job.skipped == set() and job.unforeseen == 0
    kept = masked.isfinite()
    assert kept.any(dim=1).all() and not kept.all()
    assert torch.equal(masked[kept], logits[kept])
