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
heap again: 0.25-0.3 s each, 3-3.6 s of a 7.9 s warm start on the H200 (`benchmarks/
startup_trace.py`). vLLM freezes the same heap when the engine is ready; this only does it
earlier. What the freeze keeps alive is what was reachable at the freeze (one collection runs
first); GPU memory cannot be held by it, since nothing on the device exists yet.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import TYPE_CHECKING

from vllm.v1.worker.gpu_worker import Worker

from vllm_moe_graphs.integration.model_runner import MoeGraphsModelRunner
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
}


def check_worker_points(base: type = Worker) -> None:
    """Raise `IncompatibleVllmError` unless `base` and the runner module look like 0.26.0's."""
    for name, expected in WORKER_OVERRIDES.items():
        check_parameters(f"{base.__module__}.{base.__qualname__}.{name}", getattr(base, name),
                         expected)
    runner_class.check()


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

    def moe_graphs_idle_capture(self) -> bool:
        """One capture while the engine waits for requests (`idle_capture`; called through
        `collective_rpc` by `patch/engine_core_idle.py`); returns whether more remain."""
        from vllm_moe_graphs.integration.precapture import idle_capture_one

        lifecycle = getattr(self.model_runner, "moe_graphs", None)
        return lifecycle is not None and idle_capture_one(self.model_runner, lifecycle)
