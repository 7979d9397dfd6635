"""The fused-MoE part of the start-up warm-up: every variant of vLLM's Triton MoE kernel that a
batch can meet is compiled before the engine is ready.

vLLM 0.26's Triton experts (`fused_moe/experts/triton_moe.py`) take the kernel's tile config
from the batch's token count M (`try_get_optimal_moe_config`: a tuned table's nearest entry, or
size thresholds), and Triton compiles one kernel per config and per specialisation of its
integer arguments (divisibility by 16 of the valid and padded token counts, which flips with
M's parity for Qwen3-MoE's shapes) and per path: below M * top_k * 4 <= experts vLLM skips the
block alignment (`naive_block_assignment`), and below BLOCK_SIZE_M it bounds the padded count
differently. Stock vLLM's torch.compile + CUDA-graph capture runs about 67 token counts at
start-up; without it, a request batch of a token count between the warmed sizes compiled
`fused_moe_kernel` while serving (the Qwen3-30B-A3B GPU tests: vLLM's JIT monitor).

So: while the warm-up's first batches run, the arguments vLLM passes to
`try_get_optimal_moe_config` are recorded (weights' shapes, top-k, dtype name, block shape);
the token counts 1..max_num_tokens are then grouped by the config vLLM would pick, and for each
group its two smallest and two largest counts (both parities at both ends) and the counts on
either side of the two path boundaries above run once, eagerly and without attention (only the
MoE layers depend on M here), unless the warm-up ran them already, and only through the layers
up to the first MoE layer: every MoE layer has the same shapes, so it meets every variant
(`patch/model_layer_range.py`). The GPU tests check the
result with vLLM's JIT monitor (no fused-MoE compile while serving). A dense model, or an MoE
path that does not go through the Triton experts, records nothing and adds nothing.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from vllm_moe_graphs.integration.patch import (
    fused_moe_pre_run,
    jit_cache_hook,
    moe_config_lookup,
)
from vllm_moe_graphs.integration.patch.moe_config_lookup import CONFIG_FUNCTION

logger = logging.getLogger("vllm.moe_graphs")

CONFIG_PARAMETERS = ("w1_shape", "w2_shape", "top_k", "dtype", "M", "block_shape")


@dataclass(frozen=True)
class MoeCall:
    """One argument set vLLM passed to `try_get_optimal_moe_config`: M -> the config it picks,
    and the experts and top-k of the layer."""

    config_of: Callable[[int], dict]
    num_experts: int
    top_k: int


def _triton_experts_module() -> Any | None:
    try:
        from vllm.model_executor.layers.fused_moe.experts import triton_moe
    except Exception:  # noqa: BLE001 - a vLLM build without them: nothing to warm
        return None
    fn = getattr(triton_moe, CONFIG_FUNCTION, None)
    try:
        params = tuple(inspect.signature(fn).parameters) if callable(fn) else ()
    except (TypeError, ValueError):
        params = ()
    if params != CONFIG_PARAMETERS:
        logger.warning("moe_graphs: %s.%s is not vLLM 0.26.0's (parameters %s); the fused-MoE "
                       "token counts are left out of the warm-up", triton_moe.__name__,
                       CONFIG_FUNCTION, params)
        return None
    return triton_moe


@contextlib.contextmanager
def recording_moe_configs() -> Iterator[list[MoeCall]]:
    """Inside the block, every call of vLLM's `try_get_optimal_moe_config` is recorded; the
    yielded list gets one `MoeCall` per distinct argument set (M aside)."""
    found: list[MoeCall] = []
    module = _triton_experts_module()
    if module is None:
        yield found
        return
    seen: set[str] = set()

    def recording_of(original: Callable[..., dict]) -> Callable[..., dict]:
        signature = inspect.signature(original)

        def recording(*args: Any, **kwargs: Any) -> dict:
            bound = signature.bind(*args, **kwargs)
            rest = {k: v for k, v in bound.arguments.items() if k != "M"}
            key = repr(sorted((k, tuple(v) if isinstance(v, (list, tuple)) else v)
                              for k, v in rest.items()))
            if key not in seen:
                seen.add(key)
                found.append(MoeCall(lambda m, rest=rest: original(**rest, M=m),
                                     num_experts=int(rest["w2_shape"][0]),
                                     top_k=int(rest["top_k"])))
            return original(*args, **kwargs)

        return recording

    with moe_config_lookup.replaced(module, recording_of):
        yield found


def moe_token_counts(calls: Iterable[MoeCall], limit: int, done: Iterable[int] = ()) -> list[int]:
    """Token counts (ascending) in 1..`limit` that reach, for each recorded call, every config
    group's ends with both parities and both sides of the path boundaries; less `done`."""
    want: set[int] = set()
    for call in calls:
        groups: list[list[Any]] = []  # [lo, hi, config] runs of equal config
        for m in range(1, limit + 1):
            cfg = call.config_of(m)
            if groups and groups[-1][2] == cfg:
                groups[-1][1] = m
            else:
                groups.append([m, m, cfg])
        naive = call.num_experts // (4 * call.top_k)  # the last M of the naive path
        for lo, hi, cfg in groups:
            bm = int(cfg.get("BLOCK_SIZE_M", 0))
            edges = (lo, lo + 1, hi - 1, hi, naive, naive + 1, bm - 1, bm, bm + 1)
            want.update(m for m in edges if lo <= m <= hi)
    return sorted(want - set(done))


