"""Start-up work of `MoeGraphsModelRunner.capture_model` (vLLM calls it before the engine is
ready): the kernel warm-up, always, and with `precapture: true` the capture of every bucket pair.

Warm-up: vLLM's profile run builds no attention metadata, so our attention kernels (and the V1
runner's slot-mapping kernel) would otherwise be compiled by the first requests, a latency spike
that vLLM's JIT monitor reports. Each graph key's decode batch (at its context bucket) and one
prefill batch per tile size of the prefill kernel run eagerly through vLLM's `_dummy_run`,
then, for MoE models, the token counts that reach every variant of vLLM's fused-MoE kernel
(`moe_warm_up.py`), through the layers up to the first MoE layer; nothing is captured.

Precapture: vLLM's `_dummy_run` prepares each key's padded batch (inputs, attention metadata,
forward context) and calls the model; inside `GraphLifecycle.capturing(key)`, `PrecaptureModel`
stands in for the model there and captures that key. With `mixed_graphs` the keys of steps with
prefill tokens come first, one per token bucket, largest first: a dummy step of one-token
requests, as many as the key pads requests to, which vLLM pads to the key's tokens (the graph
of a token bucket serves every mix of requests within it).

The runner and its `GraphLifecycle` come in as the protocols below (what this module uses of
them), not as their classes: runner/ imports this module, never the reverse."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Protocol

import torch
from vllm.config import CUDAGraphMode

from vllm_moe_graphs.integration.startup.moe_warm_up import (
    compile_in_parallel,
    counting_triton_builds,
    deferring_fused_moe_compiles,
    moe_token_counts,
    recording_moe_configs,
)
from vllm_moe_graphs.integration.patch.model_layer_range import first_moe_layer_only

if TYPE_CHECKING:
    from vllm_moe_graphs.config import PluginConfig
    from vllm_moe_graphs.graphs.buckets import GraphKey
    from vllm_moe_graphs.graphs.runner import DecodeGraphRunner
    from vllm_moe_graphs.integration.model.moe_padding import MoePadding

logger = logging.getLogger("vllm.moe_graphs")

PREFILL_WARM_UP_TOKENS = (2, 4, 8, 16, 32, 64)  # ops/prefill.py: BLOCK_Q <= 64 query tokens


class DummyBatchRunner(Protocol):
    """What the start-up work uses of the V1 model runner (`MoeGraphsModelRunner`): vLLM's dummy
    batch, the sizes it may take, the model, and the block table's slot-mapping kernel."""

    max_num_tokens: int
    max_model_len: int
    device: torch.device
    compilation_config: Any  # vLLM's CompilationConfig (its `mode`)
    input_batch: Any  # vLLM's InputBatch (its `block_table`)

    def _dummy_run(self, num_tokens: int, **kwargs: Any) -> Any: ...

    def get_model(self) -> Any: ...


class CaptureLifecycle(Protocol):
    """What precapture and idle capture use of the runner's `GraphLifecycle`."""

    config: PluginConfig
    graphs: DecodeGraphRunner | None
    moe_padding: MoePadding | None
    idle_settled: bool

    @property
    def model(self) -> Any: ...

    def capturing(self, key: GraphKey) -> contextlib.AbstractContextManager[None]: ...

    def capture(self, key: GraphKey, args: dict[str, Any]) -> torch.Tensor: ...

    def publish(self) -> None: ...


def precapture_all(runner: DummyBatchRunner, lifecycle: CaptureLifecycle) -> int:
    """Warm the kernels up, then capture every key when configured (else log the lazy plan);
    returns the pool bytes."""
    config, graphs = lifecycle.config, lifecycle.graphs
    warm_up_kernels(runner, graphs, decode_keys=not config.precapture,
                    moe_padding=lifecycle.moe_padding,
                    compile_threads=min(config.warm_up_compile_threads, os.cpu_count() or 1))
    if not config.precapture:
        logger.info("moe_graphs: graphs are captured lazily, on first use of each key "
                    "after %d warm-up steps%s", config.warmup_steps,
                    ", or while the engine waits for requests (idle_capture)"
                    if config.idle_capture else "")
        return 0
    keys = capture_order(graphs)
    decode = sum(k.decode for k in keys)
    logger.info("moe_graphs: pre-capturing %d graphs (precapture=true: %d decode keys, %d of "
                "steps with prefill tokens)", len(keys), decode, len(keys) - decode)
    start = time.perf_counter()
    for i, key in enumerate(keys):
        capture_key(runner, lifecycle, key)
        if (i + 1) % 8 == 0 or i + 1 == len(keys):
            logger.info("moe_graphs: pre-captured %d/%d (%.1f s)", i + 1, len(keys),
                        time.perf_counter() - start)
    return graphs.pool_bytes


