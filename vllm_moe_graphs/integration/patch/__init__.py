"""Every monkeypatch of vLLM, one file per patched symbol.

| file | patched symbol | why | removal condition |
|---|---|---|---|
| platform_config.py | `<current platform>.check_and_update_config` | validate `additional_config["moe_graphs"]` and compute the config-time capability in process 0, before any engine process starts or the model loads | vLLM offers a config-validation hook for general plugins |
| vllm_config_post_init.py | `vllm.config.VllmConfig.__post_init__` | for an eligible setup, select our worker, backend and capture (vLLM's off) *before* vLLM derives custom ops, IR op priorities and capture sizes from them | vLLM offers a pre-finalisation config hook for general plugins |
| worker_base_init.py | `vllm.v1.worker.worker_base.WorkerBase.__init__` | record capability and info metrics in every worker process (also where the plugin does not take over, e.g. CPU), with the rank; runs after plugins load in that process | vLLM offers a per-worker plugin hook |
| engine_core_idle.py | `vllm.v1.engine.core.EngineCoreProc._notify_idle_state_callbacks` (in the engine core process only) | with `idle_capture`, capture the keys traffic has not reached each time the engine core is about to wait for requests (a cached config check otherwise) | vLLM offers an idle hook to plugins |

`plugin.register()` applies these four in every process. Each patch is idempotent (a patched
function carries `__moe_graphs_patched__`), checks the signature of what it wraps first, and
calls the original unchanged.

The features below patch one object, or one attribute for the length of a `with` block, when
they are switched on; their files here say why, how and when each goes:

| file | patched attribute | applied by | removal condition |
|---|---|---|---|
| runner_class.py | `vllm.v1.worker.gpu_model_runner.GPUModelRunner`, during `Worker.init_device` | `worker.MoeGraphsWorker` | a worker can choose its runner class |
| moe_config_lookup.py | `...fused_moe.experts.triton_moe.try_get_optimal_moe_config`, during the start-up warm-up | `startup.moe_warm_up.recording_moe_configs` | vLLM exposes the fused-MoE config per layer |
| compute_logits.py | the loaded model's `compute_logits` (instance) | `model.graph_logits.GraphLogits` (`logits_in_graph`) | vLLM's graphs may include the logits |
| linear_quant_method.py | `quant_method` of eligible linear layers (instance) | `model.small_m_linear.install_small_m_gemm` (`small_m_gemm`) | vLLM picks a small-M GEMM itself |
| module_forward.py | `forward` of eligible Qwen3 attention, RMSNorm and SiLU-and-mul modules (instance) | `model.qk_norm_rope.install_fused_qk_norm_rope` (`fuse_qk_norm_rope`), `model.compiled_numerics.install_compiled_numerics` (`compiled_numerics`) | vLLM's Qwen3 attention fuses q/k norm + RoPE; its uncompiled norms and activation round as its compiled ones |
| router_select_experts.py | `select_experts` of the router of eligible fused-MoE layers (instance) | `model.moe_padding.install_moe_padding` (`skip_moe_padding`) | vLLM's fused MoE takes a count of valid rows |
| router_compute_routing.py | `_compute_routing` of the `FusedTopKRouter` of eligible fused-MoE layers (instance) | `model.moe_padding.install_moe_padding` (`fuse_moe_padding_mask`) | vLLM's fused MoE takes a count of valid rows |
| jit_cache_hook.py | Triton's `knobs.runtime.jit_cache_hook`, during the start-up warm-up's deferred fused-MoE compiles and vLLM's profile run | `startup.moe_warm_up.deferring_fused_moe_compiles`, `startup.sampler_warm_up.SamplerCompile.profiling` (`warm_up_compile_threads`) | vLLM warms its own fused-MoE variants before serving and compiles its sampling kernel off the profile run's critical path |
| fused_moe_pre_run.py | `pre_run_hooks` of vLLM's `fused_moe_kernel`, during the start-up warm-up's deferred compiles | `startup.moe_warm_up.deferring_fused_moe_compiles` (`warm_up_compile_threads`) | vLLM warms its own fused-MoE variants before serving |
| model_layer_range.py | the decoder stack's `end_layer` (instance), during the start-up warm-up's fused-MoE token counts | `startup.precapture._warm_up` | vLLM warms its own fused-MoE variants before serving |
| runner_model.py | the model runner's `model`, during one precapture dummy batch | `runner.lifecycle.GraphLifecycle.capturing` (`precapture`) | vLLM's dummy run takes a capture hook |
"""

from __future__ import annotations

PATCHED_ATTR = "__moe_graphs_patched__"
