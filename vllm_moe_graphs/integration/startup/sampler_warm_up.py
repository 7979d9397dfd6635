"""vLLM's top-k/top-p sampling kernel, compiled on a thread of its own from the start of model
loading until the start-up warm-up ends, instead of on the engine's thread in the profile run.

vLLM 0.26's V1 profile run (`GPUModelRunner.profile_run`) ends with a sampler run on
min(max_num_seqs, max_num_batched_tokens) rows with top-k and top-p on (`_dummy_sampler_run`);
from 8 rows on, `apply_top_k_top_p` sends that through vLLM's Triton kernel `_topk_topp_kernel`
(`v1/sample/ops/topk_topp_triton.py`), whose compile is the longest single compile of a start on
a fresh node (6.7-8.1 s on the H200), on the engine's only thread. The run only measures memory:
its samples are discarded, and the kernel allocates nothing (its buffer is allocated before the
launch). vLLM runs the sampler again after `capture_model` (`Worker.compile_or_warm_up_model`),
before the engine is ready.

`start_sampler_compile` compiles the variant the profile run launches (the arguments
`apply_top_k_top_p_triton` passes for contiguous float32 logits of that many rows; Triton's
`warmup` compiles without launching) on a daemon thread. Inside `SamplerCompile.profiling`
(the profile run), a launch of the kernel that would compile on the engine's thread is skipped
instead (`patch/jit_cache_hook.py`, as `moe_warm_up.deferring_fused_moe_compiles` skips), and
masks nothing in those discarded samples; a launch whose variant the thread has compiled runs.
`SamplerCompile.join`, at the end of the runner's `capture_model`, waits for the thread, so
vLLM's later sampler run finds the variant compiled. A compile that fails on the thread, or a
skipped variant the thread did not build, is logged and left to that later run, which compiles
it as vLLM would, still before the engine is ready.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from vllm_moe_graphs.integration.patch import jit_cache_hook

logger = logging.getLogger("vllm.moe_graphs")

KERNEL = ("vllm.v1.sample.ops.topk_topp_triton", "_topk_topp_kernel")
TRITON_MIN_ROWS = 8  # apply_top_k_top_p: from this many rows on, the Triton kernel
BLOCK_SIZE, BLOCK_SIZE_TRUNC = 8192, 4096  # apply_top_k_top_p_triton's tiles on CUDA


def sampling_kernel() -> Any | None:
    """vLLM's `_topk_topp_kernel` (a Triton JIT function), or None where vLLM has no Triton."""
    try:
        from vllm.v1.sample.ops import topk_topp_triton
    except ImportError:
        return None
    kernel = getattr(topk_topp_triton, KERNEL[1], None)
    return kernel if hasattr(kernel, "warmup") else None


def launched_kernel(rows: int, device: Any) -> Any | None:
    """`sampling_kernel()` where vLLM launches it for a batch of `rows` sampled rows on
    `device`; None where it does not: a device other than CUDA (other tiles), fewer than
    `TRITON_MIN_ROWS` rows (vLLM sorts in PyTorch), vLLM without Triton."""
    if getattr(device, "type", None) != "cuda" or rows < TRITON_MIN_ROWS:
        return None
    return sampling_kernel()


def _variant_keys(kernel: Any) -> set[Any]:
    """The keys of the variants the kernel holds compiled, over every device."""
    return {key for caches in getattr(kernel, "device_caches", {}).values() for key in caches[0]}


