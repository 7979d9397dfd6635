"""The serving variants of vLLM's top-k/top-p sampling kernel, compiled into Triton's cache by a
subprocess without CUDA (integration/startup/sampling_variants.py): the real subprocess compiling
for an H100/H200 target on CPU; on a GPU, vLLM's own launches then load every variant from the
cache."""

from __future__ import annotations

import inspect
import logging
import os
import types

import pytest
import torch

from tests.gpu_util import require_cuda_and_vllm
from vllm_moe_graphs.integration.startup import sampler_warm_up, sampling_variants
from vllm_moe_graphs.integration.startup.sampling_variants import (
    ServingVariantsCompile,
    Variant,
    serving_variants,
    start_for_runner,
    start_serving_variants,
    subprocess_argv,
)

HOPPER = ["cuda", 90, 32]  # Triton's target of an H100 / H200


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A Triton cache of the test's own, and Triton compiling (the CPU tier interprets)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return tmp_path


def _kernel_files(root) -> set[str]:
    """The files of `_topk_topp_kernel`'s compiled variants in the Triton cache at `root`
    (not the launcher stubs Triton builds per argument signature on a first launch)."""
    return {os.path.join(d, f) for d, _, files in os.walk(root) for f in files
            if "_topk_topp_kernel" in f}


def test_serving_variants_are_what_batches_of_8_rows_and_more_reach():
    both = [Variant(8, True, True), Variant(16, True, True)]
    assert serving_variants(256)[:2] == both  # Qwen3's generation config first
    assert {(v.top_k, v.top_p) for v in serving_variants(256)} == {
        (True, True), (False, True), (True, False)}
    assert len(serving_variants(256)) == 6
    assert serving_variants(15) == [Variant(8, k, p) for k, p in sampling_variants.FLAGS]


@pytest.mark.parametrize("top_k,top_p", sampling_variants.FLAGS)
def test_kernel_variant_binds_to_vllms_kernel(top_k, top_p):
    """Every parameter of the installed vLLM's `_topk_topp_kernel` without a default, in its
    order; a disabled top-k's pointer is the float32 logits, as `apply_top_k_top_p_triton`
    passes it."""
    from vllm.v1.sample.ops import topk_topp_triton

    fn = getattr(topk_topp_triton._topk_topp_kernel, "fn", topk_topp_triton._topk_topp_kernel)
    args, kwargs = sampler_warm_up.kernel_variant(9, 151936, top_k, top_p)
    bound = inspect.signature(fn).bind(*args, **kwargs).arguments
    required = [p.name for p in inspect.signature(fn).parameters.values()
                if p.default is inspect.Parameter.empty]
    assert list(bound) == required
    assert bound["K"] is (torch.int32 if top_k else torch.float32)
    assert (bound["TOPK_ENABLED"], bound["TOPP_ENABLED"], bound["BATCH_SIZE"]) == (top_k, top_p, 9)


def test_subprocess_compiles_into_the_triton_cache_without_cuda(cache_dir, caplog):
    """The real subprocess on this machine (no GPU): vLLM's kernel compiled for a Hopper
    target through Triton's `warmup`, written to the cache directory of the environment."""
    variants = [Variant(8, False, True)]
    with caplog.at_level(logging.INFO, logger="vllm.moe_graphs"):
        job = ServingVariantsCompile(subprocess_argv(HOPPER, 1000, variants), variants)
        assert job.join(timeout=600), "the subprocess did not finish"
    assert job.error is None, job.error
    assert [(c["rows"], c["top_k"], c["top_p"]) for c in job.compiled] == [(8, False, True)]
    assert [f for f in _kernel_files(cache_dir) if f.endswith("_topk_topp_kernel.cubin")]
    assert "1 variant(s) of vLLM's top-k/top-p sampling kernel for serving" in caplog.text


def test_failed_subprocess_is_logged(cache_dir, caplog):
    variants = [Variant(8, True, True)]
    with caplog.at_level(logging.INFO, logger="vllm.moe_graphs"):
        job = ServingVariantsCompile(subprocess_argv(["no-such-backend", 90, 32], 1000, variants),
                                     variants)
        assert job.join(timeout=600)
    assert job.error is not None and job.error.startswith("exit 1:")
    assert job.compiled == []
    assert "failed after 0 of 1 variant(s)" in caplog.text
    assert "compiles it on the engine's thread, as in stock vLLM" in caplog.text


def test_no_process_to_start_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="vllm.moe_graphs"):
        assert sampling_variants.launch(["/nonexistent/python"], serving_variants(8)) is None
    assert "no subprocess to compile vLLM's top-k/top-p sampling kernel for serving " \
           "(FileNotFoundError" in caplog.text


