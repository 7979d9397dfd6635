"""Patch: `vllm.v1.engine.core.EngineCoreProc._process_input_queue`.

Why: with `idle_capture` the plugin captures the graphs traffic has not reached yet while the
engine has nothing to do, so a fresh server's lazy captures stop pausing its first requests.
The engine core's busy loop is the one place that knows it is idle: it blocks there on its
input queue until a request (or any other client call) arrives.
How: the method is wrapped. Before the original runs (and blocks), an engine that is running,
awake, without work and without anything queued asks its worker (`collective_rpc`, in this
process for the one-GPU executor) for one capture at a time, until a message is queued or
nothing is left to capture; a message that arrives mid-capture waits for that one capture.
Engines without `idle_capture` (the default) skip all of it after one cached config read.
Removal: when vLLM offers an idle hook to plugins.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from vllm_moe_graphs.integration.patch import PATCHED_ATTR
from vllm_moe_graphs.integration.signatures import check_parameters

logger = logging.getLogger("vllm.moe_graphs")

MODULE = "vllm.v1.engine.core"
QUALNAME = f"{MODULE}.EngineCoreProc._process_input_queue"
EXPECTED = ("self",)
RPC = "moe_graphs_idle_capture"  # integration/worker.py: MoeGraphsWorker
_ON = "_moe_graphs_idle_capture"  # per engine: whether idle capture is on (cached)


def apply() -> str | None:
    """Patch where the engine core runs: only a process that has imported its module (the
    engine core process has, before plugins load; importing it elsewhere costs start-up)."""
    if MODULE not in sys.modules:
        return None
    from vllm.v1.engine.core import EngineCoreProc

    original = EngineCoreProc._process_input_queue
    if getattr(original, PATCHED_ATTR, False):
        return None
    check_parameters(QUALNAME, original, EXPECTED)

    def _process_input_queue(self):
        if idle_capture_on(self) and self.input_queue.empty():
            capture_while_idle(self)
        return original(self)

    _process_input_queue.__wrapped__ = original
    setattr(_process_input_queue, PATCHED_ATTR, True)
    EngineCoreProc._process_input_queue = _process_input_queue
    return QUALNAME


def idle_capture_on(engine: Any) -> bool:
    """Whether `engine` runs with `idle_capture` and the plugin's worker (read once from its
    config, then cached)."""
    on = engine.__dict__.get(_ON)
    if on is None:
        from vllm_moe_graphs.config import plugin_config
        from vllm_moe_graphs.integration.hooks import WORKER_CLS

        try:
            cfg = engine.vllm_config
            plugin = plugin_config(cfg.additional_config)
            on = (plugin.enabled and plugin.idle_capture
                  and cfg.parallel_config.worker_cls == WORKER_CLS)
        except (AttributeError, ValueError):  # no config or a bad one: vLLM reports the latter
            on = False
        setattr(engine, _ON, on)
    return on


def capture_while_idle(engine: Any) -> int:
    """Captures, one per worker call, while `engine` is running, awake, without work and with
    nothing queued; returns how many calls ran. A call that raises turns idle capture off for
    this engine (logged): serving goes on with lazy capture."""
    calls = 0
    while (engine.input_queue.empty() and not engine.has_work() and engine.is_running()
           and not engine.is_sleeping()):
        try:
            more = all(engine.model_executor.collective_rpc(RPC))
        except Exception as exc:  # noqa: BLE001 - e.g. not our worker: lazy capture only
            setattr(engine, _ON, False)
            logger.warning("moe_graphs: idle_capture off for this engine (%s: %s); graphs are "
                           "captured lazily", type(exc).__name__, exc)
            return calls
        calls += 1
        if not more:
            break
    return calls
