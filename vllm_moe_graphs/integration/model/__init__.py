"""Model surgery on the loaded vLLM model, installed by the runner when configured.

- `registry.py`: which attention layers the plugin serves (the only module that imports vLLM's
  model classes).
- `kernels.py`: installs the configured surgery below on a model the registry proved.
- `small_m_linear.py`, `qk_norm_rope.py`, `compiled_numerics.py`: our small-M GEMM, vLLM's fused
  q/k norm + RoPE, the compiled model's RMSNorm / SiLU-and-mul rounding on eligible layers.
- `moe_padding.py`: padding rows skip the fused MoE's experts.
- `graph_logits.py`: the LM head inside the decode graph.

On the step path. May import patch/ (the per-instance patches it applies) and the vLLM-free
package (`ops/`, `graphs/`, `kv/`, `capability`); no other room of integration/.
"""
