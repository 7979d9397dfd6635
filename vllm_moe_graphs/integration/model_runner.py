"""`MoeGraphsModelRunner`: vLLM 0.26's V1 `GPUModelRunner` plus the KV storage lifecycle.

This increment binds one `PagedKVStorage` to vLLM's KV cache and keeps it honest across
profiling, wake-up, weight reload and shutdown. It does not yet replace vLLM's CUDA-graph capture
nor the per-batch execution path (issue #6; see the TODOs below).

Overridden `GPUModelRunner` methods (exactly these; `test_override_points` introspects them):

method                        | parameters after self                                | hook
----------------------------- | ---------------------------------------------------- | ------------
`__init__`                    | vllm_config, device                                  | storage
`load_model`                  | load_dummy_weights                                   | register
`initialize_kv_cache`         | kv_cache_config, is_profiling                        | bind
`_cleanup_profiling_kv_cache` |                                                      | unbind first
`post_kv_cache_wake_up`       |                                                      | revalidate
`reload_weights`              | weights_iterator, weights_path, is_checkpoint_format | revalidate
`shutdown`                    |                                                      | close

storage: read the plugin config, create the one `PagedKVStorage`; register: classify the model
and its attention layers by exact type; bind: phase profiling or serving. Each hook runs after
super(), except the unbind (super frees the memory it must release) and close (also when super
raises).

Called, not overridden: `get_model(self)`.

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
    Worker.compile_or_warm_up_model    -> _dummy_run(...), capture_model()
    per step: execute_model -> _determine_batch_execution_and_padding -> ...
    Worker.wake_up(tags)               -> post_kv_cache_wake_up (only if tags is None or has
                                          "kv_cache")                                (revalidate)
    Worker.reload_weights              -> reload_weights                             (revalidate)
    Worker.shutdown                    -> shutdown -> _cleanup_profiling_kv_cache    (unbind, close)
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_moe_graphs.config import PluginConfig
from vllm_moe_graphs.integration.signatures import IncompatibleVllmError, check_parameters
from vllm_moe_graphs.kv.storage import PagedKVStorage, Phase

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
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
}
CALLED: dict[str, tuple[str, ...]] = {
    "get_model": ("self",),
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

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return recorder(rank)


class MoeGraphsModelRunner(GPUModelRunner):
    """V1 runner that owns the KV storage identity (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        self.moe_config = PluginConfig.from_additional_config(vllm_config.additional_config)
        self.moe_storage = PagedKVStorage(metrics=_metrics_sink())
        self._moe_layers: AttentionLayerRegistry | None = None

    def load_model(self, load_dummy_weights: bool = False) -> None:
        super().load_model(load_dummy_weights=load_dummy_weights)
        from vllm_moe_graphs.integration.model_registry import register_model

        self._moe_layers = register_model(self.get_model())
        proof = self._moe_layers.proof()
        logger.info("moe_graphs: model layers %s%s", proof.reason.value,
                    f" ({proof.detail})" if proof.detail else "")

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig,
                            is_profiling: bool = False) -> None:
        super().initialize_kv_cache(kv_cache_config, is_profiling=is_profiling)
        self._moe_bind(Phase.PROFILING if is_profiling else Phase.SERVING)

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
        self._moe_revalidate("wake-up")

    def reload_weights(self, weights_iterator: Iterable[tuple[str, torch.Tensor]] | None = None,
                       weights_path: str | None = None,
                       is_checkpoint_format: bool = True) -> None:
        super().reload_weights(weights_iterator=weights_iterator, weights_path=weights_path,
                               is_checkpoint_format=is_checkpoint_format)
        # TODO(#6): weights may move on reload: the graph runner must drop its graphs here
        # (DecodeGraphRunner.invalidate); the storage only proves the KV cache identity.
        self._moe_revalidate("weight reload")

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self.moe_storage.close()

    # TODO(#6): `capture_model(self) -> int` stays vLLM's. Issue #6 overrides it to drop vLLM's
    # full decode graphs and (with `precapture`) capture ours through DecodeGraphRunner inside
    # vLLM's `graph_capture` context, after `moe_storage.proof()` holds.
    # TODO(#6): `_determine_batch_execution_and_padding(...)` stays vLLM's. Issue #6 overrides it
    # to ask `DecodeGraphRunner.decide()` (host ints only) and, on an eager fallback, call super
    # with `force_eager=True` so the batch is not padded; on replay it pads to the bucket.

    # -- helpers (names are ours: none shadows a GPUModelRunner attribute) -----------------------
    def _moe_kv_tensors(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Layer name -> the KV tensor vLLM bound to that layer (`bind_kv_cache`)."""
        ctx: dict[str, Any] = self.compilation_config.static_forward_context
        out = {}
        for name in names:
            t = getattr(ctx.get(name), "kv_cache", None)
            if isinstance(t, torch.Tensor) and t.numel():
                out[name] = t
        return out

    def _moe_bind(self, phase: Phase) -> None:
        layers = self._moe_layers
        if not self.moe_config.enabled or layers is None:
            return
        if not (proof := layers.proof()).holds:
            logger.info("moe_graphs: KV storage not bound (%s: %s)", proof.reason.value,
                        proof.detail)
            return
        indices = layers.layer_indices
        kv = self._moe_kv_tensors(indices)
        if set(kv) != set(indices):
            logger.warning("moe_graphs: KV storage not bound: vLLM bound no KV tensor for %s",
                           sorted(set(indices) - set(kv)))
            return
        try:
            identity = self.moe_storage.bind(kv, phase=phase, layer_indices=indices)
        except ValueError as exc:  # e.g. another attention backend's layout: stock vLLM runs
            logger.warning("moe_graphs: KV storage not bound (%s phase): %s", phase.value, exc)
            return
        model_device = next((p.device for p in self.get_model().parameters()), self.device)
        self.moe_storage.check_devices(self.device, model_device)
        if not (match := layers.match_storage(identity)).holds:
            self.moe_storage.invalidate(match.detail)
        logger.info("moe_graphs: KV storage bound (%s phase, %d layers, generation %d): %s",
                    phase.value, len(kv), self.moe_storage.generation,
                    self.moe_storage.proof().reason.value)

    def _moe_revalidate(self, event: str) -> None:
        if self.moe_storage.closed or not self.moe_storage.bound:
            return
        names = self.moe_storage.identity().layer_indices
        proof = self.moe_storage.revalidate(self._moe_kv_tensors(names))
        logger.info("moe_graphs: KV storage after %s: %s%s", event, proof.reason.value,
                    f" ({proof.detail})" if proof.detail else "")