def capture_order(graphs: DecodeGraphRunner) -> tuple[GraphKey, ...]:
    """Every key, in the order precapture and idle capture take them: the keys of steps with
    prefill tokens (largest token bucket first), then the decode keys (largest batch first), so
    that smaller graphs reuse the shared pool's memory."""
    return graphs.mixed_keys() + graphs.all_keys()


def capture_key(runner: DummyBatchRunner, lifecycle: CaptureLifecycle, key: GraphKey) -> None:
    """Capture `key` from vLLM's dummy batch of it (a failure quarantines the key). Its slot
    mapping is -1 (no KV write), so it may run between steps too."""
    with lifecycle.capturing(key):
        if key.decode:
            # NOTE: every row at the key's context bucket, as a real step of that key would
            # plan it (the decode kernel's split count is a function of the bucket). vLLM's
            # capture flag would plan every key for max_model_len.
            runner._dummy_run(key.batch_bucket, cudagraph_runtime_mode=CUDAGraphMode.FULL,
                              uniform_decode=True, skip_eplb=True, remove_lora=False,
                              is_graph_capturing=False,
                              profile_seq_lens=key.context_bucket)  # <= max_model_len
        else:  # request_bucket one-token requests (<= max_num_seqs), padded to the key; each
            # a one-token sequence (a longer dummy context could pass max_model_len)
            runner._dummy_run(key.request_bucket, cudagraph_runtime_mode=CUDAGraphMode.FULL,
                              uniform_decode=False, skip_eplb=True, remove_lora=False,
                              is_graph_capturing=False, profile_seq_lens=1)


def idle_capture_one(runner: DummyBatchRunner, lifecycle: CaptureLifecycle) -> bool:
    """`idle_capture`, called while the engine waits for requests: capture the first key, in
    precapture's order, that has no graph and may be captured now; returns whether another
    one remains (False: nothing to do until something changes, e.g. graphs dropped, the kill
    file removed)."""
    graphs = lifecycle.graphs
    if not lifecycle.config.idle_capture or graphs is None or graphs.closed:
        return False
    keys = capture_order(graphs)
    pending = graphs.capturable(keys)
    if pending:
        capture_key(runner, lifecycle, pending[0])
        lifecycle.publish()
        lifecycle.idle_settled = False
        if len(pending) > 1:
            return True
    if not lifecycle.idle_settled:
        # NOTE: an operator's (and the serving benchmark's) sign that traffic meets no capture
        # pause from here on (or that the rest is denied: the budget, the kill switch); said
        # once, and again only after later captures.
        lifecycle.idle_settled = True
        live, quarantined = set(graphs.keys), graphs.quarantined
        denied = sum(k not in live and k not in quarantined for k in keys)
        logger.info("moe_graphs: idle capture done: no key left to capture (%d graphs, %d "
                    "quarantined, %d denied now, pool %.0f MiB)", len(live), len(quarantined),
                    denied, graphs.pool_bytes / 2**20)
    return False


