"""Build `capability.ConfigFacts` from vLLM objects (VllmConfig, EngineArgs)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm_moe_graphs import envs
from vllm_moe_graphs.capability import ConfigFacts, Fp8Scheme, WeightQuantization
from vllm_moe_graphs.config import PluginConfig, plugin_config

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.quantization import QuantizationConfigArgs
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


def _name(value: Any) -> str:
    return str(getattr(value, "name", value))


def user_compilation(level: Any, mode: Any, cudagraph_mode: Any) -> str:
    """The compilation settings a user chose that the plugin's take-over would override, as
    `vllm serve` spells them ("" when none): an optimization level other than vLLM's default
    (-O0, -O1, -O3), a compilation `mode` or `cudagraph_mode` other than NONE. `mode` and
    `cudagraph_mode` are None where the user left them to vLLM (before `VllmConfig.__post_init__`
    derives them from the level). NONE for both is the plugin's own explicit route."""
    from vllm.config.vllm import OptimizationLevel

    chosen = []
    if int(level) != OptimizationLevel.O2:
        chosen.append(f"-O{int(level)}")
    if mode is not None and _name(mode) != "NONE":
        chosen.append(f"-cc.mode={_name(mode)}")
    if cudagraph_mode is not None and _name(cudagraph_mode) != "NONE":
        chosen.append(f"-cc.cudagraph_mode={_name(cudagraph_mode)}")
    return " ".join(chosen)


# `VllmConfig.__post_init__` fills the compilation mode and cudagraph_mode from the level, so
# what the user chose is readable only before it runs: the patch of `__post_init__`
# (integration/patch/vllm_config_post_init.py) keeps it on the config object under this name,
# and it travels with the pickled config to every engine process.
USER_COMPILATION_ATTR = "_moe_graphs_user_compilation"


def read_user_compilation(vllm_config: VllmConfig) -> str:
    """`user_compilation` of a config's current settings: the user's choices while vLLM has not
    settled the config yet; on a settled one, vLLM's derived values read as the user's."""
    cc = vllm_config.compilation_config
    return user_compilation(vllm_config.optimization_level, cc.mode, cc.cudagraph_mode)


def _recorded_user_compilation(vllm_config: VllmConfig) -> str:
    """What the `__post_init__` patch kept; for a config it never saw, the settled values read
    as the user's (a deny where they differ from the plugin's)."""
    chosen = getattr(vllm_config, USER_COMPILATION_ATTR, None)
    return read_user_compilation(vllm_config) if chosen is None else chosen


def parse_max_model_len(text: str) -> int:
    """`--max-model-len` as vLLM reads a number of tokens (32768, 32k, 1m)."""
    from vllm.utils.argparse_utils import human_readable_int

    try:
        return int(human_readable_int(text))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"--max-model-len {text!r}: expected a number of tokens such as "
                         f"32768 or 32k ({exc})") from exc


def _num_experts(hf: Mapping[str, Any]) -> int:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if hf.get(key):
            return int(hf[key])
    return 0


def _sliding_window(hf: Mapping[str, Any]) -> int | None:
    """The attention window a Qwen3 config.json asks for: transformers keeps `sliding_window`
    only with `use_sliding_window` (off by default); 0 means none, as in vLLM."""
    if not hf.get("use_sliding_window", False):
        return None
    return int(hf.get("sliding_window") or 0) or None


