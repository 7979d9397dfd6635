"""vLLM attention backend glue over our Triton kernels (`vllm_moe_graphs.ops`).

vLLM selects it as `--attention-backend CUSTOM` once `registry.register_attention_backend()`
(called by `plugin.register()`) has put `BACKEND_QUALNAME` into vLLM's CUSTOM slot.

- `backend.py`: `MoeGraphsAttentionBackend` (capabilities as class data, KV cache layout, the
  start-up refusals) and `MoeGraphsAttentionImpl` (KV write + kernel launch; glue only).
- `metadata.py`: `MoeGraphsAttentionMetadata` and `MoeGraphsMetadataBuilder` (the *plan* half:
  host work and copies into persistent buffers, outside any captured region).
- `registry.py`: `register_attention_backend()`, vLLM's CUSTOM slot (imports no backend class).

Importing this package is cheap: the submodules (vLLM, torch, triton) load only when vLLM
resolves the backend class. On the step path: may import the vLLM-free package (`ops/`,
`graphs/`, `config`), no other room of integration/.
"""

from __future__ import annotations

BACKEND_QUALNAME = "vllm_moe_graphs.integration.attention.backend.MoeGraphsAttentionBackend"
BACKEND_NAME = "CUSTOM"  # vLLM looks the layer's backend up as AttentionBackendEnum[get_name()]

__all__ = ["BACKEND_NAME", "BACKEND_QUALNAME"]
