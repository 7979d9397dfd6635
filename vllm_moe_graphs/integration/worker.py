"""`MoeGraphsWorker`: vLLM 0.26's GPU `Worker`, building `MoeGraphsModelRunner` as its runner.

Selected with `parallel_config.worker_cls =
"vllm_moe_graphs.integration.worker.MoeGraphsWorker"`. `Worker.init_device` (vLLM 0.26.0,
`v1/worker/gpu_worker.py`) ends with

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as GPUModelRunnerV1
    self.model_runner = GPUModelRunnerV1(self.vllm_config, self.device)

i.e. it reads the *module attribute* at call time. `init_device` below swaps that attribute for
our subclass around `super().init_device()` and restores it after
(`integration/patch/runner_class.py`), so no vLLM code is copied. The V2 runner (`use_v2_model_runner`, dense Qwen3 unless `VLLM_USE_V2_MODEL_RUNNER=0`)
is left alone: the plugin stays inactive there (DESIGN.md section 2).

Start-up: before the device is initialised, the process's heap (vLLM, torch, the model code:
everything imported so far, no CUDA tensor yet) is frozen out of Python's cyclic GC
(`freeze_import_heap`). vLLM runs about a dozen full `gc.collect()` calls between here and
ready (memory snapshots, profiling, its own end-of-start-up `freeze_gc_heap`), each scanning that
heap again: 0.25-0.3 s each, 3-3.6 s of a 7.9 s warm start on the H200 (`benchmarks/harness/
startup_trace.py`). vLLM freezes the same heap when the engine is ready; this only does it
earlier. What the freeze keeps alive is what was reachable at the freeze (one collection runs
first); GPU memory cannot be held by it, since nothing on the device exists yet.

KV cache memory: with vLLM's own graphs off, vLLM sets aside no memory for graphs (its graph
memory estimate runs only when `cudagraph_mode` is not NONE), so the plugin's graph pool would
live outside `--gpu-memory-utilization`. `determine_available_memory` takes the pool's budget
(`graph_memory_budget_mib`) out of the KV cache memory vLLM computed, as vLLM does with its own
estimate, under the same switch (`VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS`, on by default) and
not when the operator fixes the KV cache with `kv_cache_memory_bytes` (vLLM's own rule: that
setting does not respect the utilization). A KV size vLLM takes from a saved start-up plan
(`VLLM_ENABLE_STARTUP_PLAN=1`) was profiled without the pool, so the budget comes off it too.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import TYPE_CHECKING

from vllm.v1.worker.gpu_worker import Worker

from vllm_moe_graphs.integration.config_facts import (
    POOL_IN_KV_CACHE,
    graph_pool_source,
    vllm_sets_aside_graph_memory,
)
from vllm_moe_graphs.integration.runner.model_runner import MoeGraphsModelRunner
from vllm_moe_graphs.integration.patch import runner_class
from vllm_moe_graphs.integration.signatures import (
    IncompatibleVllmError,
    check_parameters,
    check_runner_points,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("vllm.moe_graphs")

WORKER_OVERRIDES: dict[str, tuple[str, ...]] = {
    "__init__": ("self", "vllm_config", "local_rank", "rank", "distributed_init_method",
                 "is_driver_worker"),
    "init_device": ("self",),
    "determine_available_memory": ("self",),
}


def check_worker_points(base: type = Worker) -> None:
    """Raise `IncompatibleVllmError` unless `base` and the runner module look like 0.26.0's."""
    for name, expected in WORKER_OVERRIDES.items():
        check_parameters(f"{base.__module__}.{base.__qualname__}.{name}", getattr(base, name),
                         expected)
    runner_class.check()


def graph_pool_reserve(budget_mib: int, estimate_graphs: bool,
                       kv_cache_memory_bytes: int | None) -> int:
    """Bytes of vLLM's KV cache memory to set aside for the graph pool (module doc)."""
    if graph_pool_source(estimate_graphs, bool(kv_cache_memory_bytes)) != POOL_IN_KV_CACHE:
        return 0
    return budget_mib * 2**20


