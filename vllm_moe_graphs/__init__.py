"""vllm_moe_graphs: safe decode CUDA graphs for Qwen3 / Qwen3-MoE in vLLM 0.26.

Importing this package is cheap: no vLLM, torch or CUDA is touched. The vLLM entry point is
`vllm_moe_graphs.plugin:register` (group `vllm.general_plugins`).
"""

from __future__ import annotations

__version__ = "0.1.0"
