"""KV cache ownership: `PagedKVStorage` (the identity decode graphs bake in) and its proofs.

Importing this package imports torch but neither vLLM nor triton. The write proof lives in
`vllm_moe_graphs.kv.proofs` (it imports the Triton ops: import it explicitly).
"""

from __future__ import annotations

from vllm_moe_graphs.kv.identity import (
    LayerIdentity,
    Phase,
    StorageIdentity,
    TensorIdentity,
    layer_index_from_name,
)
from vllm_moe_graphs.kv.storage import InvalidationListener, InvalidationSink, PagedKVStorage

__all__ = [
    "InvalidationListener",
    "InvalidationSink",
    "LayerIdentity",
    "PagedKVStorage",
    "Phase",
    "StorageIdentity",
    "TensorIdentity",
    "layer_index_from_name",
]
