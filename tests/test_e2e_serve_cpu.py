"""End to end through real `vllm serve` (CPU build of vLLM 0.26.0, ../shared/cpu-vllm).

Checks that register() runs in every vLLM process, that metrics recorded in the worker process
reach the API server's own /metrics (once, also with two API servers), and that
MOE_GRAPHS_DISABLE=1 leaves stock vLLM serving with none of our series.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.serve_util import cpu_env, get, post_json, vllm_serve

pytestmark = pytest.mark.e2e


def _complete(base: str, model: str) -> dict:
    return post_json(base + "/v1/completions",
                     {"model": model, "prompt": "hello world", "max_tokens": 4,
                      "temperature": 0})


def _registered_roles(log: str) -> set[str]:
    return set(re.findall(r"moe_graphs [\d.]+: registered in process (\S+) \(pid", log))


def _metric_lines(text: str, name: str) -> list[str]:
    return [ln for ln in text.splitlines() if re.match(rf"^{name}[{{ ]", ln)]


def test_serve_with_plugin(tiny_qwen3, cpu_vllm, tmp_path):
    log_path = str(tmp_path / "serve.log")
    idle = ("--additional-config", '{"moe_graphs": {"idle_capture": true}}')
    with vllm_serve(tiny_qwen3, cpu_vllm, log_path, args=idle) as base:
        out = _complete(base, tiny_qwen3)
        assert out["usage"]["completion_tokens"] == 4
        metrics = get(base + "/metrics")
    log = open(log_path).read()
    # register() ran in every vLLM process: API server, engine core and its worker
    roles = _registered_roles(log)
    assert "MainProcess" in roles and any(r.startswith("EngineCore") for r in roles), roles
    # idle_capture's hook is in the engine core's loop only, and idle there without our worker
    hooked = re.findall(r"registered in process (\S+) \(pid \d+\): [^\n]*EngineCoreProc", log)
    assert hooked and all(r.startswith("EngineCore") for r in hooked), hooked
    assert "idle_capture off" not in log
    assert any(r.startswith("VllmWorker") for r in roles) or len(roles) >= 2, roles
    # the capability was recorded in the worker (never in the API server process) ...
    recorded = re.findall(r"recorded capability in process (\S+) \(pid", log)
    assert recorded and "MainProcess" not in recorded, recorded
    # ... and reached the API server's /metrics, next to vLLM's own series
    info = [ln for ln in _metric_lines(metrics, "moe_graphs_info") if ln.endswith(" 1.0")]
    assert info == ['moe_graphs_info{mode="stock",version="0.1.0"} 1.0'], info
    assert 'moe_graphs_capability{reason="no_cuda"} 1.0' in metrics
    assert 'moe_graphs_capability{reason="eligible"} 0.0' in metrics
    assert sorted(_metric_lines(metrics, "moe_graphs_replays_total")) == [
        f'moe_graphs_replays_total{{kind="{k}",rank="0"}} 0.0'
        for k in ("decode", "mixed", "prefill")]
    assert re.search(r"^vllm:", metrics, re.MULTILINE), "vLLM's own metrics must stay"


def test_serve_rollback_disable(tiny_qwen3, cpu_vllm, tmp_path):
    log_path = str(tmp_path / "serve.log")
    with vllm_serve(tiny_qwen3, cpu_vllm, log_path,
                    env_extra={"MOE_GRAPHS_DISABLE": "1"}) as base:
        out = _complete(base, tiny_qwen3)
        assert out["usage"]["completion_tokens"] == 4
        metrics = get(base + "/metrics")
    log = open(log_path).read()
    assert "moe_graphs" not in metrics
    assert re.search(r"^vllm:", metrics, re.MULTILINE)
    assert not _registered_roles(log)
    assert "MOE_GRAPHS_DISABLE=1, nothing registered" in log


def test_serve_two_api_servers_no_double_counting(tiny_qwen3, cpu_vllm, tmp_path):
    log_path = str(tmp_path / "serve.log")
    with vllm_serve(tiny_qwen3, cpu_vllm, log_path, args=("--api-server-count", "2")) as base:
        _complete(base, tiny_qwen3)
        scrapes = [get(base + "/metrics") for _ in range(6)]  # served by both API servers
    for metrics in scrapes:
        info = [ln for ln in _metric_lines(metrics, "moe_graphs_info") if ln.endswith(" 1.0")]
        assert info == ['moe_graphs_info{mode="stock",version="0.1.0"} 1.0'], info
        assert len(_metric_lines(metrics, "moe_graphs_replays_total")) == 3  # one per step kind
        assert len(re.findall(r'^moe_graphs_capability\{reason="no_cuda"\} 1\.0$', metrics,
                              re.MULTILINE)) == 1


def test_serve_tensor_parallel_each_rank_once(tiny_qwen3, cpu_vllm, tmp_path):
    """--tensor-parallel-size 2 (two worker processes): both ranks load the plugin
    and record their own counters; /metrics shows each rank's series exactly once."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"needs 2 CPUs for 2 CPU workers, have {cpus}")
    log_path = str(tmp_path / "serve.log")
    # vLLM's CPU workers bind one NUMA node each unless told which cores: one core per rank
    with vllm_serve(tiny_qwen3, cpu_vllm, log_path, args=("--tensor-parallel-size", "2"),
                    env_extra={"VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}|{cpus[1]}"}) as base:
        out = _complete(base, tiny_qwen3)
        assert out["usage"]["completion_tokens"] == 4
        metrics = get(base + "/metrics")
    log = open(log_path).read()
    recorded = re.findall(r"recorded capability in process \S+ \(pid \d+, rank (\d+)\)", log)
    assert sorted(set(recorded)) == ["0", "1"], recorded
    assert sorted(_metric_lines(metrics, "moe_graphs_replays_total")) == [
        f'moe_graphs_replays_total{{kind="{k}",rank="{r}"}} 0.0'
        for k in ("decode", "mixed", "prefill") for r in ("0", "1")]
    info = [ln for ln in _metric_lines(metrics, "moe_graphs_info") if ln.endswith(" 1.0")]
    assert info == ['moe_graphs_info{mode="stock",version="0.1.0"} 1.0'], info


def test_serve_bad_env_value_fails_at_startup(tiny_qwen3, cpu_vllm):
    proc = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", tiny_qwen3,
         "--enforce-eager"],
        capture_output=True, text=True, timeout=300,
        env=cpu_env(cpu_vllm, MOE_GRAPHS_DISABLE="yes please"))
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "MOE_GRAPHS_DISABLE='yes please'" in out and "accepted: 1, true, 0, false" in out


def test_serve_bad_plugin_config_fails_at_startup(tiny_qwen3, cpu_vllm):
    proc = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", tiny_qwen3,
         "--enforce-eager", "--additional-config",
         '{"moe_graphs": {"decode_batch_buckets": [8, 4]}}'],
        capture_output=True, text=True, timeout=300, env=cpu_env(cpu_vllm))
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "moe_graphs.decode_batch_buckets=[8, 4]" in out and "[4, 8]" in out
    assert "Loading weights" not in out  # failed before any engine started