# The kernel whose compiles `warm_up_compile_threads` takes off the warm-up's critical path:
# vLLM's `fused_moe_kernel` (fused_moe/fused_moe.py), which writes only values (the experts'
# outputs, its third argument); no other kernel is deferred.
DEFERRED_KERNEL = ("vllm.model_executor.layers.fused_moe.fused_moe", "fused_moe_kernel")


def _zero_output(*args: Any, **kwargs: Any) -> None:
    """A pre-run hook of the deferred kernel: its output zeroed before each launch, so that a
    skipped launch leaves zeros (finite values, from which every routing kernel picks expert
    ids in range) rather than whatever memory held."""
    if len(args) > 2 and hasattr(args[2], "zero_"):
        args[2].zero_()


@contextlib.contextmanager
def deferring_fused_moe_compiles() -> Iterator[dict[str, tuple[Any, str]]]:
    """Inside the block, a compile of `DEFERRED_KERNEL` that Triton's JIT is about to run is
    recorded instead (the yielded dict: its cache key -> the JIT function and Triton's
    specialization data) and skipped together with that launch, whose output is left zeroed
    (`_zero_output`); every other compile goes to the hook that was there before. On leaving,
    that hook is back and the kernel runs as before."""
    from vllm.model_executor.layers.fused_moe import fused_moe

    found: dict[str, tuple[Any, str]] = {}

    def record(kwargs: dict[str, Any]) -> bool:
        found.setdefault(str(kwargs["key"]), (kwargs["fn"].jit_function,
                                              kwargs["compile"]["specialization_data"]))
        return True

    # NOTE: Triton's JIT runs a JIT function's pre-run hooks before it looks for a compiled
    # variant, so the zeroing runs whether or not the launch is skipped.
    with jit_cache_hook.skipping(DEFERRED_KERNEL, record), fused_moe_pre_run.appended(
            getattr(fused_moe, DEFERRED_KERNEL[1], None), _zero_output):
        yield found


@contextlib.contextmanager
def counting_triton_builds() -> Iterator[list[str]]:
    """Inside the block, each Triton compile its disk cache did not hold (a build, as Triton's
    compilation listener reports it, from any thread) appends its kernel's name to the yielded
    list; the listener that was there before hears every compile still."""
    from triton import knobs

    built: list[str] = []
    previous = knobs.compilation.listener

    def listen(**kwargs: Any) -> None:
        if not kwargs.get("cache_hit", False):
            # list.append: one bytecode, safe from the compile pool's threads
            built.append(str(getattr(kwargs.get("src"), "name", "?")))
        if previous is not None:
            previous(**kwargs)

    knobs.compilation.listener = listen
    try:
        yield built
    finally:
        if knobs.compilation.listener is listen:
            knobs.compilation.listener = previous


class Compiled(NamedTuple):
    """What `compile_in_parallel` did: variants compiled into their kernels' caches, and how
    many of those Triton built (the rest it loaded from its disk cache)."""
    variants: int
    built: int


def compile_in_parallel(specs: Iterable[tuple[Any, str]], threads: int) -> Compiled:
    """Compile the recorded kernels (`deferring_fused_moe_compiles`) on `threads` threads into
    their JIT functions' caches, through Triton's own kernel preload and asynchronous compile
    mode (Triton's compile spends much of its time in ptxas and other subprocesses, outside
    the GIL). Raises what a compile raises."""
    from concurrent.futures import ThreadPoolExecutor

    from triton.runtime._async_compile import AsyncCompileMode

    specs = list(specs)
    if not specs:
        return Compiled(0, 0)
    with counting_triton_builds() as built:
        with ThreadPoolExecutor(max_workers=threads,
                                thread_name_prefix="moe_graphs-compile") as pool:
            with AsyncCompileMode(pool):
                for jit_function, specialization_data in specs:
                    jit_function.preload(specialization_data)
    return Compiled(len(specs), len(built))
