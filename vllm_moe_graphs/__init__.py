"""vllm_moe_graphs: safe decode CUDA graphs for Qwen3 / Qwen3-MoE in vLLM 0.26.

Importing this package is cheap: no vLLM, torch or CUDA is touched. The vLLM entry point is
`vllm_moe_graphs.plugin:register` (group `vllm.general_plugins`).
"""

from __future__ import annotations

__version__ = "0.1.0"


# The plugin's graph modes: our attention backend and these `moe_graphs` settings.
_PLUGIN_GRAPH_MODES: dict[str, dict[str, bool | int]] = {
    "plugin_graphs": {},
    "plugin_graphs_experimental": {"small_m_gemm": True, "fuse_qk_norm_rope": True},
    "plugin_graphs_cublas": {"small_m_gemm": False, "fuse_qk_norm_rope": False},
    "plugin_graphs_decode_only": {"mixed_graphs": False},
    "plugin_graphs_moe_padding": {"skip_moe_padding": False},
    "plugin_graphs_fused_router": {"fuse_moe_padding_mask": True},
    "plugin_graphs_serial_warm_up": {"warm_up_compile_threads": 0},
    "plugin_graphs_compiled_numerics": {"compiled_numerics": True},
    "plugin_graphs_sample_in_graph": {"sample_in_graph": True},
}


def benchmark_llm_kwargs(mode: str) -> dict:
    """Extra `vllm.LLM` kwargs of a plugin benchmark mode (`benchmarks/harness/modes.py`).

    `plugin_graphs`: the plugin takes decode graphs over (our worker, runner and attention
    backend; vLLM's capture and torch.compile off), defaults otherwise. `plugin_eager`: our
    attention backend with `enforce_eager`, no graphs at all. `plugin_backend_vllm_graphs`
    (diagnostic): our attention backend inside vLLM's own FULL decode graphs, the plugin's graph
    runner off (`enabled: false`), no torch.compile. `plugin_graphs_experimental`:
    `plugin_graphs` with the small-M GEMM on every eligible linear layer (the default, "auto",
    takes o_proj and down_proj only). `plugin_graphs_cublas` (diagnostic): `plugin_graphs` with
    the small-M GEMM and the fused q/k norm + RoPE off (vLLM's kernels around attention).
    `plugin_graphs_decode_only`: `plugin_graphs` with `mixed_graphs` off (steps with prefill
    tokens eager, only pure decode graphed). `plugin_graphs_moe_padding`: `plugin_graphs`
    with `skip_moe_padding` off (padding rows routed through the MoE experts, as stock vLLM).
    `plugin_graphs_fused_router`: `plugin_graphs` with `fuse_moe_padding_mask` (the padding
    rows' expert ids written by the plugin's routing kernel, no mask launch per MoE layer).
    `plugin_graphs_serial_warm_up`: `plugin_graphs` with the start-up warm-up's fused-MoE
    compiles one after the other (`warm_up_compile_threads: 0`).
    `plugin_graphs_compiled_numerics`: `plugin_graphs` with `compiled_numerics` (RMSNorm and
    SiLU-and-mul rounded as stock's compiled model, by the plugin's Triton kernels).
    `plugin_graphs_sample_in_graph`: `plugin_graphs` with `sample_in_graph` (a sampled batch's
    tokens drawn by the plugin's sampler graph).
    """
    if mode in _PLUGIN_GRAPH_MODES:
        return {"attention_config": {"backend": "CUSTOM"},
                "additional_config": {"moe_graphs": dict(_PLUGIN_GRAPH_MODES[mode])}}
    if mode == "plugin_backend_vllm_graphs":
        return {"attention_config": {"backend": "CUSTOM"},
                "additional_config": {"moe_graphs": {"enabled": False}},
                "compilation_config": {"mode": "NONE", "cudagraph_mode": "FULL_DECODE_ONLY"}}
    if mode == "plugin_eager":
        return {"attention_config": {"backend": "CUSTOM"}, "enforce_eager": True}
    raise NotImplementedError(f"unknown plugin benchmark mode {mode!r}")
