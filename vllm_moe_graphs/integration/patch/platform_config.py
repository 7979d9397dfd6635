"""Patch: the current platform's `check_and_update_config`.

Why: it is the one call that sees the whole `VllmConfig` in process 0, after vLLM settled it
and before any engine process starts; the plugin validates its config there (a bad
`--additional-config` fails at start-up) and computes the config-time capability.
How: the classmethod is wrapped; the original runs first, unchanged.
Removal: when vLLM offers a config hook for general plugins.
"""

from __future__ import annotations

from vllm_moe_graphs.integration.patch import PATCHED_ATTR
from vllm_moe_graphs.integration.signatures import check_parameters


def apply() -> str | None:
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    original = platform_cls.check_and_update_config
    if getattr(original, PATCHED_ATTR, False):
        return None
    qualname = f"{platform_cls.__name__}.check_and_update_config"
    check_parameters(qualname, original, ("vllm_config",))
    original_fn = original.__func__

    def check_and_update_config(cls, vllm_config):  # noqa: ANN001 - vLLM's signature
        original_fn(cls, vllm_config)
        from vllm_moe_graphs.integration import hooks

        hooks.on_engine_config(vllm_config)

    setattr(check_and_update_config, PATCHED_ATTR, True)
    platform_cls.check_and_update_config = classmethod(check_and_update_config)
    return qualname
