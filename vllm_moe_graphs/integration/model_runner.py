"""`MoeGraphsModelRunner`: vLLM 0.26's V1 `GPUModelRunner` with our decode CUDA graphs.

It binds one `PagedKVStorage` to vLLM's KV cache and keeps it honest across profiling,
wake-up, weight reload and shutdown, and it runs decode steps through one `DecodeGraphRunner`
(lazy capture per bucket, replay, eager fallback with a reason). vLLM's own capture is off for
engines it runs in (`cudagraph_mode=NONE`, set by `hooks.take_over_decode_graphs`), so its
graphs are the only ones.

Overridden `GPUModelRunner` methods (exactly these; `test_override_points` introspects them):

method                                  | parameters after self                                | hook
--------------------------------------- | ---------------------------------------------------- | ------------
`__init__`                              | vllm_config, device                                  | storage
`load_model`                            | load_dummy_weights                                   | register
`initialize_kv_cache`                   | kv_cache_config, is_profiling                        | bind, graphs
`_cleanup_profiling_kv_cache`           |                                                      | unbind first
`post_kv_cache_wake_up`                 |                                                      | revalidate
`reload_weights`                        | weights_iterator, weights_path, is_checkpoint_format | invalidate
`shutdown`                              |                                                      | close
`execute_model`                         | scheduler_output, intermediate_tensors               | step scope
`_prepare_inputs`                       | scheduler_output, num_scheduled_tokens               | decode inputs
`_build_attention_metadata`             | num_tokens, num_reqs, max_query_len, num_tokens_padded, num_reqs_padded, ubatch_slices, logits_indices, use_spec_decode, for_cudagraph_capture, num_scheduled_tokens, cascade_attn_prefix_lens, slot_mappings | skip on replay
`_determine_batch_execution_and_padding` | num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens, use_cascade_attn, allow_microbatching, force_eager, force_uniform_decode, force_has_lora, force_num_active_loras, num_encoder_reqs | decide, pad
`_model_forward`                        | input_ids, positions, intermediate_tensors, inputs_embeds, model_kwargs | replay
`_bookkeeping_sync`                      | scheduler_output, sampler_output, logits, hidden_states, num_scheduled_tokens | decode bookkeeping
`capture_model`                         |                                                      | warm-up, precapture

storage: read the plugin config, create the one `PagedKVStorage`; register: classify the model
and its attention layers by exact type (and, when configured, give its linear layers the small-M
GEMM, `integration/linear.py`, and its attention the fused q/k norm + RoPE,
`integration/qk_norm_rope.py`); bind: phase profiling or serving; graphs: create the
`DecodeGraphRunner` (and `DecodeInputs`, `GraphLogits`) once the serving bind holds. Each hook runs after
super(), except the unbind (super frees the memory it must release), close (also when super
raises) and the per-step ones below.

Per step (`execute_model`): inputs go to vLLM's persistent buffers (a pure-decode step's through
`integration/decode_inputs.py`, any other through vLLM), then `_determine_batch_execution_and_
padding` asks `DecodeGraphRunner.decide()` with host ints only (rows, the longest context from
`optimistic_seq_lens_cpu`, pure decode or not). On a graph path (replay, capture, warm-up) it
returns vLLM's FULL runtime mode with a `BatchDescriptor` of the bucket, so vLLM pads inputs,
slot mapping (-1) and attention metadata (seq_len 0, null block) to the bucket as for its own
FULL graphs; an eager fallback returns vLLM's unpadded NONE. A replay of a pure-decode step
builds no attention metadata (`_build_attention_metadata`: the graph reads the persistent
buffers). `_model_forward` then runs the step through the `DecodeGraphRunner`, which hands back
only the real rows; on graph paths of batch buckets up to 64 the forward includes the LM head
(`integration/graph_logits.py`), whose logits vLLM's `compute_logits` call then receives.

Called, not overridden: `get_model(self)`, `_dummy_run(self, num_tokens, ...)` (warm-up,
precapture), `input_batch.block_table.compute_slot_mapping` (warm-up).

vLLM 0.26.0 lifecycle (V1, one worker; `Worker` is `v1/worker/gpu_worker.py`):

    Worker.init_device                 -> GPUModelRunner(vllm_config, device)        (our __init__)
    Worker.load_model                  -> load_model                                 (register)
    Worker.determine_available_memory  -> profile_run (no KV cache bound at all)
                                       -> profile_cudagraph_memory, only when cudagraph_mode
                                          != NONE on CUDA and no kv_cache_memory_bytes:
                                          _init_minimal_kv_cache_for_profiling
                                            -> initialize_kv_cache(cfg, is_profiling=True)  (bind)
                                          throw-away graph captures
                                          _cleanup_profiling_kv_cache                (unbind)
    Worker.initialize_from_config      -> initialize_kv_cache(cfg)  (is_profiling=False, bind)
    Worker.compile_or_warm_up_model    -> _dummy_run(...), capture_model()  (warm-up, precapture)
    per step: execute_model -> _determine_batch_execution_and_padding             (decide)
                            -> _model_forward                                    (replay)
    Worker.wake_up(tags)               -> post_kv_cache_wake_up (only if tags is None or has
                                          "kv_cache")                                (revalidate)
    Worker.reload_weights              -> reload_weights                             (invalidate)
    Worker.shutdown                    -> shutdown -> _cleanup_profiling_kv_cache    (unbind, close)
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import BatchDescriptor
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_moe_graphs.capability import Reason
from vllm_moe_graphs.config import plugin_config
from vllm_moe_graphs.graphs.buckets import GraphKey, graph_config
from vllm_moe_graphs.graphs.runner import Action, Decision, DecodeGraphRunner
from vllm_moe_graphs.integration.decode_inputs import DecodeInputs, pure_decode, unsupported
from vllm_moe_graphs.integration import runner_buffers
from vllm_moe_graphs.integration.graph_logits import GraphLogits, install_graph_logits
from vllm_moe_graphs.integration.precapture import precapture_all
from vllm_moe_graphs.integration.signatures import IncompatibleVllmError, check_parameters
from vllm_moe_graphs.kv.storage import PagedKVStorage, Phase

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.sequence import IntermediateTensors
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from vllm_moe_graphs.integration.model_registry import AttentionLayerRegistry
    from vllm_moe_graphs.kv.storage import InvalidationSink

logger = logging.getLogger("vllm.moe_graphs")

# name -> parameters, as vLLM 0.26.0 declares them. Keep in sync with the docstring table.
OVERRIDES: dict[str, tuple[str, ...]] = {
    "__init__": ("self", "vllm_config", "device"),
    "load_model": ("self", "load_dummy_weights"),
    "initialize_kv_cache": ("self", "kv_cache_config", "is_profiling"),
    "_cleanup_profiling_kv_cache": ("self",),
    "post_kv_cache_wake_up": ("self",),
    "reload_weights": ("self", "weights_iterator", "weights_path", "is_checkpoint_format"),
    "shutdown": ("self",),
    "execute_model": ("self", "scheduler_output", "intermediate_tensors"),
    "_prepare_inputs": ("self", "scheduler_output", "num_scheduled_tokens"),
    "_build_attention_metadata": (
        "self", "num_tokens", "num_reqs", "max_query_len", "num_tokens_padded", "num_reqs_padded",
        "ubatch_slices", "logits_indices", "use_spec_decode", "for_cudagraph_capture",
        "num_scheduled_tokens", "cascade_attn_prefix_lens", "slot_mappings"),
    "_determine_batch_execution_and_padding": (
        "self", "num_tokens", "num_reqs", "num_scheduled_tokens_np", "max_num_scheduled_tokens",
        "use_cascade_attn", "allow_microbatching", "force_eager", "force_uniform_decode",
        "force_has_lora", "force_num_active_loras", "num_encoder_reqs"),
    "_model_forward": ("self", "input_ids", "positions", "intermediate_tensors", "inputs_embeds",
                       "model_kwargs"),
    "_bookkeeping_sync": ("self", "scheduler_output", "sampler_output", "logits",
                          "hidden_states", "num_scheduled_tokens"),
    "capture_model": ("self",),
}
CALLED: dict[str, tuple[str, ...]] = {
    "get_model": ("self",),
    "_dummy_run": ("self", "num_tokens", "cudagraph_runtime_mode", "force_attention",
                   "uniform_decode", "allow_microbatching", "skip_eplb", "is_profile",
                   "create_mixed_batch", "remove_lora", "is_graph_capturing", "num_active_loras",
                   "profile_seq_lens"),
}


def check_override_points(base: type | None = None) -> None:
    """Raise `IncompatibleVllmError` unless `base` (default: the installed vLLM's V1
    `GPUModelRunner`) has every method we override or call, with the parameters of 0.26.0."""
    base = GPUModelRunner if base is None else base
    for name, expected in {**OVERRIDES, **CALLED}.items():
        qualname = f"{base.__module__}.{base.__qualname__}.{name}"
        fn = getattr(base, name, None)
        if not callable(fn):
            raise IncompatibleVllmError(
                f"vllm_moe_graphs expects {qualname}{expected} (vLLM 0.26.0); it does not "
                "exist in the installed vLLM. Set MOE_GRAPHS_DISABLE=1 to run stock vLLM.")
        check_parameters(qualname, fn, expected)


def _metrics_sink() -> InvalidationSink | None:
    """This process' metrics recorder; the worker has initialised torch.distributed by now."""
    from vllm_moe_graphs.metrics import recorder

    return recorder(_rank())


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