def kv_memory_after_reserve(available: int, reserve: int, utilization: float) -> int:
    """`available` KV cache bytes less `reserve`; a clear error when nothing would be left."""
    if reserve and available <= reserve:
        raise ValueError(
            f"moe_graphs: vLLM found {available / 2**30:.2f} GiB for the KV cache at "
            f"--gpu-memory-utilization {utilization:g}; the graph pool's budget set aside from "
            f"it (graph_memory_budget_mib {reserve // 2**20}) leaves none. Raise "
            "--gpu-memory-utilization, or lower graph_memory_budget_mib in --additional-config "
            "'{\"moe_graphs\": {\"graph_memory_budget_mib\": ...}}'.")
    return available - reserve


def freeze_import_heap() -> tuple[int, float]:
    """Collect, then `gc.freeze()` every object the process holds; returns (objects now frozen,
    seconds it took). vLLM's `gc.unfreeze()` (its CUDA-graph capture context, worker shutdown)
    undoes it."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count(), time.perf_counter() - start


class MoeGraphsWorker(Worker):
    """`Worker` whose V1 model runner is `MoeGraphsModelRunner`."""

    runner_cls: type = MoeGraphsModelRunner

    def __init__(self, vllm_config: VllmConfig, local_rank: int, rank: int,
                 distributed_init_method: str, is_driver_worker: bool = False) -> None:
        check_worker_points()
        check_runner_points()
        super().__init__(vllm_config, local_rank, rank, distributed_init_method,
                         is_driver_worker=is_driver_worker)

    def init_device(self) -> None:
        if self.use_v2_model_runner:
            logger.warning("moe_graphs: vLLM picked the V2 model runner; the plugin's graphs "
                           "stay off (set VLLM_USE_V2_MODEL_RUNNER=0 to use the V1 runner)")
            super().init_device()
            return
        frozen, seconds = freeze_import_heap()
        logger.info("moe_graphs: %d start-up objects frozen out of the cyclic GC before the "
                    "device is initialised (%.2f s; vLLM's start-up collections skip them)",
                    frozen, seconds)
        with runner_class.substituted(self.runner_cls):
            super().init_device()
        if type(self.model_runner) is not self.runner_cls:
            raise IncompatibleVllmError(
                f"Worker.init_device built {type(self.model_runner).__qualname__}, not "
                f"{self.runner_cls.__qualname__}: the installed vLLM no longer reads "
                f"vllm.v1.worker.gpu_model_runner.{runner_class.RUNNER_ATTRIBUTE} when it "
                "builds the runner. Set "
                "MOE_GRAPHS_DISABLE=1 to run stock vLLM.")

    def determine_available_memory(self) -> int:
        fixed = self.cache_config.kv_cache_memory_bytes  # the operator's, not a saved plan's
        available = super().determine_available_memory()
        lifecycle = getattr(self.model_runner, "moe_graphs", None)
        if lifecycle is None or not lifecycle.config.enabled:
            return available  # the V2 runner: no graphs of ours
        budget = lifecycle.config.graph_memory_budget_mib
        reserve = graph_pool_reserve(budget, vllm_sets_aside_graph_memory(), fixed)
        if not reserve:
            if budget:
                logger.info("moe_graphs: the graph pool (up to %d MiB) is not taken out of the "
                            "KV cache memory (kv_cache_memory_bytes is set, or "
                            "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0): keep that much GPU "
                            "memory free beyond it", budget)
            return available
        left = kv_memory_after_reserve(available, reserve,
                                       self.cache_config.gpu_memory_utilization)
        logger.info("moe_graphs: %d MiB of the KV cache memory set aside for the CUDA graph "
                    "pool (graph_memory_budget_mib), as vLLM does for its own graphs: KV cache "
                    "%.2f GiB", budget, left / 2**30)
        return left

    def moe_graphs_idle_capture(self) -> bool:
        """One capture while the engine waits for requests (`idle_capture`; called through
        `collective_rpc` by `patch/engine_core_idle.py`); returns whether more remain."""
        from vllm_moe_graphs.integration.startup.precapture import idle_capture_one

        lifecycle = getattr(self.model_runner, "moe_graphs", None)
        return lifecycle is not None and idle_capture_one(self.model_runner, lifecycle)
