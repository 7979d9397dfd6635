"""vLLM's top-k/top-p sampling kernel compiled on its own thread, waited for by the profile run
(integration/sampler_warm_up.py): the thread and hook plumbing on CPU, the variant on a GPU."""

from __future__ import annotations

import inspect
import logging
import threading
import types

import pytest
import torch

from tests.gpu_util import require_cuda_and_vllm
from vllm_moe_graphs.integration import sampler_warm_up
from vllm_moe_graphs.integration.sampler_warm_up import (
    SamplerCompile,
    profile_variant,
    start_for_profile_run,
    start_sampler_compile,
)


def _kernel(*keys: str) -> types.SimpleNamespace:
    """What `SamplerCompile` reads of a Triton JIT function: its pre-run hooks and its
    per-device caches (kernel cache first)."""
    return types.SimpleNamespace(pre_run_hooks=[],
                                 device_caches={0: ({k: object() for k in keys}, {})})


def _launch(kernel: types.SimpleNamespace, key: str) -> None:
    """A launch as Triton's JIT runs one: the pre-run hooks, then the lookup, then a compile of
    a variant it does not hold."""
    for hook in list(kernel.pre_run_hooks):
        hook("logits", 151936, BATCH_SIZE=8)
    kernel.device_caches[0][0].setdefault(key, object())


def test_profile_variant_binds_to_vllms_kernel():
    """The arguments name every parameter of the installed vLLM's `_topk_topp_kernel` without a
    default, in its order, as `apply_top_k_top_p_triton` passes them."""
    from vllm.v1.sample.ops import topk_topp_triton

    fn = getattr(topk_topp_triton._topk_topp_kernel, "fn", topk_topp_triton._topk_topp_kernel)
    args, kwargs = profile_variant(rows=256, vocab_size=151936)
    bound = inspect.signature(fn).bind(*args, **kwargs)
    required = [p.name for p in inspect.signature(fn).parameters.values()
                if p.default is inspect.Parameter.empty]
    assert list(bound.arguments) == required
    assert bound.arguments["LOGITS_STRIDE_0"] == bound.arguments["VOCAB_SIZE"] == 151936
    assert bound.arguments["K"] is torch.int32 and bound.arguments["P"] is torch.float32


def test_first_launch_waits_for_the_compile_and_the_hook_goes():
    release = threading.Event()
    kernel = _kernel()

    def compile_variant() -> None:
        assert release.wait(10)
        kernel.device_caches[0][0]["ours"] = object()

    job = SamplerCompile(kernel, compile_variant)
    with job.joined():
        (hook,) = kernel.pre_run_hooks
        threading.Timer(0.2, release.set).start()
        _launch(kernel, "ours")  # blocks until the compile is done
        assert job.seconds is not None and job.waited >= 0.15
        _launch(kernel, "ours")
    assert kernel.pre_run_hooks == [] and job.late_variants == 0 and job.error is None


def test_launch_of_another_variant_is_counted_and_logged(caplog):
    kernel = _kernel("older")
    job = SamplerCompile(kernel, lambda: kernel.device_caches[0][0].setdefault("ours", 1))
    with caplog.at_level(logging.INFO, logger="vllm.moe_graphs"), job.joined():
        _launch(kernel, "ours")
        _launch(kernel, "theirs")
    assert job.late_variants == 1
    assert "compiled on its own thread in" in caplog.text
    assert "compiled 1 variant(s) of its top-k/top-p sampling kernel other than" in caplog.text


def test_compile_error_is_logged_and_left_to_the_launch(caplog):
    kernel = _kernel()

    def fail() -> None:
        raise RuntimeError("ptxas died")

    job = SamplerCompile(kernel, fail)
    with caplog.at_level(logging.INFO, logger="vllm.moe_graphs"), job.joined():
        _launch(kernel, "ours")
    assert isinstance(job.error, RuntimeError)
    assert "did not compile on its own thread (RuntimeError: ptxas died)" in caplog.text


def test_the_compiles_own_hooks_do_not_wait_for_it():
    """Triton's `warmup` runs the pre-run hooks on the compiling thread too: that call must not
    join its own thread."""
    kernel = _kernel()
    started = threading.Event()

    def compile_variant() -> None:
        assert started.wait(10)
        _launch(kernel, "ours")

    job = SamplerCompile(kernel, compile_variant)
    with job.joined():
        started.set()
    assert job.error is None and job.late_variants == 0 and job.waited < 10


def test_joined_waits_even_without_a_launch():
    kernel = _kernel()
    done = []
    job = SamplerCompile(kernel, lambda: done.append(threading.Event().wait(0.1)))
    with job.joined():
        pass
    assert done == [False] and job.seconds is not None


@pytest.mark.parametrize("rows,device", [(7, "cuda"), (256, "cpu")])
def test_no_compile_where_the_profile_run_does_not_launch_the_kernel(rows, device):
    """Below 8 rows vLLM sorts in PyTorch; off CUDA the kernel's tiles differ."""
    assert start_sampler_compile(rows, 151936, torch.device(device)) is None


def test_no_compile_with_serial_warm_up_or_a_pooling_model():
    runner = types.SimpleNamespace(is_pooling_model=False, device=torch.device("cuda"))
    assert start_for_profile_run(runner, compile_threads=0) is None
    runner.is_pooling_model = True
    assert start_for_profile_run(runner, compile_threads=8) is None


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [8, 16])
@pytest.mark.parametrize("vocab", [151936, 1000])
def test_gpu_profile_run_launch_finds_the_variant_compiled(rows, vocab):
    """vLLM's `apply_top_k_top_p_triton` on what its profile run samples (float32 logits of
    `rows` rows, top-k = vocab - 1 and top-p 0.9 on every row) inside `joined`: the launch
    waits for the thread's compile and compiles nothing itself."""
    require_cuda_and_vllm()
    from vllm.v1.sample.ops.topk_topp_triton import apply_top_k_top_p_triton

    device = torch.device("cuda", torch.cuda.current_device())
    job = start_sampler_compile(rows, vocab, device)
    assert job is not None and job.kernel is sampler_warm_up._sampling_kernel()
    logits = torch.randn(rows, vocab, device=device).to(torch.bfloat16).to(torch.float32)
    with job.joined():
        apply_top_k_top_p_triton(logits, torch.full((rows,), vocab - 1, device=device),
                                 torch.full((rows,), 0.9, device=device))
    torch.cuda.synchronize()
    assert job.error is None, job.error
    assert job.late_variants == 0 and job.seconds is not None