class MoeGraphsModelRunner(GPUModelRunner):
    """V1 runner with our decode graphs (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        self.moe_config = plugin_config(vllm_config.additional_config)
        self.moe_storage = PagedKVStorage(metrics=_metrics_sink())
        self._mg_layers: AttentionLayerRegistry | None = None
        self._mg_graphs: DecodeGraphRunner | None = None
        self._mg_executing = False  # inside execute_model (not a dummy/profile run)
        self._mg_pending: tuple[Decision, int] | None = None  # (decision, max context)
        self._mg_args: dict[str, Any] = {}  # the current step's model inputs
        self._mg_kv_watch: tuple[tuple[Any, torch.Tensor], ...] = ()  # (layer, bound tensor)
        self._mg_precapture_key: GraphKey | None = None
        self._mg_real_model: Any = None  # the model while capture_model swaps in the shim
        self._mg_linear: dict[str, Any] = {}  # small_m_gemm: layer name -> SmallMLinearMethod
        self._mg_fused_attn: dict[str, str] = {}  # fuse_qk_norm_rope: module -> fused or why not
        self._mg_inputs: DecodeInputs | None = None  # fast_decode_inputs, once serving is bound
        self._mg_logits: GraphLogits | None = None  # logits_in_graph, with _mg_inputs
        self._mg_fast_step = False  # this step's inputs came from _mg_inputs
        self._mg_with_logits = False  # this step's forward computes the logits
        self._mg_lean_replay = False  # a replay may skip the attention metadata (see below)

    def load_model(self, load_dummy_weights: bool = False) -> None:
        super().load_model(load_dummy_weights=load_dummy_weights)
        from vllm_moe_graphs.integration.model_registry import register_model

        self._mg_layers = register_model(self.get_model())
        proof = self._mg_layers.proof()
        logger.info("moe_graphs: model layers %s%s", proof.reason.value,
                    f" ({proof.detail})" if proof.detail else "")
        if (c := self.moe_config).enabled and c.small_m_gemm and proof.holds:
            from vllm_moe_graphs.integration.linear import install_small_m_gemm
            self._mg_linear = install_small_m_gemm(self.get_model(), c.small_m_gemm)
        if self.moe_config.enabled and self.moe_config.fuse_qk_norm_rope and proof.holds:
            from vllm_moe_graphs.integration.qk_norm_rope import install_fused_qk_norm_rope

            self._mg_fused_attn = install_fused_qk_norm_rope(self.get_model())

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig,
                            is_profiling: bool = False) -> None:
        super().initialize_kv_cache(kv_cache_config, is_profiling=is_profiling)
        self._mg_bind(Phase.PROFILING if is_profiling else Phase.SERVING)
        if not is_profiling:
            self._mg_start_graphs()
            self._mg_start_decode_inputs()

    def _cleanup_profiling_kv_cache(self) -> None:
        # NOTE: unbind first: the storage holds strong references, and super() drops vLLM's and
        # then empties the allocator cache; unbinding after it would keep the throw-away cache
        # allocated (and skew the KV memory vLLM computes next). vLLM also calls this from
        # shutdown(), for the serving cache.
        if not self.moe_storage.closed:
            self.moe_storage.unbind("vLLM freed the KV cache (_cleanup_profiling_kv_cache)")
        super()._cleanup_profiling_kv_cache()

    def post_kv_cache_wake_up(self) -> None:
        super().post_kv_cache_wake_up()
        # Sleep discarded the KV contents (and, at level 2, the weights): graphs captured before
        # are dropped even when every address survived, and recaptured on use.
        self._mg_drop_graphs("wake-up")
        self._mg_revalidate("wake-up")

    def reload_weights(self, weights_iterator: Iterable[tuple[str, torch.Tensor]] | None = None,
                       weights_path: str | None = None,
                       is_checkpoint_format: bool = True) -> None:
        super().reload_weights(weights_iterator=weights_iterator, weights_path=weights_path,
                               is_checkpoint_format=is_checkpoint_format)
        # Weights may move on reload; a graph bakes their addresses in.
        self._mg_drop_graphs("weight reload")
        self._mg_revalidate("weight reload")

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            if self._mg_graphs is not None:
                self._mg_graphs.close()
            self.moe_storage.close()

    # -- per step --------------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput,
                      intermediate_tensors: IntermediateTensors | None = None) -> Any:
        self._mg_executing, self._mg_pending = True, None
        try:
            return super().execute_model(scheduler_output, intermediate_tensors)
        finally:
            self._mg_executing, self._mg_pending, self._mg_args = False, None, {}
            self._mg_fast_step = self._mg_with_logits = False
            if self._mg_logits is not None:
                self._mg_logits.clear()

    def _prepare_inputs(self, scheduler_output: SchedulerOutput,
                        num_scheduled_tokens: np.ndarray) -> tuple[Any, ...]:
        if self._mg_inputs and self._mg_executing and pure_decode(self, scheduler_output):
            self._mg_fast_step = True
            return self._mg_inputs.prepare(self, scheduler_output)
        return super()._prepare_inputs(scheduler_output, num_scheduled_tokens)

    def _build_attention_metadata(
        self, num_tokens: int, num_reqs: int, max_query_len: int,
        num_tokens_padded: int | None = None, num_reqs_padded: int | None = None,
        ubatch_slices: Any = None, logits_indices: Any = None, use_spec_decode: bool = False,
        for_cudagraph_capture: bool = False, num_scheduled_tokens: dict[str, int] | None = None,
        cascade_attn_prefix_lens: list[list[int]] | None = None,
        slot_mappings: dict[int, torch.Tensor] | None = None,
    ) -> tuple[Any, Any]:
        # NOTE: a replay runs no Python of the model: the graph reads the persistent buffers
        # the metadata would view (runner_buffers.read_metadata_in_place), so building it is
        # host time only. Its one device write, the null block id in padded block-table rows,
        # is never read: padded rows have seq_len 0, and the decode kernel reads no block then.
        pending = self._mg_pending
        if (self._mg_lean_replay and self._mg_fast_step and pending is not None
                and pending[0].action is Action.REPLAY):
            return {}, None
        return super()._build_attention_metadata(
            num_tokens, num_reqs, max_query_len, num_tokens_padded=num_tokens_padded,
            num_reqs_padded=num_reqs_padded, ubatch_slices=ubatch_slices,
            logits_indices=logits_indices, use_spec_decode=use_spec_decode,
            for_cudagraph_capture=for_cudagraph_capture,
            num_scheduled_tokens=num_scheduled_tokens,
            cascade_attn_prefix_lens=cascade_attn_prefix_lens, slot_mappings=slot_mappings)

    def _determine_batch_execution_and_padding(
        self,
        num_tokens: int,
        num_reqs: int,
        num_scheduled_tokens_np: np.ndarray,
        max_num_scheduled_tokens: int,
        use_cascade_attn: bool,
        allow_microbatching: bool = True,
        force_eager: bool = False,
        force_uniform_decode: bool | None = None,
        force_has_lora: bool | None = None,
        force_num_active_loras: int | None = None,
        num_encoder_reqs: int = 0,
    ) -> tuple[Any, ...]:
        out = super()._determine_batch_execution_and_padding(
            num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens,
            use_cascade_attn, allow_microbatching=allow_microbatching, force_eager=force_eager,
            force_uniform_decode=force_uniform_decode, force_has_lora=force_has_lora,
            force_num_active_loras=force_num_active_loras, num_encoder_reqs=num_encoder_reqs)
        graphs = self._mg_graphs
        if graphs is None:
            return out
        if self._mg_precapture_key is not None:  # capture_model's dummy batch
            return self._mg_padded(out, self._mg_precapture_key.batch_bucket)
        if not self._mg_executing:
            return out  # vLLM's dummy runs (profiling, warm-up) stay eager and unpadded
        # NOTE: host ints only (the scheduler's lengths); no GPU value is read here.
        decode = (max_num_scheduled_tokens == 1 and num_tokens == num_reqs
                  and not use_cascade_attn and not force_eager)
        max_context = int(self.optimistic_seq_lens_cpu.numpy()[:num_reqs].max()) if decode \
            else 0
        if decode and self._mg_kv_rebound():
            self._mg_rebind("a layer's KV tensor was rebound behind the storage")
        # Rows are query tokens: for a decode batch one per request; a mixed batch keeps all.
        d = graphs.decide(num_tokens, max_context, decode)
        self._mg_pending = (d, max_context)
        if d.key is not None and d.batch_size == d.key.batch_bucket:  # replay/capture/warm-up
            return self._mg_padded(out, d.batch_size)
        return out

    def _model_forward(self, input_ids: torch.Tensor | None = None,
                       positions: torch.Tensor | None = None,
                       intermediate_tensors: IntermediateTensors | None = None,
                       inputs_embeds: torch.Tensor | None = None,
                       **model_kwargs: Any) -> Any:
        pending, self._mg_pending = self._mg_pending, None
        if pending is None or self._mg_graphs is None:
            return super()._model_forward(input_ids, positions, intermediate_tensors,
                                          inputs_embeds, **model_kwargs)
        d, max_context = pending
        self._mg_args = dict(input_ids=input_ids, positions=positions, inputs_embeds=inputs_embeds,
                             intermediate_tensors=intermediate_tensors, **model_kwargs)
        # NOTE: the LM head joins the forward on every graph path (warm-up, capture, replay)
        # of a key that has it, whatever prepared the inputs: a key's graph has it or not for
        # the engine's life. vLLM's compute_logits takes the result only for the exact view.
        graph_path = d.key is not None and (d.action is not Action.EAGER or d.warming_up)
        self._mg_with_logits = graph_path and self._mg_logits_for(d.key)
        out, _ = self._mg_graphs.run(d.num_reqs, max_context, d.reason is not Reason.MIXED_BATCH,
                                     decision=d)
        if self._mg_with_logits:
            self._mg_logits.hand_over(out, d.num_reqs)
        return out

    def _bookkeeping_sync(self, scheduler_output: SchedulerOutput, sampler_output: Any,
                          logits: torch.Tensor | None, hidden_states: torch.Tensor,
                          num_scheduled_tokens: int) -> tuple[Any, ...]:
        if self._mg_inputs is not None and pure_decode(self, scheduler_output) and (
                out := self._mg_inputs.bookkeeping(self, sampler_output)) is not None:
            return out
        return super()._bookkeeping_sync(scheduler_output, sampler_output, logits,
                                         hidden_states, num_scheduled_tokens)

    def capture_model(self) -> int:
        if self._mg_graphs is None:
            return super().capture_model()
        return precapture_all(self, self._mg_graphs)

    # -- helpers (names are ours: none shadows a GPUModelRunner attribute) -----------------------
    @property
    def _mg_model(self) -> Any:
        return self._mg_real_model if self._mg_real_model is not None else self.model

    def _mg_forward(self, batch_size: int) -> torch.Tensor:
        """The DecodeGraphRunner's forward: the model on this step's (padded) inputs."""
        args = self._mg_args
        ids = args.get("input_ids")
        rows = ids.shape[0] if ids is not None else args["inputs_embeds"].shape[0]
        assert rows >= batch_size, f"step has {rows} input rows, the runner asked {batch_size}"
        hidden = self._mg_model(**args)
        if self._mg_with_logits:
            self._mg_logits.compute(hidden)
        return hidden

    def _mg_logits_for(self, key: GraphKey) -> bool:
        """Whether `key`'s graph computes the logits (fixed per key for the engine's life)."""
        logits = self._mg_logits
        return logits is not None and key.batch_bucket <= logits.buffer.shape[0]

    @staticmethod
    def _mg_padded(out: tuple[Any, ...], batch: int) -> tuple[Any, ...]:
        """vLLM's FULL runtime mode with a uniform-decode descriptor of `batch` rows."""
        desc = BatchDescriptor(num_tokens=batch, num_reqs=batch, uniform=True)
        return (CUDAGraphMode.FULL, desc, *out[2:])

    def _mg_bind(self, phase: Phase) -> None:
        layers = self._mg_layers
        if not self.moe_config.enabled or layers is None:
            return
        if not (proof := layers.proof()).holds:
            logger.info("moe_graphs: KV storage not bound (%s: %s)", proof.reason.value,
                        proof.detail)
            return
        indices = layers.layer_indices
        kv = runner_buffers.kv_tensors(self, indices)
        if set(kv) != set(indices):
            logger.warning("moe_graphs: KV storage not bound: vLLM bound no KV tensor for %s",
                           sorted(set(indices) - set(kv)))
            return
        try:
            identity = self.moe_storage.bind(kv, phase=phase, layer_indices=indices,
                                             buffers=runner_buffers.graph_buffers(self))
        except ValueError as exc:  # e.g. another attention backend's layout: stock vLLM runs
            logger.warning("moe_graphs: KV storage not bound (%s phase): %s", phase.value, exc)
            return
        model_device = next((p.device for p in self.get_model().parameters()), self.device)
        self.moe_storage.check_devices(self.device, model_device)
        if not (match := layers.match_storage(identity)).holds:
            self.moe_storage.invalidate(match.detail)
        ctx = self.compilation_config.static_forward_context
        self._mg_kv_watch = tuple((ctx[name], t) for name, t in kv.items())
        self._mg_lean_replay = runner_buffers.read_metadata_in_place(self)
        logger.info("moe_graphs: KV storage bound (%s phase, %d layers, generation %d): %s",
                    phase.value, len(kv), self.moe_storage.generation,
                    self.moe_storage.proof().reason.value)

    def _mg_drop_graphs(self, event: str) -> None:
        """Drop every decode graph for a lifecycle event the KV identity does not show (sleep
        discards contents at the same addresses; a reload may move weights); counted in
        `moe_graphs_invalidations_total{reason="storage_identity_changed"}`."""
        if self._mg_graphs is None or self._mg_graphs.closed:
            return
        self._mg_graphs.invalidate(Reason.STORAGE_IDENTITY_CHANGED, event)
        _metrics_sink().record_invalidation(Reason.STORAGE_IDENTITY_CHANGED)

    def _mg_kv_rebound(self) -> bool:
        """True when some attention layer no longer holds the tensor the storage bound: one
        identity check per layer (host only), so a swap is caught before the next replay."""
        return any(layer.kv_cache is not t for layer, t in self._mg_kv_watch)

    def _mg_rebind(self, why: str) -> None:
        """The storage's identity no longer matches vLLM's tensors: invalidate (metrics, graphs
        dropped through the listener), then bind afresh to what vLLM holds now."""
        if self.moe_storage.closed:
            return
        logger.warning("moe_graphs: %s; decode graphs dropped, rebinding", why)
        self.moe_storage.invalidate(why)
        self._mg_bind(Phase.SERVING)

    def _mg_start_graphs(self) -> None:
        """Create the DecodeGraphRunner once the serving bind holds, and record the runtime
        capability (metrics, log) either way."""
        from vllm_moe_graphs.integration import hooks
        from vllm_moe_graphs.killswitch import KillSwitch
        from vllm_moe_graphs.metrics import recorder

        proof = self.moe_storage.proof()
        vllm_own = self.compilation_config.cudagraph_mode
        if proof.holds and vllm_own is not None and vllm_own.name != "NONE":
            logger.warning("moe_graphs: vLLM's own CUDA graphs are on (cudagraph_mode=%s); the "
                           "plugin's decode graphs stay off (see docs/serving.md)",
                           vllm_own.name)
        report = hooks.record_capability(
            self.vllm_config, _rank(), proof,
            graphs_on=proof.holds and (vllm_own is None or vllm_own.name == "NONE"))
        if self._mg_graphs is not None or not report.eligible or (
                vllm_own is not None and vllm_own.name != "NONE"):
            return
        rec = recorder(_rank())
        config = graph_config(self.moe_config, self.max_num_reqs, self.max_model_len)
        self._mg_graphs = DecodeGraphRunner(
            self._mg_forward, config, storage=self.moe_storage,
            kill_switch=KillSwitch.from_env(), metrics=rec)
        self._mg_graphs.set_scratch_bytes(sum(
            t.numel() * t.element_size() for t in runner_buffers.graph_buffers(self).values()))
        logger.info("moe_graphs: decode graphs on: batch buckets %s, context buckets %s, "
                    "warm-up %d steps, pool budget %d MiB",
                    list(config.decode_batch_buckets),
                    list(config.context_buckets), self.moe_config.warmup_steps,
                    self.moe_config.graph_memory_budget_mib)

    def _mg_start_decode_inputs(self) -> None:
        """Pure-decode steps prepare their inputs in `DecodeInputs` (fast_decode_inputs)."""
        if self.moe_config.fast_decode_inputs and self._mg_graphs and not self._mg_inputs:
            why = unsupported(self)
            self._mg_inputs = DecodeInputs(self) if why is None else None
            logger.info("moe_graphs: decode inputs prepared by %s",
                        f"vLLM ({why})" if why else "the plugin (fast_decode_inputs)")
        if self.moe_config.logits_in_graph and self._mg_inputs and not self._mg_logits:
            self._mg_logits = install_graph_logits(self.get_model(), self._mg_graphs)

    def _mg_revalidate(self, event: str) -> None:
        if self.moe_storage.closed or not self.moe_storage.bound:
            return
        names = self.moe_storage.identity().layer_indices
        proof = self.moe_storage.revalidate(runner_buffers.kv_tensors(self, names),
                                            runner_buffers.graph_buffers(self))
        logger.info("moe_graphs: KV storage after %s: %s%s", event, proof.reason.value,
                    f" ({proof.detail})" if proof.detail else "")
        if proof.reason is Reason.STORAGE_IDENTITY_CHANGED:
            self._mg_rebind(f"KV storage changed at {event}")
