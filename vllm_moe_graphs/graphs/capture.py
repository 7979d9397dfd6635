"""Capturing one decode graph: `cuda_capture` (the CUDA implementation the graph runner uses by
default) and the `CaptureFn` contract tests fulfil with an emulation on CPU. No vLLM import."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Protocol

import torch

logger = logging.getLogger("vllm.moe_graphs")


@dataclasses.dataclass(frozen=True)
class CapturedGraph:
    """What a capture function returns: `replay()` refills `output` (a static tensor)."""

    replay: Callable[[], object]
    output: torch.Tensor
    pool_bytes: int  # bytes this capture added to the shared pool
    release: Callable[[], None] = lambda: None  # frees the graph's hold on the pool


class CaptureFn(Protocol):
    def __call__(self, fn: Callable[[], torch.Tensor], pool: object,
                 before_capture: Callable[[], None] | None, *,
                 warm_up: bool = True) -> CapturedGraph: ...


def cuda_capture(fn: Callable[[], torch.Tensor], pool: object,
                 before_capture: Callable[[], None] | None, *,
                 warm_up: bool = True) -> CapturedGraph:
    """Capture `fn` into a `torch.cuda.CUDAGraph` on the shared `pool`. With `warm_up`, one
    warm-up run on a side stream first (as PyTorch recommends: lazy inits, cuBLAS handles,
    allocator state); the caller passes False when `fn`'s shapes have just run eagerly (a key's
    warm-up steps), where that run would initialize nothing new and cost a whole step, GPU-bound
    at large token buckets, inside the capture pause."""
    if warm_up:
        side = _side_stream(torch.cuda.current_device())
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
    # torch.cuda.graph() empties the cache on entry; do it first so the reserved-bytes delta
    # below is the pool's growth only.
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    graph = torch.cuda.CUDAGraph()
    if before_capture is not None:
        before_capture()  # e.g. the prefetch offloader's sync_prev_onload()
    stream = torch.cuda.current_stream()
    began = False
    try:
        # NOTE: thread_local: vLLM's output thread may touch CUDA (event syncs of the async
        # output copy) while a lazy capture runs mid-serving; only this thread's calls matter.
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            began = True
            output = fn()
    except BaseException:
        # NOTE: when capture_end() raises, torch.cuda.graph leaves its capture stream current;
        # restore ours so the eager fallback runs where the caller expects.
        torch.cuda.set_stream(stream)
        _end_failed_capture(pool, began)
        raise
    torch.cuda.synchronize()
    grown = max(0, torch.cuda.memory_reserved() - before)
    return CapturedGraph(graph.replay, output, grown, graph.reset)


@functools.cache
def _side_stream(device: int) -> torch.cuda.Stream:
    """The one side stream of the warm-up runs on `device`.

    # NOTE: one for every capture, not a new `torch.cuda.Stream()` each time: cuBLAS keeps a
    # workspace (about 32 MiB on the H200) per stream it ran on, cached for the process' life,
    # and new streams cycle through torch's pool of 32, so per-capture streams held up to about
    # 1 GiB of GPU memory outside the graph pool and its budget (measured on the H200).
    """
    return torch.cuda.Stream(device=device)


def _end_failed_capture(pool: object, began: bool) -> None:
    """Undo what a capture whose end failed left behind, so serving goes on as before it.

    # NOTE: when capture_end() fails at its start (an invalidated capture, e.g. a host sync
    # inside the region), torch skips its epilogue: (1) the caching allocator keeps routing this
    # thread's allocations into the graph pool, whose next capture then fails with
    # "beginAllocateToPool: already recording", and eager memory lands in a pool that is never
    # freed; (2) the capture's hold on the pool is never released; (3) the CUDA RNG stays marked
    # as capturing. (1) and (2) are undone here when the recording is still open (else
    # capture_end got that far and the graph object releases its own hold); (3) below.
    """
    if began and hasattr(torch._C, "_cuda_endAllocateToPool"):
        device = torch.cuda.current_device()
        try:
            torch._C._cuda_endAllocateToPool(device, pool)
        except RuntimeError:
            pass  # not recording any more: capture_end ended it
        else:
            torch._C._cuda_releasePool(device, pool)
    _reset_rng_capture_state()


def _reset_rng_capture_state() -> None:
    """After a failed capture: leave the CUDA RNG as a successful capture would.

    # NOTE: when capture_end() fails (an invalidated capture, e.g. a host sync inside the
    # region), torch skips the default CUDA generator's capture epilogue and the generator stays
    # marked as capturing: every later RNG op outside a capture, such as vLLM's sampler at a
    # temperature above 0, then raises "Offset increment outside graph capture encountered
    # unexpectedly". One trivial capture runs the prologue and the epilogue again.
    """
    try:
        scratch = torch.zeros(1, device=torch.cuda.current_device())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            scratch.add_(1)
        graph.reset()
    except Exception as exc:  # noqa: BLE001 - the caller re-raises the capture's own error
        logger.warning("moe_graphs: could not reset the CUDA RNG after a failed capture "
                       "(%s: %s); sampling may fail", type(exc).__name__, exc)