def test_subprocess_ends_with_the_engine_process(cache_dir):
    """An engine process that ends (here: `os._exit` a second after the start, as a killed
    engine core) takes the subprocess with it at once, while it still loads torch and vLLM
    (otherwise it would end only when it reports its first variant to the closed pipe)."""
    import subprocess
    import sys
    import time

    script = (
        "import os, sys\n"
        "from vllm_moe_graphs.integration.startup.sampling_variants import *\n"
        "vs = serving_variants(256)\n"
        "job = ServingVariantsCompile(subprocess_argv(%r, 1000, vs), vs)\n"
        "print(job._proc.pid, flush=True)\n"
        "import time; time.sleep(1)\n"
        "os._exit(0)\n" % (HOPPER,))
    parent = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    child = int(parent.stdout.split()[0])
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.2)
    assert not _alive(child), "the subprocess outlived its engine process"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("rows,device,interpret", [
    (7, "cuda", "0"), (256, "cpu", "0"), (256, "cuda", "1")])
def test_no_subprocess_where_vllm_compiles_no_variant(monkeypatch, rows, device, interpret):
    """Below 8 rows vLLM sorts in PyTorch; off CUDA the kernel's tiles differ; Triton's
    interpreter compiles nothing. (vLLM's kernel stands in as an object with `warmup`: on a
    machine without a GPU vLLM has no Triton kernel at all.)"""
    monkeypatch.setattr(sampler_warm_up, "sampling_kernel",
                        lambda: types.SimpleNamespace(warmup=None))
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    assert start_serving_variants(rows, 151936, torch.device(device)) is None


def test_no_subprocess_for_a_pooling_model():
    runner = types.SimpleNamespace(is_pooling_model=True, device=torch.device("cuda"))
    assert start_for_runner(runner) is None


@pytest.mark.parametrize("enabled", [True, False])
def test_runner_starts_it_once_after_its_first_capture(monkeypatch, enabled):
    """`capture_model` starts the subprocess after its capture when the setting is on, and
    only the first time (a later capture, e.g. after a wake-up, starts none)."""
    from vllm_moe_graphs.config import PluginConfig
    from vllm_moe_graphs.integration.runner import model_runner
    from vllm_moe_graphs.integration.runner.model_runner import MoeGraphsModelRunner

    started = []
    monkeypatch.setattr(model_runner, "start_for_runner",
                        lambda runner: started.append(runner) or object())
    runner = MoeGraphsModelRunner.__new__(MoeGraphsModelRunner)  # __init__ needs a VllmConfig
    runner.sampler_compile = runner.sampling_variants = None
    runner.moe_graphs = types.SimpleNamespace(
        capture_model=lambda: 0,
        config=PluginConfig.from_dict({"compile_sampling_variants": enabled}))
    assert runner.capture_model() == 0 and runner.capture_model() == 0
    assert started == ([runner] if enabled else [])


@pytest.mark.gpu
def test_gpu_vllms_launches_load_every_variant_the_subprocess_compiled(cache_dir):
    """After the subprocess (started as the runner starts it, for 16 rows), vLLM's
    `apply_top_k_top_p_triton` on real tensors of each variant (8, 9, 16 and 32 rows; top-k and
    top-p, top-p only, top-k only) writes no kernel to the cache: every launch loaded its
    variant.
    A vocabulary no other test uses keeps the variants out of this process's memory; a launch
    of one more vocabulary, which the subprocess did not compile, writes to the cache (so the
    check can fail). Each launch masked: every row keeps at least its largest logit, as it was."""
    require_cuda_and_vllm()
    from vllm.v1.sample.ops.topk_topp_triton import apply_top_k_top_p_triton

    vocab, device = 1040, torch.device("cuda", torch.cuda.current_device())
    job = start_serving_variants(16, vocab, device)
    assert job is not None and len(job.variants) == 6
    assert job.join(timeout=600) and job.error is None, job.error
    compiled = _kernel_files(cache_dir)
    gen = torch.Generator(device=device).manual_seed(0)
    for rows in (8, 9, 16, 32):
        for top_k, top_p in sampling_variants.FLAGS:
            logits = torch.randn(rows, vocab, device=device, generator=gen)
            k = torch.randint(1, 50, (rows,), device=device, generator=gen) if top_k else None
            p = torch.rand(rows, device=device, generator=gen) * 0.5 + 0.4 if top_p else None
            masked = apply_top_k_top_p_triton(logits.clone(), k, p)
            kept = masked.isfinite()
            assert kept.any(dim=1).all() and not kept.all(), (rows, top_k, top_p)
            assert torch.equal(masked[kept], logits[kept])
    torch.cuda.synchronize()
    assert _kernel_files(cache_dir) == compiled, "a launch compiled a variant"
    apply_top_k_top_p_triton(torch.randn(9, vocab + 16, device=device), None,
                             torch.full((9,), 0.9, device=device))
    assert _kernel_files(cache_dir) != compiled