def _checkpoint_quantization(hf: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The checkpoint's `quantization_config` (or `compression_config`), None when it has none."""
    return hf.get("quantization_config") or hf.get("compression_config") or None


def _quantization(hf: Mapping[str, Any]) -> str | None:
    """The checkpoint's quantization method (`quantization_config.quant_method`), as vLLM reads
    it when no --quantization is given."""
    qc = _checkpoint_quantization(hf)
    if not qc:
        return None
    return str(qc.get("quant_method") or qc.get("format") or "unknown")


def _checkpoint_fp8_scheme(qc: Mapping[str, Any] | None) -> Fp8Scheme | None:
    """The scheme `Fp8Config` builds (quantization/fp8.py): per tensor, online, without a
    checkpoint config (`--quantization fp8` on a bf16 checkpoint); from an FP8 checkpoint,
    128x128 blocks (`weight_block_size`, dynamic activations only), else per tensor with the
    checkpoint's `activation_scheme`. None for a block size other than 128x128."""
    if not qc:
        return Fp8Scheme.PER_TENSOR
    if "fp8" not in str(qc.get("quant_method", "")):
        return None
    block = qc.get("weight_block_size")
    if block is not None:
        return Fp8Scheme.BLOCK if list(block) == [128, 128] else None
    return Fp8Scheme.STATIC if qc.get("activation_scheme") == "static" else Fp8Scheme.PER_TENSOR


def _online_fp8_scheme(online: QuantizationConfigArgs) -> Fp8Scheme | None:
    """The scheme of vLLM's online quantization (`--quantization fp8_per_tensor` /
    `fp8_per_block` / `fp8_per_channel`, or `online` with a --quantization-config): its weight
    keys pick the methods (quantization/online/base.py), and each method its activations
    (online/fp8.py). None when the linear and MoE specs differ or one is not FP8."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        kFp8Static128BlockSym,
        kFp8StaticChannelSym,
        kFp8StaticTensorSym,
    )

    by_key = {kFp8Static128BlockSym: Fp8Scheme.BLOCK, kFp8StaticTensorSym: Fp8Scheme.PER_TENSOR,
              kFp8StaticChannelSym: Fp8Scheme.PER_CHANNEL}
    schemes = {by_key.get(spec.weight) for spec in (online.linear, online.moe)
               if spec is not None}
    return schemes.pop() if len(schemes) == 1 else None


def weight_quantization(method: str | None, hf: Mapping[str, Any],
                        online: QuantizationConfigArgs | None) -> WeightQuantization | None:
    """The weights' quantization as vLLM builds it: `method` (vLLM's resolved name, or the
    --quantization given), the checkpoint's config `hf`, and `online` (the resolved
    QuantizationConfigArgs of an online method, None otherwise)."""
    if method is None:
        return None
    if method == "fp8":
        return WeightQuantization(method, _checkpoint_fp8_scheme(_checkpoint_quantization(hf)))
    if online is not None:
        return WeightQuantization(method, _online_fp8_scheme(online))
    return WeightQuantization(method)


def fp8_kernels(quantization: WeightQuantization | None, moe_backend: str) -> str:
    """For block FP8 weights: which kernels other than its CUTLASS block GEMM and Triton experts
    (the ones the plugin's proofs ran on) vLLM 0.26 would pick, "" when none. DeepGEMM (JIT
    per shape, its E8M0 scales re-quantize the weights) is first in vLLM's lists whenever it is
    installed and VLLM_USE_DEEP_GEMM is on; FlashInfer's block GEMM runs only beside it. Read
    without a GPU (the doctor), so the compute capability is not asked."""
    if quantization is None or quantization.fp8_scheme is not Fp8Scheme.BLOCK:
        return ""
    import vllm.envs as vllm_envs
    from vllm.utils.import_utils import has_deep_gemm

    if moe_backend not in ("auto", "triton"):
        return f"the fused MoE backend {moe_backend!r} (--moe-backend)"
    if vllm_envs.VLLM_TEST_FORCE_FP8_MARLIN:
        return "Marlin (VLLM_TEST_FORCE_FP8_MARLIN)"
    if vllm_envs.VLLM_USE_DEEP_GEMM and has_deep_gemm():
        return "DeepGEMM's JIT GEMM (installed, VLLM_USE_DEEP_GEMM on)"
    return ""


def _runner_type(args: EngineArgs, model: str) -> str:
    """vLLM's runner for `args` (`ModelConfig._get_runner_type` for a Qwen3 generation
    architecture): as given, pooling under a --convert, or pooling for a sentence-transformers
    checkpoint (its modules.json)."""
    if args.runner != "auto":
        return str(args.runner)
    if args.convert not in ("auto", "none"):
        return "pooling"
    from vllm.transformers_utils.config import get_pooling_config

    return "pooling" if get_pooling_config(model, args.revision) else "generate"


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
        calculate_kv_scales=bool(vllm_config.cache_config.calculate_kv_scales),
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
        unproven=envs.MOE_GRAPHS_UNPROVEN,
        head_size=_head_size(hf),
        quantization=(quant := weight_quantization(mc.quantization, hf, mc.quantization_config)),
        fp8_kernels=fp8_kernels(quant, str(vllm_config.kernel_config.moe_backend)),
        sliding_window=mc.get_sliding_window(),
        runner_type=str(mc.runner_type),
        data_parallel_size=vllm_config.parallel_config.data_parallel_size,
        is_moe=bool(mc.is_moe),
        user_compilation=_recorded_user_compilation(vllm_config),
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
        calculate_kv_scales=bool(args.calculate_kv_scales),
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
        unproven=envs.MOE_GRAPHS_UNPROVEN,
        head_size=_head_size(hf),
        quantization=(quant := weight_quantization(args.quantization or _quantization(hf), hf,
                                                   args.quantization_config)),
        fp8_kernels=fp8_kernels(quant, str(args.moe_backend)),
        sliding_window=None if args.disable_sliding_window else _sliding_window(hf),
        runner_type=_runner_type(args, args.model),
        data_parallel_size=int(args.data_parallel_size),
        is_moe=_num_experts(hf) > 0,
        user_compilation=user_compilation(args.optimization_level, args.compilation_config.mode,
                                          args.compilation_config.cudagraph_mode),
    )
