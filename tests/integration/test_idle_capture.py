"""`idle_capture`: the engine core's idle hook (`patch/engine_core_idle.py`) on a stand-in engine
with a real queue, inside vLLM 0.26.0's own input loop (`EngineCoreProc._process_input_queue`),
and the patch on vLLM's real `EngineCoreProc` in a fresh interpreter. The
capture each call makes is `precapture.idle_capture_one`, tested with the stepping runner in
`runner/test_override_precapture.py`; on the GPU, through `vllm serve` in
tests/graphs/test_gpu_serve.py."""

from __future__ import annotations

import logging
import queue
import subprocess
import sys
import textwrap
from types import SimpleNamespace

from vllm_moe_graphs.integration.hooks import WORKER_CLS
from vllm_moe_graphs.integration.patch import engine_core_idle


class Engine:
    """What the hook reads of vLLM's `EngineCoreProc`: its input queue, whether it has work, runs
    and sleeps, its config and its executor's `collective_rpc` (here: `answers`, one per call;
    `arrive_at` queues a request during that call, as the client's thread would)."""

    def __init__(self, answers: list[object], *, idle_capture: bool = True, sleeping=False,
                 arrive_at: int | None = None) -> None:
        self.input_queue: queue.Queue = queue.Queue()
        self.vllm_config = SimpleNamespace(
            additional_config={"moe_graphs": {"idle_capture": idle_capture}},
            parallel_config=SimpleNamespace(worker_cls=WORKER_CLS))
        self.model_executor = SimpleNamespace(collective_rpc=self._rpc)
        self.sleeping, self.answers, self.arrive_at, self.calls = sleeping, answers, arrive_at, []

    def _rpc(self, method: str) -> list[bool]:
        self.calls.append(method)
        if len(self.calls) == self.arrive_at:
            self.input_queue.put(("ADD", "request"))
        answer = self.answers[len(self.calls) - 1]
        if isinstance(answer, Exception):
            raise answer
        return [answer]

    def has_work(self) -> bool:
        return False

    def is_running(self) -> bool:
        return True

    def is_sleeping(self) -> bool:
        return self.sleeping


def test_captures_one_key_per_call_until_none_is_left():
    engine = Engine([True, True, False, True])
    assert engine_core_idle.idle_capture_on(engine)
    assert engine_core_idle.capture_while_idle(engine) == 3
    assert engine.calls == [engine_core_idle.RPC] * 3


def test_a_request_stops_idle_capture_after_the_capture_in_flight():
    engine = Engine([True] * 5, arrive_at=2)
    assert engine_core_idle.capture_while_idle(engine) == 2


def test_nothing_while_asleep_queued_or_off():
    assert engine_core_idle.capture_while_idle(Engine([True], sleeping=True)) == 0
    busy = Engine([True])
    busy.input_queue.put(("ADD", "request"))
    assert engine_core_idle.capture_while_idle(busy) == 0
    off = Engine([True], idle_capture=False)
    assert not engine_core_idle.idle_capture_on(off)
    broken = Engine([True])
    broken.vllm_config.additional_config = {"moe_graphs": {"idle_capture": "yes"}}
    assert not engine_core_idle.idle_capture_on(broken), "a bad config: off (vLLM reports it)"
    stock = Engine([True])  # the plugin did not take over: vLLM's worker has no such call
    stock.vllm_config.parallel_config.worker_cls = "vllm.v1.worker.gpu_worker.Worker"
    assert not engine_core_idle.idle_capture_on(stock)


def test_a_failing_call_turns_idle_capture_off_for_that_engine(caplog):
    engine = Engine([AttributeError("'Worker' object has no attribute 'moe_graphs_idle_capture'")])
    assert engine_core_idle.idle_capture_on(engine)
    with caplog.at_level(logging.WARNING, logger="vllm.moe_graphs"):
        assert engine_core_idle.capture_while_idle(engine) == 0
    assert not engine_core_idle.idle_capture_on(engine)
    assert "idle_capture off for this engine (AttributeError" in caplog.text


