"""Patch: Triton's `knobs.runtime.jit_cache_hook`, for the length of a `with` block: the
compiles of one vLLM Triton kernel skipped, together with their launches.

Why: two start-up steps take a kernel's compile off the engine's thread and must keep a launch
from compiling it there meanwhile. The warm-up records the `fused_moe_kernel` variants its
forwards meet, to build them on threads (`moe_warm_up.deferring_fused_moe_compiles`,
`warm_up_compile_threads`); vLLM's profile run skips its launch of `_topk_topp_kernel` while
that kernel compiles on a thread of its own (`sampler_warm_up.SamplerCompile.profiling`).
How: `skipping(kernel, skip)` installs a hook that Triton's JIT calls before it compiles a
variant it does not hold (with the keyword arguments `_call_hook` passes); for `kernel` (its
module and name) it asks `skip(kwargs)`, and a true answer makes the JIT neither compile nor
launch. Every other compile goes to the hook that was there before, which is back on leaving
(unless something else replaced ours meanwhile), also when the block raises.
Removal: when vLLM warms its own fused-MoE variants before serving and compiles its sampling
kernel off the profile run's critical path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def skipping(kernel: tuple[str, str],
             skip: Callable[[dict[str, Any]], bool]) -> Iterator[None]:
    """Inside the block a compile of `kernel` (module, name) that `skip` answers true for is
    skipped with its launch; every other compile goes to the hook that was there before."""
    from triton import knobs

    previous = knobs.runtime.jit_cache_hook

    def hook(**kwargs: Any) -> Any:
        info = kwargs["fn"]
        if (str(info.module), info.name) == kernel and skip(kwargs):
            return True  # Triton's JIT: no compile, no launch
        return previous(**kwargs) if previous is not None else None

    knobs.runtime.jit_cache_hook = hook
    try:
        yield
    finally:
        if knobs.runtime.jit_cache_hook is hook:
            knobs.runtime.jit_cache_hook = previous
