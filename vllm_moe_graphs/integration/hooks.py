"""What the patches call: plugin config validation, capability, and metrics recording."""

from __future__ import annotations

import logging
import multiprocessing
import os
from typing import TYPE_CHECKING

from vllm_moe_graphs import envs
from vllm_moe_graphs.capability import (
    DecodeGraphCapability,
    Proof,
    Reason,
    config_capability,
    runtime_capability,
    unproven_taken_over,
)
from vllm_moe_graphs.config import PluginConfig, plugin_config
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
    plugin = plugin_config(vllm_config.additional_config)
    facts = facts_from_vllm_config(vllm_config, plugin)
    report = config_capability(facts)
    if report.eligible and (taken := unproven_taken_over(facts)):
        logger.warning("moe_graphs: MOE_GRAPHS_UNPROVEN: taking over %s, not yet proven against "
                       "stock vLLM on a GPU: for parity runs, not for serving",
                       " and ".join(taken))
    return plugin, report


WORKER_CLS = "vllm_moe_graphs.integration.worker.MoeGraphsWorker"
STOCK_WORKER_CLS = ("auto", "vllm.v1.worker.gpu_worker.Worker")
V1_RUNNER_ENV = envs.VLLM_RUNNER_VARIABLE  # vLLM's own variable: "0" selects the V1 runner


def take_over_decode_graphs(vllm_config: VllmConfig) -> tuple[list[str], list[str]]:
    """Edit a not yet finalised `VllmConfig` so decode graphs are ours; return (edits, conflicts).

    Our worker (`--worker-cls`), our attention backend (`--attention-backend CUSTOM`), vLLM's own
    capture off (`-cc.cudagraph_mode=NONE`), no torch.compile (`-cc.mode=NONE`; a decode step
    replays one graph, so compile buys decode nothing and costs start-up; a user's choice of
    either, or of an optimization level, denies the take-over: `user_compilation`), and the V1
    model runner for dense Qwen3 too (`VLLM_USE_V2_MODEL_RUNNER=0`, exported before any engine
    process starts, so every process agrees). A user choice that
    contradicts one of these is a conflict: nothing is edited and stock vLLM runs.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    pc = vllm_config.parallel_config
    cc = vllm_config.compilation_config
    ac = vllm_config.attention_config
    conflicts = []
    if pc.worker_cls not in STOCK_WORKER_CLS + (WORKER_CLS,):
        conflicts.append(f"--worker-cls {pc.worker_cls}")
    if ac.backend not in (None, AttentionBackendEnum.CUSTOM):
        conflicts.append(f"--attention-backend {ac.backend.name}")
    raw = envs.get_raw(V1_RUNNER_ENV)
    v1_env = (raw or "").strip().lower()
    if v1_env not in ("", "0", "false"):
        conflicts.append(f"{V1_RUNNER_ENV}={raw}")
    if conflicts:
        return [], conflicts
    edits = []
    if pc.worker_cls != WORKER_CLS:
        pc.worker_cls = WORKER_CLS
        edits.append(f"worker_cls={WORKER_CLS}")
    if ac.backend is None:
        ac.backend = AttentionBackendEnum.CUSTOM
        edits.append("attention backend CUSTOM")
    if cc.cudagraph_mode is None:
        from vllm.config.compilation import CUDAGraphMode

        cc.cudagraph_mode = CUDAGraphMode.NONE
        edits.append("cudagraph_mode=NONE")
    if cc.mode is None:
        from vllm.config.compilation import CompilationMode

        cc.mode = CompilationMode.NONE
        edits.append("compilation mode NONE")
    if v1_env == "":
        envs.select_vllm_v1_runner()
        edits.append(f"{V1_RUNNER_ENV}=0")
    return edits, conflicts


def before_engine_config(vllm_config: VllmConfig) -> None:
    """Called at the start of `VllmConfig.__post_init__` (process 0, before engines start): an
    eligible setup is taken over (`take_over_decode_graphs`); anything else is left untouched."""
    if vllm_config.model_config is None:
        return
    _, report = engine_capability(vllm_config)
    if not report.eligible:
        return  # on_engine_config logs the reasons once the config is final
    edits, conflicts = take_over_decode_graphs(vllm_config)
    if conflicts:
        logger.warning("moe_graphs: not taking CUDA graphs over because of %s; stock vLLM runs "
                       "(drop those settings, see docs/architecture.md, the take-over)",
                       ", ".join(conflicts))
    else:
        logger.info("moe_graphs: CUDA graphs taken over: %s", ", ".join(edits) or
                    "already configured by flags")


def on_engine_config(vllm_config: VllmConfig) -> None:
    """Called whenever vLLM finalises a `VllmConfig` (process 0, before engines start)."""
    _, report = engine_capability(vllm_config)
    logger.info("moe_graphs: config-time capability: %s",
                " ".join(r.value for r in report.reasons))


UNBOUND_AT_START = Proof("storage", Reason.STORAGE_UNBOUND,
                         "the KV cache is not allocated yet (worker start)")


def record_capability(vllm_config: VllmConfig, rank: int, storage: Proof,
                      graphs_on: bool) -> DecodeGraphCapability:
    """Record the runtime capability and the mode in this process' metrics and the log.
    `graphs_on`: this process' runner replays decode graphs when the report is eligible."""
    from vllm_moe_graphs.metrics import Mode, recorder

    plugin, config_report = engine_capability(vllm_config)
    report = runtime_capability(config_report, storage)
    rec = recorder(rank)
    if not plugin.enabled:
        mode = Mode.DISABLED
    elif report.eligible and graphs_on:
        mode = Mode.GRAPHS
    else:
        mode = Mode.STOCK
    rec.set_mode(mode)
    rec.set_capability(report)
    logger.info(
        "moe_graphs: recorded capability in process %s (pid %d, rank %d): mode=%s reasons=%s",
        process_role(), os.getpid(), rank, mode.value,
        ",".join(r.value for r in report.reasons))
    return report


def on_worker_init(vllm_config: VllmConfig, rank: int) -> None:
    """Called once per worker process after vLLM built the worker, before the model loads; the
    plugin's model runner records again once the KV storage is bound."""
    record_capability(vllm_config, rank, UNBOUND_AT_START, graphs_on=False)
