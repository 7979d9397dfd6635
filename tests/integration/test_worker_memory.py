"""`MoeGraphsWorker.determine_available_memory`: the graph pool's budget comes out of the KV cache
memory vLLM computed, as vLLM does for its own graphs (CPU; vLLM's profiling, which needs a GPU,
is stood in for by a fixed result, as a saved start-up plan would give)."""

from __future__ import annotations

import logging
import types

import pytest

pytest.importorskip("vllm.v1.worker.gpu_worker")
from vllm.v1.worker.gpu_worker import Worker  # noqa: E402

from benchmarks.serving.server import log_facts  # noqa: E402
from vllm_moe_graphs.config import PluginConfig  # noqa: E402
from vllm_moe_graphs.integration.worker import (  # noqa: E402
    MoeGraphsWorker,
    graph_pool_reserve,
    kv_memory_after_reserve,
)

GIB, MIB = 2**30, 2**20


def worker(monkeypatch, vllm_result: int, *, budget: int = 2048, fixed: int | None = None,
           plan: int | None = None, runner_graphs: bool = True) -> MoeGraphsWorker:
    """A MoeGraphsWorker without a device: vLLM's `determine_available_memory` returns
    `vllm_result` (and, like vLLM's start-up plan, sets kv_cache_memory_bytes to `plan`)."""
    w = object.__new__(MoeGraphsWorker)
    w.cache_config = types.SimpleNamespace(kv_cache_memory_bytes=fixed,
                                           gpu_memory_utilization=0.9)
    lifecycle = types.SimpleNamespace(config=PluginConfig(graph_memory_budget_mib=budget))
    w.model_runner = types.SimpleNamespace(**({"moe_graphs": lifecycle} if runner_graphs
                                              else {}))

    def vllms(self) -> int:
        if plan is not None and self.cache_config.kv_cache_memory_bytes is None:
            self.cache_config.kv_cache_memory_bytes = plan
        return vllm_result

    monkeypatch.setattr(Worker, "determine_available_memory", vllms)
    return w


def test_the_pool_budget_comes_out_of_vllms_kv_memory(monkeypatch, caplog):
    monkeypatch.delenv("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", raising=False)
    with caplog.at_level(logging.INFO, logger="vllm.moe_graphs"):
        assert worker(monkeypatch, 40 * GIB).determine_available_memory() == 40 * GIB - 2048 * MIB
    assert "2048 MiB of the KV cache memory set aside for the CUDA graph pool" in caplog.text
    assert log_facts(caplog.text)["graph_pool_set_aside_mib"] == 2048  # the serving benchmark
    assert worker(monkeypatch, 40 * GIB, budget=512).determine_available_memory() == \
        40 * GIB - 512 * MIB


def test_a_saved_start_up_plans_kv_size_gets_the_budget_taken_off_too(monkeypatch):
    monkeypatch.delenv("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", raising=False)
    w = worker(monkeypatch, 30 * GIB, plan=30 * GIB)
    assert w.determine_available_memory() == 30 * GIB - 2048 * MIB


def test_an_operators_fixed_kv_cache_or_vllms_switch_leaves_it_alone(monkeypatch, caplog):
    monkeypatch.delenv("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", raising=False)
    with caplog.at_level(logging.INFO, logger="vllm.moe_graphs"):
        assert worker(monkeypatch, 10 * GIB, fixed=10 * GIB).determine_available_memory() == \
            10 * GIB
    assert "not taken out of the KV cache memory" in caplog.text
    monkeypatch.setenv("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", "0")
    assert worker(monkeypatch, 40 * GIB).determine_available_memory() == 40 * GIB
    monkeypatch.delenv("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.moe_graphs"):  # no pool: nothing to say
        assert worker(monkeypatch, 40 * GIB, budget=0).determine_available_memory() == 40 * GIB
    assert "graph pool" not in caplog.text
    # vLLM's V2 runner: the plugin's graphs are off, nothing to set aside
    assert worker(monkeypatch, 40 * GIB, runner_graphs=False).determine_available_memory() == \
        40 * GIB


def test_too_little_kv_memory_for_the_budget_names_both_fixes(monkeypatch):
    monkeypatch.delenv("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", raising=False)
    with pytest.raises(ValueError) as err:
        worker(monkeypatch, 1 * GIB).determine_available_memory()
    msg = str(err.value)
    assert "1.00 GiB" in msg and "--gpu-memory-utilization 0.9" in msg
    assert "graph_memory_budget_mib 2048" in msg and "Raise --gpu-memory-utilization" in msg


def test_reserve_rules():
    assert graph_pool_reserve(2048, True, None) == 2048 * MIB
    assert graph_pool_reserve(2048, False, None) == 0
    assert graph_pool_reserve(2048, True, 5 * GIB) == 0
    assert graph_pool_reserve(0, True, None) == 0
    assert kv_memory_after_reserve(10 * GIB, 0, 0.9) == 10 * GIB
    assert kv_memory_after_reserve(10 * GIB, GIB, 0.9) == 9 * GIB
    with pytest.raises(ValueError):
        kv_memory_after_reserve(GIB, GIB, 0.9)
