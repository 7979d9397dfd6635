"""Patch: the decoder stack's `end_layer` (instance), for the length of the start-up warm-up's
fused-MoE token counts.

Why: the warm-up runs some 50-60 token counts through the model only so that every variant of
vLLM's fused-MoE kernel is compiled before serving (`integration/startup/moe_warm_up.py`), and runs
them twice on a fresh node (recorded, then run). Every MoE layer of a Qwen3-MoE model has the same
shapes, so the first one meets every variant the others would; the others' forwards only cost
time (on the H200, Qwen3-30B-A3B's 48 layers made the token counts about 3 s of a restart's
5.7-6.5 s to ready, and about 4 s more of a fresh node's warm-up).
How: `first_moe_layer_only(model)` finds the decoder stack (the module with `layers`,
`start_layer` and `end_layer`, as vLLM 0.26's Qwen3 and Qwen3-MoE models build it with
`make_layers`, whose `forward` runs `islice(self.layers, self.start_layer, self.end_layer)`) and
the first layer of its range that holds a vLLM fused-MoE layer (`MoERunner`), and sets
`end_layer` to the index after it inside a `with` block, restoring it on exit, also when the
block raises; it yields how many layers run (None: the model runs at full depth). It cuts
nothing where the stack's `forward` does not read `self.end_layer`, where vLLM compiles the
stack with torch.compile (`do_not_compile` False: its compiled forward skips the guards that
would see the attribute; the plugin's take-over sets compilation mode NONE), where no layer
holds a fused-MoE layer, or where vLLM's prefetch offloader runs (its per-layer hooks expect
every layer of a forward in turn; the UVA offloader's host-resident weights need no hook).
Removal: when vLLM warms its own fused-MoE variants before serving (the warm-up's token counts
go with it).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

LAYER_LOOP = "self.end_layer"  # what vLLM 0.26's decoder stacks' forward reads


def decoder_stack(model: Any) -> Any | None:
    """The first module of `model` with a `layers` list and an int `start_layer` / `end_layer`
    whose class' `forward` reads `self.end_layer`, unless vLLM compiles it; None if there is
    none (or `model` is no `torch.nn.Module`)."""
    import torch

    if not isinstance(model, torch.nn.Module):
        return None
    for module in model.modules():
        if not (isinstance(getattr(module, "layers", None), torch.nn.ModuleList)
                and isinstance(getattr(module, "start_layer", None), int)
                and isinstance(getattr(module, "end_layer", None), int)):
            continue
        try:
            source = inspect.getsource(type(module).forward)
        except (OSError, TypeError):
            return None
        compiled = getattr(module, "do_not_compile", True) is False  # @support_torch_compile
        return module if LAYER_LOOP in source and not compiled else None
    return None


def first_moe_index(stack: Any) -> int | None:
    """Index of the first layer in the stack's range that holds a vLLM `MoERunner`."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    for index in range(stack.start_layer, stack.end_layer):
        if any(isinstance(m, MoERunner) for m in stack.layers[index].modules()):
            return index
    return None


def _prefetch_offload() -> bool:
    from vllm.model_executor.offloader.base import get_offloader
    from vllm.model_executor.offloader.prefetch import PrefetchOffloader

    return isinstance(get_offloader(), PrefetchOffloader)


@contextlib.contextmanager
def first_moe_layer_only(model: Any) -> Iterator[int | None]:
    """Inside the block `model`'s forward runs its layers up to the first MoE layer only;
    yields how many (None: unchanged, full depth)."""
    stack = decoder_stack(model)
    index = None if stack is None else first_moe_index(stack)
    if index is None or _prefetch_offload():
        yield None
        return
    end = stack.end_layer
    stack.end_layer = index + 1
    try:
        yield index + 1 - stack.start_layer
    finally:
        stack.end_layer = end
