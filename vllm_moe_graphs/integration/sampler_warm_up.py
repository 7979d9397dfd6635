"""vLLM's top-k/top-p sampling kernel, compiled on a thread of its own from the start of model
loading, so that its compile overlaps the weight load and the profile forward.

vLLM 0.26's V1 profile run (`GPUModelRunner.profile_run`) ends with a sampler run on
min(max_num_seqs, max_num_batched_tokens) rows with top-k and top-p on (`_dummy_sampler_run`);
from 8 rows on, `apply_top_k_top_p` sends that through vLLM's Triton kernel `_topk_topp_kernel`
(`v1/sample/ops/topk_topp_triton.py`), whose compile is the longest single compile of a start on
a fresh node (6.7-8.1 s on the H200), on the engine's only thread, after the profile forward.

`start_sampler_compile` compiles the variant that run launches (the arguments
`apply_top_k_top_p_triton` passes for contiguous float32 logits of that many rows; Triton's
`warmup` compiles without launching) on a daemon thread. `SamplerCompile.joined` wraps the
profile run: the kernel's first launch waits for that thread (a pre-run hook: Triton runs those
before it looks for a compiled variant, `patch/kernel_pre_run.py`), and the thread is joined on
leaving whether or not the kernel ran. A compile that fails on the thread is logged and left to
the launch, which compiles as vLLM would; a variant the thread did not foresee is compiled by
the launch too, and the log says so.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from vllm_moe_graphs.integration.patch import kernel_pre_run

logger = logging.getLogger("vllm.moe_graphs")

TRITON_MIN_ROWS = 8  # apply_top_k_top_p: from this many rows on, the Triton kernel
BLOCK_SIZE, BLOCK_SIZE_TRUNC = 8192, 4096  # apply_top_k_top_p_triton's tiles on CUDA


def _sampling_kernel() -> Any | None:
    """vLLM's `_topk_topp_kernel` (a Triton JIT function), or None where vLLM has no Triton."""
    try:
        from vllm.v1.sample.ops import topk_topp_triton
    except ImportError:
        return None
    kernel = getattr(topk_topp_triton, "_topk_topp_kernel", None)
    return kernel if hasattr(kernel, "warmup") else None


def _variant_keys(kernel: Any) -> set[Any]:
    """The keys of the variants the kernel holds compiled, over every device."""
    return {key for caches in getattr(kernel, "device_caches", {}).values() for key in caches[0]}


def profile_variant(rows: int, vocab_size: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of `_topk_topp_kernel.warmup` for the variant vLLM's profile run launches:
    contiguous float32 logits [rows, vocab_size] (the sampler's float32 copy), top-k as int32
    and top-p as float32 for every row. Tensors go as their dtypes (Triton's `MockTensor`:
    aligned, as every allocation of the caching allocator is)."""
    import torch

    f32 = torch.float32
    args = (f32, vocab_size, f32, f32, f32, torch.int32, f32)  # logits, its row stride, buffer,
    # the two lookup tables, k, p
    kwargs = dict(BATCH_SIZE=rows, MASK_VALUE=float("-inf"), VOCAB_SIZE=vocab_size,
                  BLOCK_SIZE=BLOCK_SIZE, BLOCK_SIZE_TRUNC=BLOCK_SIZE_TRUNC,
                  TOPK_ENABLED=True, TOPP_ENABLED=True)
    return args, kwargs


class SamplerCompile:
    """One compile on a daemon thread, which the kernel's first launch inside `joined` waits
    for."""

    def __init__(self, kernel: Any, compile_fn: Callable[[], Any]) -> None:
        self.kernel = kernel
        self.seconds: float | None = None  # the compile, on its thread
        self.waited = 0.0  # how long launches waited for it
        self.error: BaseException | None = None
        self.late_variants = 0  # variants launches inside `joined` compiled themselves
        self._compiled: set[Any] = set()  # the kernel's variant keys once the thread is done
        self._compile_fn = compile_fn
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="moe_graphs-sampler-compile",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._compile_fn()
        except Exception as exc:  # noqa: BLE001 - the launch compiles it as vLLM would
            self.error = exc
        self.seconds = time.perf_counter() - self._start
        # NOTE: launches inside `joined` wait for this thread before they look for a variant,
        # so none has compiled one yet
        self._compiled = _variant_keys(self.kernel)

    def join(self) -> None:
        """Wait for the compile (a no-op on its own thread, whose `warmup` runs the hooks)."""
        if threading.current_thread() is self._thread:
            return
        start = time.perf_counter()
        self._thread.join()
        self.waited += time.perf_counter() - start

    def _wait(self, *args: Any, **kwargs: Any) -> None:
        self.join()

    @contextlib.contextmanager
    def joined(self) -> Iterator[None]:
        """Inside the block the kernel's launches wait for the compile; on leaving it is
        joined and logged."""
        try:
            with kernel_pre_run.appended(self.kernel, self._wait):
                yield
        finally:
            self.join()
            self.late_variants = len(_variant_keys(self.kernel) - self._compiled)
            self._log()

    def _log(self) -> None:
        if self.error is not None:
            logger.warning("moe_graphs: vLLM's top-k/top-p sampling kernel did not compile on "
                           "its own thread (%s: %s); vLLM's profile run compiled it",
                           type(self.error).__name__, self.error)
            return
        logger.info("moe_graphs: vLLM's top-k/top-p sampling kernel compiled on its own thread "
                    "in %.2f s, beside model loading and the profile forward; the profile run "
                    "waited %.2f s for it", self.seconds, self.waited)
        if self.late_variants:
            logger.warning("moe_graphs: vLLM's profile run compiled %d variant(s) of its "
                           "top-k/top-p sampling kernel other than the one compiled ahead (its "
                           "arguments differ from integration/sampler_warm_up.py's)",
                           self.late_variants)


def start_sampler_compile(rows: int, vocab_size: int, device: Any) -> SamplerCompile | None:
    """Start compiling the variant of `_topk_topp_kernel` vLLM's profile run will launch for
    `rows` rows of `vocab_size` logits on `device`; None where that run does not use the
    kernel (a device other than CUDA, fewer than `TRITON_MIN_ROWS` rows, vLLM without
    Triton)."""
    kernel = _sampling_kernel()
    if kernel is None or getattr(device, "type", None) != "cuda" or rows < TRITON_MIN_ROWS:
        return None
    args, kwargs = profile_variant(rows, vocab_size)

    def compile_variant() -> Any:
        import torch

        torch.cuda.set_device(device)  # Triton compiles for the thread's current device
        return kernel.warmup(*args, grid=(1,), **kwargs)

    return SamplerCompile(kernel, compile_variant)


def start_for_profile_run(runner: Any, compile_threads: int) -> SamplerCompile | None:
    """`start_sampler_compile` for the profile run of vLLM's V1 `GPUModelRunner` `runner`
    (`_dummy_sampler_run`: min(max_num_seqs, max_num_batched_tokens) rows of the model's vocab,
    on the last pipeline stage of a generating model); None with `compile_threads` 0
    (`warm_up_compile_threads`: every start-up compile on the engine's thread)."""
    if compile_threads <= 0 or getattr(runner, "is_pooling_model", False):
        return None
    from vllm.distributed.parallel_state import get_pp_group

    if not get_pp_group().is_last_rank:
        return None
    scheduler = runner.scheduler_config
    rows = min(scheduler.max_num_seqs, scheduler.max_num_batched_tokens)
    return start_sampler_compile(rows, runner.model_config.get_vocab_size(), runner.device)