class LoopEngine(Engine):
    """`Engine` plus what vLLM's `_process_input_queue` itself touches: the aborts queue, its
    blocking flag, the idle-state callbacks (vLLM's method, wrapped as the patch wraps it) and
    `_handle_client_request` (here: a request gives the engine work; any message is recorded)."""

    def __init__(self, answers: list[object], **kwargs) -> None:
        super().__init__(answers, **kwargs)
        from vllm.v1.engine.core import EngineCoreProc

        self.aborts_queue: queue.Queue = queue.Queue()
        self.process_input_queue_block = True
        self._idle_state_callbacks: list = []
        self.handled: list[tuple] = []
        self.work = False
        self._notify = engine_core_idle.wrap(EngineCoreProc._notify_idle_state_callbacks)

    def _notify_idle_state_callbacks(self) -> None:
        self._notify(self)

    def _handle_client_request(self, kind: str, payload: str) -> None:
        self.handled.append((kind, payload))
        self.work = self.work or kind == "ADD"

    def has_work(self) -> bool:
        return self.work

    def wait_for_work(self) -> None:
        """vLLM's loop as the busy loop runs it: it returns once a request gave it work."""
        from vllm.v1.engine.core import EngineCoreProc

        EngineCoreProc._process_input_queue(self)


UTILITY = ("UTILITY", "get_supported_tasks")
REQUEST = ("ADD", "request")


def scripted(engine: LoopEngine, arrivals: dict[int, tuple]) -> None:
    """The client's messages as they reach `engine`: `arrivals[n]` is queued during the n-th
    worker call (the capture in flight)."""
    answer = engine._rpc

    def rpc(method: str) -> list[bool]:
        result = answer(method)
        if len(engine.calls) in arrivals:
            engine.input_queue.put(arrivals[len(engine.calls)])
        return result

    engine.model_executor.collective_rpc = rpc


def test_a_client_call_queued_before_the_loop_starts_does_not_end_idle_capture():
    """The API server's start-up calls (`get_supported_tasks`, `reset_mm_cache`) can be queued
    before the engine core first waits: handled first, then the capture starts, until a
    request arrives (during the 3rd capture here)."""
    engine = LoopEngine([True] * 8)
    engine.input_queue.put(UTILITY)
    scripted(engine, {3: REQUEST})
    engine.wait_for_work()
    assert engine.handled == [UTILITY, REQUEST], engine.handled
    assert engine.calls == [engine_core_idle.RPC] * 3


def test_a_client_call_during_a_capture_waits_for_it_and_the_capture_resumes():
    engine = LoopEngine([True] * 8)
    scripted(engine, {1: UTILITY, 4: REQUEST})
    engine.wait_for_work()
    assert engine.handled == [UTILITY, REQUEST], engine.handled
    assert engine.calls == [engine_core_idle.RPC] * 4, "1 before the utility call, 3 after"


def test_once_nothing_is_left_an_idle_wait_costs_one_worker_call():
    """vLLM's loop notifies the idle callbacks again after every message; once the worker
    answers that nothing is left, each later wait asks it once, and it captures nothing."""
    engine = LoopEngine([True, False, False])
    scripted(engine, {2: UTILITY, 3: REQUEST})
    engine.wait_for_work()
    assert engine.handled == [UTILITY, REQUEST], engine.handled
    assert engine.calls == [engine_core_idle.RPC] * 3


def test_the_patch_wraps_vllms_engine_core_only_where_it_runs():
    """On vLLM 0.26.0's `EngineCoreProc` (signature checked); a process that has not imported
    the engine core's module is left alone (no import cost)."""
    code = textwrap.dedent("""
        import sys
        from vllm_moe_graphs.integration.patch import PATCHED_ATTR, engine_core_idle
        print("=", engine_core_idle.apply(), "vllm.v1.engine.core" in sys.modules)
        from vllm.v1.engine.core import EngineCoreProc
        original = EngineCoreProc._notify_idle_state_callbacks
        print("=", engine_core_idle.apply(), engine_core_idle.apply())
        patched = EngineCoreProc._notify_idle_state_callbacks
        print("=", getattr(patched, PATCHED_ATTR, False), patched.__wrapped__ is original)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [ln[2:] for ln in proc.stdout.splitlines() if ln.startswith("= ")]
    assert lines == ["None False", f"{engine_core_idle.QUALNAME} None", "True True"], lines