def kernel_variant(rows: int, vocab_size: int, top_k: bool,
                   top_p: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of `_topk_topp_kernel.warmup` for the variant `apply_top_k_top_p_triton`
    launches on contiguous float32 logits [rows, vocab_size] (the sampler's float32 copy), with
    top-k (int32) and/or top-p (float32) for every row; a disabled one's pointer is the logits.
    Tensors go as their dtypes (Triton's `MockTensor`: aligned, as every allocation of the
    caching allocator is)."""
    import torch

    f32 = torch.float32
    # logits, its row stride, buffer, the two lookup tables, k, p
    args = (f32, vocab_size, f32, f32, f32, torch.int32 if top_k else f32, f32)
    kwargs = dict(BATCH_SIZE=rows, MASK_VALUE=float("-inf"), VOCAB_SIZE=vocab_size,
                  BLOCK_SIZE=BLOCK_SIZE, BLOCK_SIZE_TRUNC=BLOCK_SIZE_TRUNC,
                  TOPK_ENABLED=top_k, TOPP_ENABLED=top_p)
    return args, kwargs


def profile_variant(rows: int, vocab_size: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """`kernel_variant` of vLLM's profile run: top-k and top-p on every row."""
    return kernel_variant(rows, vocab_size, top_k=True, top_p=True)


class SamplerCompile:
    """One compile of `kernel` on a daemon thread (see the module docstring)."""

    def __init__(self, kernel: Any, compile_fn: Callable[[], Any]) -> None:
        self.kernel = kernel
        self.seconds: float | None = None  # the compile, on its thread
        self.waited: float | None = None  # how long `join` waited for it
        self.error: BaseException | None = None
        self.skipped: set[Any] = set()  # variant keys of the launches `profiling` skipped
        self.unforeseen = 0  # of those, variants the thread did not compile
        self._compile_fn = compile_fn
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="moe_graphs-sampler-compile",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._compile_fn()
        except Exception as exc:  # noqa: BLE001 - vLLM's later sampler run compiles it
            self.error = exc
        self.seconds = time.perf_counter() - self._start

    @contextlib.contextmanager
    def profiling(self) -> Iterator[None]:
        """Inside the block, a launch of the kernel that would compile on any thread but the
        compile's own is skipped (its key recorded); every other compile goes to the hook that
        was there before, which is back on leaving."""

        def skip(kwargs: dict[str, Any]) -> bool:
            if threading.current_thread() is self._thread:
                return False
            self.skipped.add(kwargs["key"])
            return True

        with jit_cache_hook.skipping(KERNEL, skip):
            yield

    def join(self) -> None:
        """Wait for the compile and log it (once)."""
        if self.waited is not None:
            return
        start = time.perf_counter()
        self._thread.join()
        self.waited = time.perf_counter() - start
        self.unforeseen = len(self.skipped - _variant_keys(self.kernel))
        if self.error is not None:
            logger.warning("moe_graphs: vLLM's top-k/top-p sampling kernel did not compile on "
                           "its own thread (%s: %s); vLLM's sampler warm-up compiles it",
                           type(self.error).__name__, self.error)
            return
        logger.info("moe_graphs: vLLM's top-k/top-p sampling kernel compiled on its own thread "
                    "in %.2f s, beside model loading, the profile run (%d launch(es) skipped: "
                    "samples it discards) and the warm-up; waited %.2f s for it at the end of "
                    "the warm-up", self.seconds, len(self.skipped), self.waited)
        if self.unforeseen:
            logger.warning("moe_graphs: the profile run skipped %d variant(s) of vLLM's "
                           "top-k/top-p sampling kernel that its own thread did not compile "
                           "(their arguments differ from "
                           "integration/startup/sampler_warm_up.py's); vLLM's sampler warm-up "
                           "compiles them", self.unforeseen)


def start_sampler_compile(rows: int, vocab_size: int, device: Any) -> SamplerCompile | None:
    """Start compiling the variant of `_topk_topp_kernel` vLLM's profile run will launch for
    `rows` rows of `vocab_size` logits on `device`; None where that run does not use the
    kernel (`launched_kernel`)."""
    kernel = launched_kernel(rows, device)
    if kernel is None:
        return None
    args, kwargs = profile_variant(rows, vocab_size)

    def compile_variant() -> Any:
        import torch

        torch.cuda.set_device(device)  # Triton compiles for the thread's current device
        return kernel.warmup(*args, grid=(1,), **kwargs)

    return SamplerCompile(kernel, compile_variant)


def sampled_rows(runner: Any) -> tuple[int, int] | None:
    """(rows, vocabulary) of what vLLM's V1 `GPUModelRunner` `runner` samples at most: min(
    max_num_seqs, max_num_batched_tokens) rows of the model's vocab, as its profile run's
    `_dummy_sampler_run` does; None where it samples nothing on CUDA (a pooling model, a device
    other than CUDA, a pipeline stage before the last)."""
    if getattr(runner, "is_pooling_model", False) or runner.device.type != "cuda":
        return None
    from vllm.distributed.parallel_state import get_pp_group

    if not get_pp_group().is_last_rank:
        return None
    scheduler = runner.scheduler_config
    rows = min(scheduler.max_num_seqs, scheduler.max_num_batched_tokens)
    return rows, runner.model_config.get_vocab_size()


def start_for_profile_run(runner: Any, compile_threads: int) -> SamplerCompile | None:
    """`start_sampler_compile` for the profile run of vLLM's V1 `GPUModelRunner` `runner`
    (`sampled_rows`); None with `compile_threads` 0 (`warm_up_compile_threads`: every start-up
    compile on the engine's thread)."""
    sampled = sampled_rows(runner) if compile_threads > 0 else None
    return None if sampled is None else start_sampler_compile(*sampled, runner.device)
