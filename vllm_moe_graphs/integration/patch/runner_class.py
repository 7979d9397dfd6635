"""Patch: the module attribute `vllm.v1.worker.gpu_model_runner.GPUModelRunner`, for the length
of one `Worker.init_device` call.

Why: vLLM 0.26's `Worker.init_device` builds its V1 model runner from that module attribute
(a local import), and offers no way to name another runner class; the plugin's runner
(`MoeGraphsModelRunner`, a subclass) must be the one built.
How: `substituted(cls)` sets the attribute to `cls` inside a `with` block and restores the
original on exit, also when the block raises; `MoeGraphsWorker.init_device` wraps its one
`super().init_device()` call in it.
Removal: when vLLM lets a worker choose its model runner class (e.g. a `runner_cls` hook).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

RUNNER_ATTRIBUTE = "GPUModelRunner"  # in vllm.v1.worker.gpu_model_runner


def check() -> None:
    """Raise `IncompatibleVllmError` unless the attribute is a class (0.26.0's shape)."""
    from vllm.v1.worker import gpu_model_runner as module

    from vllm_moe_graphs.integration.signatures import IncompatibleVllmError

    if not isinstance(getattr(module, RUNNER_ATTRIBUTE, None), type):
        raise IncompatibleVllmError(
            f"{module.__name__}.{RUNNER_ATTRIBUTE} is not a class in the installed "
            "vLLM; the runner cannot be substituted. Set MOE_GRAPHS_DISABLE=1 to run stock vLLM.")


@contextlib.contextmanager
def substituted(cls: type) -> Iterator[None]:
    """Make `vllm.v1.worker.gpu_model_runner.GPUModelRunner` be `cls` inside the block; the
    original is restored on exit, also when the block raises.

    # NOTE: the module attribute is process-global. Inside the block, any code that reads it
    # (another thread, or a module first imported during `Worker.init_device` that does
    # `from vllm.v1.worker.gpu_model_runner import GPUModelRunner` at import time and keeps the
    # name) sees our subclass; such a module keeps it after the block. A subclass keeps
    # `isinstance` checks true, but `type(x) is GPUModelRunner` would differ. Keep the block
    # to the one `super().init_device()` call; a worker process initialises one device, once.
    """
    from vllm.v1.worker import gpu_model_runner as module

    original = getattr(module, RUNNER_ATTRIBUTE)
    if not (isinstance(original, type) and issubclass(cls, original)):
        raise TypeError(f"{cls.__qualname__} must subclass {original!r}")
    setattr(module, RUNNER_ATTRIBUTE, cls)
    try:
        yield
    finally:
        setattr(module, RUNNER_ATTRIBUTE, original)
