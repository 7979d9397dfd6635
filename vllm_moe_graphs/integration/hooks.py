"""What the patches call: plugin config validation, capability, and metrics recording."""

from __future__ import annotations

import logging
import multiprocessing
import os
from typing import TYPE_CHECKING

from vllm_moe_graphs.capability import (
    DecodeGraphCapability,
    Proof,
    Reason,
    config_capability,
    runtime_capability,
)
from vllm_moe_graphs.config import PluginConfig
from vllm_moe_graphs.integration.config_facts import facts_from_vllm_config

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("vllm.moe_graphs")


def process_role() -> str:
    """`MainProcess`, `EngineCore`, `EngineCore_DP<n>`, `VllmWorker-<rank>`, `ApiServer_<i>`."""
    return multiprocessing.current_process().name


def engine_capability(vllm_config: VllmConfig) -> tuple[PluginConfig, DecodeGraphCapability]:
    """Validate the plugin config (`ValueError` on bad input) and compute the config-time
    report."""
    plugin = PluginConfig.from_additional_config(vllm_config.additional_config)
    return plugin, config_capability(facts_from_vllm_config(vllm_config, plugin))


def on_engine_config(vllm_config: VllmConfig) -> None:
    """Called whenever vLLM finalises a `VllmConfig` (process 0, before engines start)."""
    _, report = engine_capability(vllm_config)
    logger.info("moe_graphs: config-time capability: %s",
                " ".join(r.value for r in report.reasons))


def storage_proof() -> Proof:
    """No KV storage adapter is bound to vLLM's KV cache in this version (the adapter exists in
    `vllm_moe_graphs.kv`, the model-runner integration that binds it does not): replay stays
    denied."""
    return Proof("storage", Reason.STORAGE_UNBOUND,
                 "no KV storage adapter is bound (model-runner integration not built yet)")


def on_worker_init(vllm_config: VllmConfig, rank: int) -> None:
    """Called once per worker process after vLLM built the worker, before the model loads."""
    from vllm_moe_graphs.metrics import Mode, recorder

    plugin, config_report = engine_capability(vllm_config)
    report = runtime_capability(config_report, storage_proof())
    rec = recorder(rank)
    if not plugin.enabled:
        mode = Mode.DISABLED
    elif report.eligible:
        mode = Mode.GRAPHS
    else:
        mode = Mode.STOCK
    rec.set_mode(mode)
    rec.set_capability(report)
    logger.info(
        "moe_graphs: recorded capability in process %s (pid %d, rank %d): mode=%s reasons=%s",
        process_role(), os.getpid(), rank, mode.value,
        ",".join(r.value for r in report.reasons))
