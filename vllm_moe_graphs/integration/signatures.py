"""Checks that the private vLLM APIs we touch still have the shape this code was written for."""

from __future__ import annotations

import inspect
from collections.abc import Callable

SUPPORTED_VLLM = "0.26.0"


class IncompatibleVllmError(RuntimeError):
    """A private vLLM API changed; the plugin refuses to patch it."""


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def version_supported(version: str) -> bool:
    return version.split("+", 1)[0] == SUPPORTED_VLLM


def check_parameters(qualname: str, fn: Callable, expected: tuple[str, ...]) -> None:
    """Raise `IncompatibleVllmError` unless `fn` takes exactly `expected` parameters."""
    try:
        params = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as exc:  # pragma: no cover - builtins only
        raise IncompatibleVllmError(f"cannot inspect {qualname}: {exc}") from exc
    if params != expected:
        raise IncompatibleVllmError(
            f"vllm_moe_graphs supports vLLM {SUPPORTED_VLLM}; found vLLM {vllm_version()} where "
            f"{qualname} takes {params}, expected {expected}. Set MOE_GRAPHS_DISABLE=1 to run "
            f"stock vLLM, or install vllm=={SUPPORTED_VLLM}."
        )


# `GPUModelRunner` methods `MoeGraphsModelRunner` overrides (name -> parameters, as vLLM 0.26.0
# declares them; keep in sync with the table in `integration/runner/model_runner.py`'s docstring)
# and those the plugin calls without overriding.
RUNNER_OVERRIDES: dict[str, tuple[str, ...]] = {
    "__init__": ("self", "vllm_config", "device"),
    "load_model": ("self", "load_dummy_weights"),
    "profile_run": ("self",),
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
    "_sample": ("self", "logits", "spec_decode_metadata"),
    "_bookkeeping_sync": ("self", "scheduler_output", "sampler_output", "logits",
                          "hidden_states", "num_scheduled_tokens"),
    "capture_model": ("self",),
}
RUNNER_CALLED: dict[str, tuple[str, ...]] = {
    "get_model": ("self",),
    "_dummy_run": ("self", "num_tokens", "cudagraph_runtime_mode", "force_attention",
                   "uniform_decode", "allow_microbatching", "skip_eplb", "is_profile",
                   "create_mixed_batch", "remove_lora", "is_graph_capturing", "num_active_loras",
                   "profile_seq_lens"),
}


def check_runner_points(base: type | None = None) -> None:
    """Raise `IncompatibleVllmError` unless `base` (default: the installed vLLM's V1
    `GPUModelRunner`) has every method we override or call, with the parameters of 0.26.0."""
    if base is None:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner as base
    for name, expected in {**RUNNER_OVERRIDES, **RUNNER_CALLED}.items():
        qualname = f"{base.__module__}.{base.__qualname__}.{name}"
        fn = getattr(base, name, None)
        if not callable(fn):
            raise IncompatibleVllmError(
                f"vllm_moe_graphs expects {qualname}{expected} (vLLM 0.26.0); it does not "
                "exist in the installed vLLM. Set MOE_GRAPHS_DISABLE=1 to run stock vLLM.")
        check_parameters(qualname, fn, expected)
