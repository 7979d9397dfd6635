"""Patch: `vllm.model_executor.layers.fused_moe.experts.triton_moe.try_get_optimal_moe_config`,
for the length of the start-up kernel warm-up.

Why: vLLM's fused-MoE kernel picks its launch config (and so which Triton variant compiles)
from the batch's token count through this function; the warm-up must learn, per MoE layer
shape, which token counts reach which variant (`integration/startup/moe_warm_up.py`), and vLLM
exposes no other way to ask what a layer would look up.
How: `replaced(wrapper)` sets the module function to `wrapper(original)` inside a `with` block
and restores the original on exit, also when the block raises. The wrapper calls the original
with the same arguments and returns its result unchanged.
Removal: when vLLM exposes the fused-MoE config selection per layer (or warms its own kernels
for every config group).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

CONFIG_FUNCTION = "try_get_optimal_moe_config"  # in vllm...fused_moe.experts.triton_moe


@contextlib.contextmanager
def replaced(module: Any, wrapper: Callable[[Callable[..., dict]], Callable[..., dict]]
             ) -> Iterator[Callable[..., dict]]:
    """Inside the block `module.try_get_optimal_moe_config` is `wrapper(original)`; yields the
    original."""
    original = getattr(module, CONFIG_FUNCTION)
    setattr(module, CONFIG_FUNCTION, wrapper(original))
    try:
        yield original
    finally:
        setattr(module, CONFIG_FUNCTION, original)
