"""Patch: `vllm.v1.engine.core.EngineCoreProc._notify_idle_state_callbacks`.

Why: with `idle_capture` the plugin captures the graphs traffic has not reached yet while the
engine has nothing to do, so a fresh server's lazy captures stop pausing its first requests.
The engine core's input loop (`_process_input_queue`) calls this method each time it is about
to block on its input queue without work: when a step leaves nothing to do, and again after
each client message it handles while idle. So the API server's own calls at start-up
(`get_supported_tasks`, `reset_mm_cache`), a `wake_up` or any other utility call resume the
capture instead of ending it until the next request.
How: the method is wrapped. After the original has notified vLLM's idle-state callbacks, an
engine that is running, awake, without work and without anything queued asks its worker
(`collective_rpc`, in this process for the one-GPU executor) for one capture at a time, until
a message is queued or nothing is left to capture; a message that arrives mid-capture waits for
that one capture. Engines with `idle_capture` off skip all of it after one cached config
read.
Removal: when vLLM offers an idle hook to plugins.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from vllm_moe_graphs.integration.patch import PATCHED_ATTR
from vllm_moe_graphs.integration.signatures import check_parameters

logger = logging.getLogger("vllm.moe_graphs")

MODULE = "vllm.v1.engine.core"
QUALNAME = f"{MODULE}.EngineCoreProc._notify_idle_state_callbacks"
EXPECTED = ("self",)
RPC = "moe_graphs_idle_capture"  # integration/worker.py: MoeGraphsWorker
_ON = "_moe_graphs_idle_capture"  # per engine: whether idle capture is on (cached)


def apply() -> str | None:
    """Patch where the engine core runs: only a process that has imported its module (the
    engine core process has, before plugins load; importing it elsewhere costs start-up)."""
    if MODULE not in sys.modules:
        return None
    from vllm.v1.engine.core import EngineCoreProc

    original = EngineCoreProc._notify_idle_state_callbacks
    if getattr(original, PATCHED_ATTR, False):
        return None
    check_parameters(QUALNAME, original, EXPECTED)
    EngineCoreProc._notify_idle_state_callbacks = wrap(original)
    return QUALNAME


def wrap(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """`original` (vLLM's `_notify_idle_state_callbacks`), then the idle captures."""

    def _notify_idle_state_callbacks(self) -> None:
        original(self)
        if idle_capture_on(self) and self.input_queue.empty():
            capture_while_idle(self)

    _notify_idle_state_callbacks.__wrapped__ = original
    setattr(_notify_idle_state_callbacks, PATCHED_ATTR, True)
    return _notify_idle_state_callbacks


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