def warm_up_kernels(runner: DummyBatchRunner, graphs: DecodeGraphRunner,
                    decode_keys: bool = True, moe_padding: MoePadding | None = None,
                    compile_threads: int = 0) -> float:
    """Run every kernel shape class a request can meet once, eagerly, before the engine is
    ready; returns the seconds it took. `decode_keys=False` leaves the decode batches to the
    pre-capture (whose warm-up steps run them). Where `moe_padding` has layers on the fused
    routing (`fuse_moe_padding_mask`), one forward runs padded: that kernel's variant for
    padding rows. `compile_threads` > 0 (`warm_up_compile_threads`) compiles the fused-MoE
    kernel's variants on that many threads first (`_warm_up`). A failure stops the start-up
    with the remedy: a request would meet it too."""
    start = time.perf_counter()
    keys = graphs.all_keys() if decode_keys else []
    try:
        prefill, moe, depth = _warm_up(runner, keys, compile_threads)
        padded = moe_padding is not None and moe_padding.fused > 0
        if padded:
            with moe_padding.padded(1):  # a 2-row forward, its second row padding
                runner._dummy_run(2, cudagraph_runtime_mode=CUDAGraphMode.NONE, skip_eplb=True,
                                  remove_lora=False)
    except Exception as exc:
        raise RuntimeError(
            f"moe_graphs: the kernel warm-up before serving failed ({type(exc).__name__}: "
            f"{exc}); the first requests would meet the same failure. Set MOE_GRAPHS_DISABLE=1 "
            "to run stock vLLM.") from exc
    seconds = time.perf_counter() - start
    logger.info("moe_graphs: kernels warmed up before serving (%d decode batches, %d prefill "
                "batches, %d fused-MoE token counts%s%s, slot mapping) in %.2f s", len(keys),
                prefill, moe, "" if depth is None or not moe else
                f" through {depth} layer{'s' * (depth > 1)} (up to the first MoE layer)",
                ", a padded MoE forward" if padded else "", seconds)
    return seconds


def _warm_up(runner: DummyBatchRunner, keys: list[GraphKey],
             compile_threads: int = 0) -> tuple[int, int, int | None]:
    """`warm_up_kernels`' runs; returns the numbers of prefill batches and of fused-MoE token
    counts, and how many layers the token counts ran through (None: every layer)."""
    # Prefill batches: the prefill kernel's tile is sized by the batch's longest query (a
    # power of 2, at most 64), one compile per size; then a long prefill row next to decode
    # rows (vLLM gives it seq_len = its query length + 1: within max_model_len). Every row's
    # context stays within max_model_len; the slot mapping is -1 (no KV write).
    limit = min(runner.max_num_tokens, runner.max_model_len - 1)
    prefill = [n for n in PREFILL_WARM_UP_TOKENS if n <= limit]
    # `compile_threads`: the fused-MoE variants these batches meet are recorded (their launches
    # skipped); where Triton built any other kernel for them (a fresh node), the token counts'
    # variants are recorded too, all compiled on the threads before the token counts run;
    # where its disk cache held every kernel, the recorded variants load from it and the token
    # counts run as without the setting (recording them would cost more than it saves).
    # NOTE: with `compile_threads` 0 neither of Triton's knobs is touched (the setting's
    # rollback runs the warm-up exactly as before it existed).
    deferring = deferring_fused_moe_compiles() if compile_threads else contextlib.nullcontext()
    counting = counting_triton_builds() if compile_threads else contextlib.nullcontext([])
    with recording_moe_configs() as moe_configs, counting as built, deferring as deferred:
        for key in keys:
            # NOTE: eager (NONE) with attention metadata; the runner decides nothing outside
            # execute_model, so no graph, decision or metric sees these batches.
            runner._dummy_run(key.batch_bucket, cudagraph_runtime_mode=CUDAGraphMode.NONE,
                              force_attention=True, uniform_decode=True, skip_eplb=True,
                              remove_lora=False, profile_seq_lens=key.context_bucket)
        for n in prefill:
            runner._dummy_run(n, cudagraph_runtime_mode=CUDAGraphMode.NONE,
                              force_attention=True, skip_eplb=True, remove_lora=False)
        if limit >= 2:
            runner._dummy_run(limit, cudagraph_runtime_mode=CUDAGraphMode.NONE,
                              force_attention=True, create_mixed_batch=True, skip_eplb=True,
                              remove_lora=False)
        # The fused-MoE kernel's variants by token count (moe_warm_up.py); no attention, so
        # any count up to max_num_tokens fits.
        done = [k.batch_bucket for k in keys] + prefill + ([limit] if limit >= 2 else [])
        moe = moe_token_counts(moe_configs, runner.max_num_tokens, done)
        fresh = deferred is not None and bool(built)
        if fresh:
            _run_token_counts(runner, moe)
    if deferred is not None:
        _compile_moe_variants(deferred, sorted(set(done) | set(moe if fresh else ())),
                              compile_threads)
    depth = _run_token_counts(runner, moe)
    _warm_up_slot_mapping(runner)
    if torch.device(runner.device).type == "cuda":
        torch.cuda.synchronize(runner.device)
    return len(prefill) + (limit >= 2), len(moe), depth


