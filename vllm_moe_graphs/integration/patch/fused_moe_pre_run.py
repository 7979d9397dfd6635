"""Patch: the `pre_run_hooks` list of vLLM's `fused_moe_kernel`
(`vllm.model_executor.layers.fused_moe.fused_moe`), for the length of the start-up warm-up's
deferred compiles.

Why: with `warm_up_compile_threads`, the warm-up skips the launches of that kernel whose
variant is not compiled yet (`integration/startup/moe_warm_up.py: deferring_fused_moe_compiles`); a
skipped launch must leave its output zeroed, not whatever memory held, and Triton runs a JIT
function's pre-run hooks before it decides whether to launch, whether or not it skips.
How: `appended(kernel, hook)` appends `hook` to `kernel.pre_run_hooks` inside a `with` block
and removes it on exit, also when the block raises. A kernel without that list (vLLM without a
GPU leaves a plain function) is left alone.
Removal: when vLLM warms its own fused-MoE variants before serving, so that no launch needs
skipping.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def appended(kernel: Any, hook: Callable[..., None]) -> Iterator[None]:
    """Inside the block `hook` is the last of `kernel.pre_run_hooks`, where the kernel has
    that list."""
    hooks = getattr(kernel, "pre_run_hooks", None)
    if hooks is None:
        yield
        return
    hooks.append(hook)
    try:
        yield
    finally:
        if hook in hooks:
            hooks.remove(hook)
