"""Build `capability.ConfigFacts` from vLLM objects (VllmConfig, EngineArgs)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm_moe_graphs import envs
from vllm_moe_graphs.capability import ConfigFacts
from vllm_moe_graphs.config import PluginConfig, plugin_config

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    return {"half": "float16", "bf16": "bfloat16", "fp16": "float16", "float": "float32"}.get(
        name, name)


def _offload_mode(backend: str, cpu_offload_gb: float, offload_group_size: int) -> str:
    import vllm.envs as vllm_envs

    if backend == "prefetch" or (backend == "auto" and offload_group_size > 0):
        return "prefetch"
    if cpu_offload_gb > 0:
        return "uva_disabled" if vllm_envs.VLLM_WEIGHT_OFFLOADING_DISABLE_UVA else "uva"
    return "none"


def vllm_sets_aside_graph_memory() -> bool:
    """vLLM's `VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS` (on by default): whether graph memory
    comes out of the KV cache memory (integration/worker.py takes the plugin's pool budget off
    under the same switch)."""
    import vllm.envs as vllm_envs

    return bool(vllm_envs.VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS)


# Where the plugin's graph pool memory comes from (`graph_pool_source`).
POOL_IN_KV_CACHE = "kv_cache"  # taken out of the KV cache memory, as vLLM does for its graphs
POOL_BESIDE_FIXED_KV = "kv_cache_memory_bytes"  # the operator fixed the KV cache size
POOL_BESIDE_NO_ESTIMATE = "no_estimate"  # VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0


def graph_pool_source(estimate_graphs: bool, kv_cache_memory_bytes_set: bool) -> str:
    """vLLM's own rule for its graph memory, applied to the plugin's pool: out of the KV cache
    memory under `VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS` (`estimate_graphs`), not when the
    operator fixes the KV cache with `kv_cache_memory_bytes` (that setting does not respect the
    utilization); else the pool lives beside `--gpu-memory-utilization`. One rule for the
    worker's accounting (integration/worker.py) and the doctor's explanation."""
    if kv_cache_memory_bytes_set:
        return POOL_BESIDE_FIXED_KV
    return POOL_IN_KV_CACHE if estimate_graphs else POOL_BESIDE_NO_ESTIMATE


def _is_cuda() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda())


def _head_size(hf: Mapping[str, Any]) -> int | None:
    if hf.get("head_dim"):
        return int(hf["head_dim"])
    if hf.get("hidden_size") and hf.get("num_attention_heads"):
        return int(hf["hidden_size"]) // int(hf["num_attention_heads"])
    return None


def _has_mla(hf: Mapping[str, Any]) -> bool:
    return bool(hf.get("kv_lora_rank")) or bool(hf.get("use_mla"))


def facts_from_vllm_config(vllm_config: VllmConfig, plugin: PluginConfig) -> ConfigFacts:
    mc = vllm_config.model_config
    hf = mc.hf_config.to_dict() if hasattr(mc.hf_config, "to_dict") else dict(vars(mc.hf_config))
    off = vllm_config.offload_config
    return ConfigFacts(
        architectures=tuple(getattr(mc.hf_config, "architectures", None) or ()),
        model_type=str(hf.get("model_type", "")),
        has_mla=_has_mla(hf),
        dtype=_dtype_name(mc.dtype),
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        is_cuda=_is_cuda(),
        enforce_eager=bool(mc.enforce_eager),
        tensor_parallel_size=vllm_config.parallel_config.tensor_parallel_size,
        pipeline_parallel_size=vllm_config.parallel_config.pipeline_parallel_size,
        speculative=vllm_config.speculative_config is not None,
        lora=vllm_config.lora_config is not None,
        offload=_offload_mode(off.offload_backend, off.uva.cpu_offload_gb,
                              off.prefetch.offload_group_size),
        plugin_enabled=plugin.enabled,
        disabled_by_env=envs.MOE_GRAPHS_DISABLE,
        head_size=_head_size(hf),
    )


def facts_from_engine_args(args: EngineArgs, hf: Mapping[str, Any]) -> ConfigFacts:
    """For `moe-graphs doctor`: no engine config is built (that needs a GPU platform)."""
    plugin = plugin_config(args.additional_config)
    dtype = args.dtype if args.dtype not in ("auto", None) else hf.get("torch_dtype") or hf.get(
        "dtype") or "bfloat16"
    if _dtype_name(dtype) == "float32" and args.dtype == "auto":
        dtype = "bfloat16"  # vLLM downcasts float32 checkpoints to bfloat16 under "auto"
    return ConfigFacts(
        architectures=tuple(hf.get("architectures") or ()),
        model_type=str(hf.get("model_type", "")),
        has_mla=_has_mla(hf),
        dtype=_dtype_name(dtype),
        kv_cache_dtype=str(args.kv_cache_dtype),
        is_cuda=_is_cuda(),
        enforce_eager=bool(args.enforce_eager),
        tensor_parallel_size=int(args.tensor_parallel_size),
        pipeline_parallel_size=int(args.pipeline_parallel_size),
        speculative=bool(args.speculative_config),
        lora=bool(args.enable_lora),
        offload=_offload_mode(str(getattr(args, "offload_backend", "auto")),
                              float(args.cpu_offload_gb), int(args.offload_group_size)),
        plugin_enabled=plugin.enabled,
        disabled_by_env=envs.MOE_GRAPHS_DISABLE,
        head_size=_head_size(hf),
    )