def _run_token_counts(runner: DummyBatchRunner, counts: list[int]) -> int | None:
    """The fused-MoE token counts, each once, eagerly and without attention; returns how many
    layers they ran through (None: every layer)."""
    if not counts:
        return None
    # NOTE: only the MoE layers depend on the token count here (no attention), and every MoE
    # layer has the same shapes: the first one compiles every variant
    # (patch/model_layer_range.py); the layers after it would only cost time.
    with _first_moe_layer_only(runner) as depth:
        for n in counts:
            runner._dummy_run(n, cudagraph_runtime_mode=CUDAGraphMode.NONE, skip_eplb=True,
                              remove_lora=False)
    return depth


def _first_moe_layer_only(runner: DummyBatchRunner) -> Any:
    """`patch/model_layer_range.first_moe_layer_only` where the model runs as Python
    (compilation mode NONE, as the take-over sets it); else a block that cuts nothing (a
    torch.compile'd forward would not see the cut, or compile again for it)."""
    from vllm.config.compilation import CompilationMode

    if getattr(runner.compilation_config, "mode", None) != CompilationMode.NONE:
        return contextlib.nullcontext(None)
    return first_moe_layer_only(runner.get_model())


def _compile_moe_variants(deferred: dict[str, tuple[Any, str]], counts: list[int],
                          threads: int) -> None:
    """`warm_up_compile_threads`: the fused-MoE kernel's variants that `_warm_up`'s runs of
    `counts` tokens recorded, their launches skipped (outputs zeroed: the later layers compute
    meaningless but finite values, and route to experts in range), compiled on `threads`
    threads (logged with how many Triton built, the rest loaded from its disk cache). Later
    runs find them compiled; a variant the record missed compiles there, as without this
    setting."""
    if not deferred:  # vLLM's fused-MoE kernel is not Triton's (no GPU), or all compiled
        return
    start = time.perf_counter()
    compiled = compile_in_parallel(deferred.values(), threads)
    logger.info("moe_graphs: %d fused-MoE kernel variants of %d token counts (%d..%d) compiled "
                "on %d threads in %.2f s, %d built, the rest from Triton's cache",
                compiled.variants, len(counts), min(counts, default=0), max(counts, default=0),
                threads, time.perf_counter() - start, compiled.built)


def _warm_up_slot_mapping(runner: DummyBatchRunner) -> None:
    """The V1 runner's slot-mapping kernel (`BlockTable.compute_slot_mapping`), which its input
    preparation runs for every step vLLM prepares: one token on the real block tables, whose
    output buffer every later step rewrites."""
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=runner.device)
    positions = torch.zeros(1, dtype=torch.int64, device=runner.device)
    runner.input_batch.block_table.compute_slot_mapping(1, qsl, positions)


class PrecaptureModel:
    """Stands in for `runner.model` inside `GraphLifecycle.capturing(key)`: vLLM's `_dummy_run`
    prepares a padded decode batch under its forward context and calls the model; this captures
    that key (with the LM head inside when a real step of the key would have it,
    `logits_in_graph`)."""

    def __init__(self, lifecycle: CaptureLifecycle, key: GraphKey) -> None:
        self._lifecycle, self._key = lifecycle, key

    def __call__(self, **kwargs: Any) -> torch.Tensor:
        return self._lifecycle.capture(self._key, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lifecycle.model, name)
