"""Put our attention backend into vLLM's CUSTOM slot (`--attention-backend CUSTOM`).

vLLM 0.26: `register_backend(AttentionBackendEnum.CUSTOM, "<module>.<Class>")` records a class
path in `vllm.v1.attention.backends.registry`; the class is imported lazily, in the worker, when
a model's attention layers select CUSTOM. The registry is per process, so the plugin calls
`register_attention_backend()` from `register()` in every process vLLM starts.
"""

from __future__ import annotations

from vllm_moe_graphs.integration.attention import BACKEND_QUALNAME


def register_attention_backend() -> str:
    """Register `BACKEND_QUALNAME` as vLLM's CUSTOM attention backend; return that path.

    Idempotent. Imports only vLLM's registry module: not the backend class, not torch kernels or
    triton, and never initialises CUDA. Raises `RuntimeError` if another plugin already owns the
    CUSTOM slot (overwriting it would silently swap that plugin's backend for ours).
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    custom = AttentionBackendEnum.CUSTOM
    if custom.is_overridden():
        current = custom.get_path()
        if current == BACKEND_QUALNAME:
            return BACKEND_QUALNAME
        raise RuntimeError(
            f"vLLM's CUSTOM attention backend is already registered to {current!r}; "
            f"vllm_moe_graphs needs it for {BACKEND_QUALNAME!r}. Uninstall or disable the other "
            "plugin (VLLM_PLUGINS=<names> selects which plugins load), or set "
            "MOE_GRAPHS_DISABLE=1 to run without vllm_moe_graphs."
        )
    register_backend(custom, BACKEND_QUALNAME)
    return BACKEND_QUALNAME
