"""The vLLM entry point (`vllm.general_plugins` -> `moe_graphs`).

vLLM calls `register()` in every process it starts (API server, EngineCore, workers). It is
idempotent, imports nothing heavy at module import, never initialises CUDA, and logs one line
saying what it wired in. With `MOE_GRAPHS_DISABLE=1` it registers and patches nothing.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("vllm.moe_graphs")

_registered_pids: set[int] = set()


def register() -> None:
    from vllm_moe_graphs import __version__, envs

    pid = os.getpid()
    if pid in _registered_pids:
        return
    envs.validate_all()  # a bad MOE_GRAPHS_* value fails start-up here, naming the value
    _registered_pids.add(pid)
    from vllm_moe_graphs.integration.hooks import process_role

    role = process_role()
    if envs.MOE_GRAPHS_DISABLE:
        logger.info("moe_graphs %s: MOE_GRAPHS_DISABLE=1, nothing registered in process %s "
                    "(pid %d): stock vLLM", __version__, role, pid)
        return

    from vllm_moe_graphs import metrics_transport

    wired = apply_patches()
    from vllm_moe_graphs.integration.attention.registry import register_attention_backend

    try:
        wired.append(f"attention backend CUSTOM -> {register_attention_backend()}")
    except RuntimeError as exc:  # another plugin owns CUSTOM: serve on, without our backend
        logger.warning("moe_graphs: %s", exc)
    from vllm_moe_graphs.integration.startup.model_info_seed import seed_model_info_cache

    if seeded := seed_model_info_cache():
        wired.append(f"vLLM's model-info cache seeded for {', '.join(seeded)}")
    if metrics_transport.is_root_process():
        metrics_transport.setup_root()
        wired.append("metrics collector on /metrics")
    logger.info("moe_graphs %s: registered in process %s (pid %d): %s", __version__, role, pid,
                ", ".join(wired) or "already patched")


def apply_patches() -> list[str]:
    """Apply the process-wide patches of vLLM (`integration/patch/`, its first table); return the
    names of what was patched now."""
    from vllm_moe_graphs.integration.patch import (
        engine_core_idle,
        platform_config,
        vllm_config_post_init,
        worker_base_init,
    )

    applied = []
    for module in (vllm_config_post_init, platform_config, worker_base_init, engine_core_idle):
        name = module.apply()
        if name:
            applied.append(name)
    return applied
