"""Patch: `vllm.v1.worker.worker_base.WorkerBase.__init__`.

Why: every worker (GPU `Worker`, `CPUWorker`, ...) runs it once per process with the final
`VllmConfig` and its rank, before the model loads, and after vLLM loaded the general plugins in
that process (a spawned worker loads them inside `WorkerWrapperBase.init_worker`, so patching
`init_worker` itself would come too late). The plugin records its capability and info metrics
there, on every platform, also for setups where it does not take over.
How: the method is wrapped; the original runs first, unchanged.
Removal: when vLLM offers a per-worker hook for general plugins.
"""

from __future__ import annotations

from vllm_moe_graphs.integration.patch import PATCHED_ATTR
from vllm_moe_graphs.integration.signatures import check_parameters

QUALNAME = "vllm.v1.worker.worker_base.WorkerBase.__init__"
EXPECTED = ("self", "vllm_config", "local_rank", "rank", "distributed_init_method",
            "is_driver_worker")


def apply() -> str | None:
    from vllm.v1.worker.worker_base import WorkerBase

    original = WorkerBase.__init__
    if getattr(original, PATCHED_ATTR, False):
        return None
    check_parameters(QUALNAME, original, EXPECTED)

    def __init__(self, vllm_config, local_rank, rank, distributed_init_method,  # noqa: N807
                 is_driver_worker=False):
        original(self, vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        from vllm_moe_graphs.integration import hooks

        hooks.on_worker_init(vllm_config, rank=int(rank))

    __init__.__wrapped__ = original
    setattr(__init__, PATCHED_ATTR, True)
    WorkerBase.__init__ = __init__
    return QUALNAME
