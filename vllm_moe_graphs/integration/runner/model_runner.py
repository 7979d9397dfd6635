"""`MoeGraphsModelRunner`: vLLM 0.26's V1 `GPUModelRunner` with the plugin's decode CUDA graphs.

A thin subclass: each override calls vLLM's method and forwards to the runner's one
`GraphLifecycle` (`integration/runner/lifecycle.py`), which owns the KV storage binding, the graph
runner, the per-step plan and the start-up work. vLLM's own capture is off for engines it runs
in (`cudagraph_mode=NONE`, set by `hooks.take_over_decode_graphs`), so the plugin's graphs are
the only ones.

Overridden `GPUModelRunner` methods (exactly these; `test_override_signatures` introspects them;
`signatures.RUNNER_OVERRIDES` holds their parameters):

method                                  | parameters after self                                | hook
--------------------------------------- | ---------------------------------------------------- | ------------
`__init__`                              | vllm_config, device                                  | lifecycle
`load_model`                            | load_dummy_weights                                   | sampler compile, register
`profile_run`                           |                                                      | sampler launches skipped
`initialize_kv_cache`                   | kv_cache_config, is_profiling                        | bind, graphs
`_cleanup_profiling_kv_cache`           |                                                      | unbind first
`post_kv_cache_wake_up`                 |                                                      | revalidate
`reload_weights`                        | weights_iterator, weights_path, is_checkpoint_format | invalidate
`shutdown`                              |                                                      | close
`execute_model`                         | scheduler_output, intermediate_tensors               | step scope
`_prepare_inputs`                       | scheduler_output, num_scheduled_tokens               | decode inputs
`_build_attention_metadata`             | num_tokens, num_reqs, max_query_len, num_tokens_padded, num_reqs_padded, ubatch_slices, logits_indices, use_spec_decode, for_cudagraph_capture, num_scheduled_tokens, cascade_attn_prefix_lens, slot_mappings | skip on replay
`_determine_batch_execution_and_padding` | num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens, use_cascade_attn, allow_microbatching, force_eager, force_uniform_decode, force_has_lora, force_num_active_loras, num_encoder_reqs | plan, pad
`_model_forward`                        | input_ids, positions, intermediate_tensors, inputs_embeds, model_kwargs | replay
`_sample`                               | logits, spec_decode_metadata                         | sampler graph
`_bookkeeping_sync`                      | scheduler_output, sampler_output, logits, hidden_states, num_scheduled_tokens | decode bookkeeping
`capture_model`                         |                                                      | warm-up, precapture, sampler compile joined, sampling variants

lifecycle: create the `GraphLifecycle` (it reads the plugin config and creates the one
`PagedKVStorage`); register: classify the model and its attention layers by exact type and
install the configured kernels; sampler compile: vLLM's top-k/top-p sampling kernel compiled on
a thread of its own from the start of the load, its launches in the profile run skipped (their
samples are discarded), the thread joined after the warm-up, before vLLM's own sampler warm-up
(`integration/startup/sampler_warm_up.py`); sampling variants: once, after the first capture, a
subprocess compiles the sampling kernel's other variants into Triton's cache
(`integration/startup/sampling_variants.py`); bind: phase profiling or serving; graphs: start the
decode graphs (and the decode inputs, in-graph logits) once the serving bind holds. Each hook runs
after super(), except the sampler compile and its skipped launches, the unbind (super frees
the memory it must release), close (also when super raises) and the per-step ones below.

Per step (`execute_model`, one `GraphLifecycle` step scope): a pure-decode step's inputs go to
vLLM's persistent buffers through `integration/runner/decode_inputs.py`, any other step's through
vLLM; then `_determine_batch_execution_and_padding` plans the step (`GraphLifecycle.plan`, host ints
only: one frozen `StepPlan`). On a graph path (replay, capture, warm-up) it returns vLLM's FULL
runtime mode with a `BatchDescriptor` of the bucket, so vLLM pads inputs, slot mapping (-1) and
attention metadata (seq_len 0, null block) to the bucket as for its own FULL graphs; an eager
fallback returns vLLM's unpadded NONE. A lean replay builds no attention metadata (the graph
reads the persistent buffers). `_model_forward` runs the plan through the `DecodeGraphRunner`,
which hands back only the real rows; on graph paths of batch buckets up to 64 the forward
includes the LM head (`integration/model/graph_logits.py`), whose logits vLLM's `compute_logits`
call then receives. With `sample_in_graph`, vLLM's `sample_tokens` calls `_sample`, which replays
a sampler graph over those logits where the batch allows
(`integration/runner/graph_sampling.py`), else runs vLLM's sampler.

Called, not overridden: `get_model(self)`, `_dummy_run(self, num_tokens, ...)` (warm-up,
precapture), `input_batch.block_table.compute_slot_mapping` (warm-up).

vLLM 0.26.0 lifecycle (V1, one worker; `Worker` is `v1/worker/gpu_worker.py`):

    Worker.init_device                 -> GPUModelRunner(vllm_config, device)        (__init__)
    Worker.load_model                  -> load_model                (sampler compile, register)
    Worker.determine_available_memory  -> profile_run (no KV cache bound at all; sampler
                                          launches skipped)
                                       -> profile_cudagraph_memory, only when cudagraph_mode
                                          != NONE on CUDA and no kv_cache_memory_bytes:
                                          _init_minimal_kv_cache_for_profiling
                                            -> initialize_kv_cache(cfg, is_profiling=True)  (bind)
                                          throw-away graph captures
                                          _cleanup_profiling_kv_cache                (unbind)
    Worker.initialize_from_config      -> initialize_kv_cache(cfg)  (is_profiling=False, bind)
    Worker.compile_or_warm_up_model    -> _dummy_run(...), capture_model()  (warm-up, precapture,
                                          sampler compile joined, sampling variants started),
                                          then vLLM's sampler warm-up
    per step: execute_model -> _determine_batch_execution_and_padding             (plan)
                            -> _model_forward                                    (replay)
              sample_tokens -> _sample                                    (sampler graph)
    Worker.wake_up(tags)               -> post_kv_cache_wake_up (only if tags is None or has
                                          "kv_cache")                                (revalidate)
    Worker.reload_weights              -> reload_weights                             (invalidate)
    Worker.shutdown                    -> shutdown -> _cleanup_profiling_kv_cache    (unbind, close)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import BatchDescriptor
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_moe_graphs.config import plugin_config
from vllm_moe_graphs.integration.runner.lifecycle import GraphLifecycle
from vllm_moe_graphs.integration.startup.sampler_warm_up import (
    SamplerCompile,
    start_for_profile_run,
)
from vllm_moe_graphs.integration.startup.sampling_variants import (
    ServingVariantsCompile,
    start_for_runner,
)
from vllm_moe_graphs.kv.storage import Phase

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.sequence import IntermediateTensors
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig


class MoeGraphsModelRunner(GPUModelRunner):
    """V1 runner with the plugin's decode graphs (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        self.moe_graphs = GraphLifecycle(self, plugin_config(vllm_config.additional_config))
        self.sampler_compile: SamplerCompile | None = None
        self.sampling_variants: ServingVariantsCompile | None = None

    def load_model(self, load_dummy_weights: bool = False) -> None:
        self.sampler_compile = start_for_profile_run(
            self, self.moe_graphs.config.warm_up_compile_threads)
        super().load_model(load_dummy_weights=load_dummy_weights)
        self.moe_graphs.register(self.get_model())

    def profile_run(self) -> None:
        if self.sampler_compile is None:
            return super().profile_run()
        with self.sampler_compile.profiling():
            return super().profile_run()

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig,
                            is_profiling: bool = False) -> None:
        super().initialize_kv_cache(kv_cache_config, is_profiling=is_profiling)
        self.moe_graphs.bind(Phase.PROFILING if is_profiling else Phase.SERVING)
        if not is_profiling:
            self.moe_graphs.start()

    def _cleanup_profiling_kv_cache(self) -> None:
        # NOTE: unbind first: the storage holds strong references, and super() drops vLLM's and
        # then empties the allocator cache; unbinding after it would keep the throw-away cache
        # allocated (and skew the KV memory vLLM computes next). vLLM also calls this from
        # shutdown(), for the serving cache.
        self.moe_graphs.unbind("vLLM freed the KV cache (_cleanup_profiling_kv_cache)")
        super()._cleanup_profiling_kv_cache()

    def post_kv_cache_wake_up(self) -> None:
        super().post_kv_cache_wake_up()
        # Sleep discarded the KV contents (and, at level 2, the weights): graphs captured before
        # are dropped even when every address survived, and recaptured on use.
        self.moe_graphs.drop_graphs("wake-up")
        self.moe_graphs.revalidate("wake-up")

    def reload_weights(self, weights_iterator: Iterable[tuple[str, torch.Tensor]] | None = None,
                       weights_path: str | None = None,
                       is_checkpoint_format: bool = True) -> None:
        super().reload_weights(weights_iterator=weights_iterator, weights_path=weights_path,
                               is_checkpoint_format=is_checkpoint_format)
        # Weights may move on reload; a graph bakes their addresses in.
        self.moe_graphs.drop_graphs("weight reload")
        self.moe_graphs.revalidate("weight reload")

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self.moe_graphs.close()

    # -- per step --------------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput,
                      intermediate_tensors: IntermediateTensors | None = None) -> Any:
        self.moe_graphs.begin_step()
        try:
            return super().execute_model(scheduler_output, intermediate_tensors)
        finally:
            self.moe_graphs.end_step()

    def _prepare_inputs(self, scheduler_output: SchedulerOutput,
                        num_scheduled_tokens: np.ndarray) -> tuple[Any, ...]:
        out = self.moe_graphs.prepare_inputs(scheduler_output)
        return out if out is not None else super()._prepare_inputs(scheduler_output,
                                                                    num_scheduled_tokens)

    def _build_attention_metadata(
        self, num_tokens: int, num_reqs: int, max_query_len: int,
        num_tokens_padded: int | None = None, num_reqs_padded: int | None = None,
        ubatch_slices: Any = None, logits_indices: Any = None, use_spec_decode: bool = False,
        for_cudagraph_capture: bool = False, num_scheduled_tokens: dict[str, int] | None = None,
        cascade_attn_prefix_lens: list[list[int]] | None = None,
        slot_mappings: dict[int, torch.Tensor] | None = None,
    ) -> tuple[Any, Any]:
        if not self.moe_graphs.builds_metadata():
            return {}, None
        return super()._build_attention_metadata(
            num_tokens, num_reqs, max_query_len, num_tokens_padded=num_tokens_padded,
            num_reqs_padded=num_reqs_padded, ubatch_slices=ubatch_slices,
            logits_indices=logits_indices, use_spec_decode=use_spec_decode,
            for_cudagraph_capture=for_cudagraph_capture,
            num_scheduled_tokens=num_scheduled_tokens,
            cascade_attn_prefix_lens=cascade_attn_prefix_lens, slot_mappings=slot_mappings)

    def _determine_batch_execution_and_padding(
        self, num_tokens: int, num_reqs: int, num_scheduled_tokens_np: np.ndarray,
        max_num_scheduled_tokens: int, use_cascade_attn: bool, allow_microbatching: bool = True,
        force_eager: bool = False, force_uniform_decode: bool | None = None,
        force_has_lora: bool | None = None, force_num_active_loras: int | None = None,
        num_encoder_reqs: int = 0,
    ) -> tuple[Any, ...]:
        out = super()._determine_batch_execution_and_padding(
            num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens,
            use_cascade_attn, allow_microbatching=allow_microbatching, force_eager=force_eager,
            force_uniform_decode=force_uniform_decode, force_has_lora=force_has_lora,
            force_num_active_loras=force_num_active_loras, num_encoder_reqs=num_encoder_reqs)
        padding = self.moe_graphs.plan(num_tokens, num_reqs, num_scheduled_tokens_np,
                                       max_num_scheduled_tokens, use_cascade_attn, force_eager)
        if padding is None:
            return out
        # vLLM's FULL runtime mode with a descriptor of the key's buckets: vLLM pads the
        # inputs, slot mapping and attention metadata to them
        tokens, reqs, uniform = padding
        return (CUDAGraphMode.FULL,
                BatchDescriptor(num_tokens=tokens, num_reqs=reqs, uniform=uniform), *out[2:])

    def _model_forward(self, input_ids: torch.Tensor | None = None,
                       positions: torch.Tensor | None = None,
                       intermediate_tensors: IntermediateTensors | None = None,
                       inputs_embeds: torch.Tensor | None = None,
                       **model_kwargs: Any) -> Any:
        out = self.moe_graphs.forward(dict(
            input_ids=input_ids, positions=positions, inputs_embeds=inputs_embeds,
            intermediate_tensors=intermediate_tensors, **model_kwargs))
        if out is not None:
            return out
        return super()._model_forward(input_ids, positions, intermediate_tensors,
                                      inputs_embeds, **model_kwargs)

    def _sample(self, logits: torch.Tensor | None, spec_decode_metadata: Any) -> Any:
        out = self.moe_graphs.sample(logits, spec_decode_metadata)
        return out if out is not None else super()._sample(logits, spec_decode_metadata)

    def _bookkeeping_sync(self, scheduler_output: SchedulerOutput, sampler_output: Any,
                          logits: torch.Tensor | None, hidden_states: torch.Tensor,
                          num_scheduled_tokens: int) -> tuple[Any, ...]:
        out = self.moe_graphs.bookkeeping(scheduler_output, sampler_output)
        if out is not None:
            return out
        return super()._bookkeeping_sync(scheduler_output, sampler_output, logits,
                                         hidden_states, num_scheduled_tokens)

    def capture_model(self) -> int:
        pool_bytes = self.moe_graphs.capture_model()
        if pool_bytes is None:
            pool_bytes = super().capture_model()
        if self.sampler_compile is not None:
            self.sampler_compile.join()  # before vLLM's sampler warm-up, which follows
        if self.sampling_variants is None and self.moe_graphs.config.compile_sampling_variants:
            self.sampling_variants = start_for_runner(self)  # once per engine
        return pool_bytes
