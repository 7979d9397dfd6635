"""The decode-step profiling tools' host-side parts (no GPU):
benchmarks/harness/profile_steps.py's decode driver and thread report, profile_prefill.py's
prefill rounds, benchmarks/gpu/host_probe.py's CPU ranking, the diagnostic benchmark modes."""

from __future__ import annotations

import importlib.util
import os
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

import vllm_moe_graphs
from benchmarks.harness import profile_prefill, profile_steps
from benchmarks.harness.modes import DEFAULT_MODES, MODES, STOCK_GRAPH_MODES
from tests.benchmarks.harness_util import _Engine
from vllm_moe_graphs.config import PluginConfig

REPO = Path(__file__).resolve().parents[2]


def _host_probe():
    spec = importlib.util.spec_from_file_location("host_probe",
                                                  REPO / "benchmarks" / "gpu" / "host_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_decoding_driver_reaches_decode_only_steps() -> None:
    engine = _Engine(budget=700, lag=False)
    engine.prefill_sleep_s = 0.0
    llm = SimpleNamespace(llm_engine=engine, _preprocess_cmpl=lambda prompts: prompts)
    d = profile_steps._Decoding(llm, batch=3, context=500, max_tokens=20, vocab=100,
                                make_params=lambda n, s, i: SimpleNamespace(max_tokens=n),
                                make_prompt=lambda ids: {"prompt_token_ids": ids}, tag="t")
    d.until_decoding()  # 1500 prompt tokens at 700 per step: prefill takes three steps
    assert all(c >= 1 for c in d.counts.values())
    assert d.step() is True  # every request got exactly one token
    assert len(profile_steps._timed(d, 5)) == 5
    d.close()
    assert not engine.has_unfinished_requests()


def test_decoding_driver_fails_when_decode_never_comes() -> None:
    engine = SimpleNamespace(add_request=lambda *a: None, step=lambda: [],
                             has_unfinished_requests=lambda: False)
    llm = SimpleNamespace(llm_engine=engine, _preprocess_cmpl=lambda prompts: prompts)
    d = profile_steps._Decoding(llm, 2, 4, 8, 10, lambda n, s, i: n, lambda ids: ids, "t")
    with pytest.raises(RuntimeError, match="never reached a decode-only step"):
        d.until_decoding(limit=5)


@pytest.mark.parametrize("budget,steps", [(8192, 1), (2048, 4)])
def test_prefill_round_steps_every_prompt_to_its_one_token(budget: int, steps: int) -> None:
    engine = _Engine(budget=budget, lag=False)
    engine.prefill_sleep_s = 0.0
    llm = SimpleNamespace(llm_engine=engine, _preprocess_cmpl=lambda prompts: prompts)
    wall, n_steps = profile_prefill._prefill_round(
        llm, 16, 512, 100, seed=3, make_params=lambda n: SimpleNamespace(max_tokens=n),
        make_prompt=lambda ids: {"prompt_token_ids": ids})
    # 16 x 512 = 8192 prompt tokens: one step when the budget holds them, else chunks
    assert n_steps == steps and wall >= 0 and not engine.has_unfinished_requests()


def test_kernel_lines_sum_gpu_kernels_per_unit_and_rank_them() -> None:
    from torch.autograd import DeviceType

    ev = lambda key, us, n, dev=DeviceType.CUDA: SimpleNamespace(  # noqa: E731
        key=key, self_device_time_total=us, count=n, device_type=dev)
    avgs = [ev("small", 100.0, 4), ev("big", 900.0, 2), ev("host op", 5000.0, 9, DeviceType.CPU)]
    lines = profile_steps.kernel_lines(avgs, wall_ms=4.0, n=2, unit="round")
    assert lines[0] == ("torch.profiler: wall 2.000 ms/round, GPU kernels 0.500 ms/round "
                        "(3 kernels/round), GPU busy 25%")
    assert lines[1] == "top kernels (us per round, count per round):"
    assert [ln.split()[-1] for ln in lines[2:]] == ["big", "small"]  # no host op, largest first


def test_prefill_token_counts_parse_or_say_what_is_wrong() -> None:
    assert profile_prefill.prefill_token_counts("2048, 8192") == [2048, 8192]
    for bad in ("", "8k", "0", "1024,-1"):
        with pytest.raises(ValueError, match="BENCH_PROFILE_PREFILL=.*positive token counts"):
            profile_prefill.prefill_token_counts(bad)


def test_thread_report_per_step_busiest_first_and_marks_main() -> None:
    main = threading.main_thread().native_id
    before = {main: ("python3", 1_000, 0), 7: ("worker", 0, 0), 8: ("idle", 5, 5)}
    after = {main: ("python3", 4_001_000, 2_000_000), 7: ("worker", 8_000_000, 0),
             8: ("idle", 5, 5), 9: ("new", 1_000_000, 0)}
    lines = profile_steps._thread_report(before, after, steps=4)
    assert lines[0].startswith(f"threads: 4, CPUs allowed {len(os.sched_getaffinity(0))}")
    rows = [line.split() for line in lines[1:]]
    assert [r[2] for r in rows] == ["worker", "python3", "new", "idle"]
    assert rows[0][:2] == ["2000.0", "0.0"]  # 8 ms on a CPU over 4 steps
    assert rows[1][:2] == ["1000.0", "500.0"] and lines[2].endswith("(main)")


def test_task_stats_sees_this_thread() -> None:
    stats = profile_steps._task_stats()
    assert threading.main_thread().native_id in stats
    name, run_ns, wait_ns = stats[threading.main_thread().native_id]
    assert name and run_ns > 0 and wait_ns >= 0


def test_fastest_cpus_is_a_subset_of_the_allowed_ones() -> None:
    probe = _host_probe()
    allowed = os.sched_getaffinity(0)
    best = probe.fastest_cpus(1, rounds=1)
    assert len(best) == 1 and set(best) <= allowed
    assert probe.fastest_cpus(len(allowed) + 5, rounds=1) == sorted(allowed)
    assert os.sched_getaffinity(0) == allowed  # pinning is undone
    assert probe.hooks()["profile"] == "None"


def test_diagnostic_modes_stay_out_of_defaults_and_references() -> None:
    diagnostic = {m for m, mode in MODES.items() if mode.diagnostic}
    assert diagnostic == {"stock_full_decode_nc_v1", "plugin_backend_vllm_graphs",
                          "plugin_graphs_experimental", "plugin_graphs_cublas",
                          "plugin_graphs_decode_only", "plugin_graphs_moe_padding",
                          "plugin_graphs_fused_router", "plugin_graphs_serial_warm_up",
                          "plugin_graphs_compiled_numerics", "plugin_graphs_sample_in_graph"}
    assert not diagnostic & set(DEFAULT_MODES) and not diagnostic & set(STOCK_GRAPH_MODES)
    experimental = vllm_moe_graphs.benchmark_llm_kwargs("plugin_graphs_experimental")
    cfg = PluginConfig.from_additional_config(experimental["additional_config"])
    assert cfg.small_m_gemm is True and cfg.fuse_qk_norm_rope and cfg.enabled
    cublas = vllm_moe_graphs.benchmark_llm_kwargs("plugin_graphs_cublas")
    cfg = PluginConfig.from_additional_config(cublas["additional_config"])
    assert cfg.small_m_gemm is False and cfg.fuse_qk_norm_rope is False and cfg.enabled
    decode_only = vllm_moe_graphs.benchmark_llm_kwargs("plugin_graphs_decode_only")
    cfg = PluginConfig.from_additional_config(decode_only["additional_config"])
    assert cfg.mixed_graphs is False and cfg.enabled and cfg == PluginConfig(mixed_graphs=False)
    padded = vllm_moe_graphs.benchmark_llm_kwargs("plugin_graphs_moe_padding")
    assert PluginConfig.from_additional_config(padded["additional_config"]) == PluginConfig(
        skip_moe_padding=False)
    fused = vllm_moe_graphs.benchmark_llm_kwargs("plugin_graphs_fused_router")
    assert PluginConfig.from_additional_config(fused["additional_config"]) == PluginConfig(
        fuse_moe_padding_mask=True)
    serial = vllm_moe_graphs.benchmark_llm_kwargs("plugin_graphs_serial_warm_up")
    assert PluginConfig.from_additional_config(serial["additional_config"]) == PluginConfig(
        warm_up_compile_threads=0)
    numerics = vllm_moe_graphs.benchmark_llm_kwargs("plugin_graphs_compiled_numerics")
    assert PluginConfig.from_additional_config(numerics["additional_config"]) == PluginConfig(
        compiled_numerics=True)
    sampler = vllm_moe_graphs.benchmark_llm_kwargs("plugin_graphs_sample_in_graph")
    assert PluginConfig.from_additional_config(sampler["additional_config"]) == PluginConfig(
        sample_in_graph=True)
    for name in ("stock_full_decode_nc_v1", "plugin_backend_vllm_graphs"):
        env = MODES[name].worker_env()
        assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
        assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    kwargs = vllm_moe_graphs.benchmark_llm_kwargs("plugin_backend_vllm_graphs")
    assert kwargs["attention_config"] == {"backend": "CUSTOM"}
    assert PluginConfig.from_additional_config(kwargs["additional_config"]).enabled is False
    assert kwargs["compilation_config"]["cudagraph_mode"] == "FULL_DECODE_ONLY"


def test_phase_timers_time_phases_and_leave_nothing_behind() -> None:
    import torch

    class Scheduler:
        def schedule(self) -> str:
            return "scheduled"

    class Runner:
        def execute_model(self, x: int) -> int:
            return x + 1

    scheduler, runner = Scheduler(), Runner()
    executor = SimpleNamespace(driver_worker=SimpleNamespace(worker=SimpleNamespace(
        model_runner=runner)))
    core = SimpleNamespace(scheduler=scheduler, model_executor=executor)
    engine = SimpleNamespace(engine_core=SimpleNamespace(engine_core=core))
    llm = SimpleNamespace(llm_engine=engine)
    sync = torch.cuda.Event.synchronize
    with profile_steps._PhaseTimers(llm) as timers:
        assert scheduler.schedule() == "scheduled"
        assert runner.execute_model(1) == 2 and runner.execute_model(2) == 3
        assert torch.cuda.Event.synchronize is not sync
    assert timers.calls == {"scheduler.schedule": 1, "runner.execute_model": 2}
    assert "schedule" not in vars(scheduler) and "execute_model" not in vars(runner)
    assert torch.cuda.Event.synchronize is sync
    report = timers.report(steps=2)
    assert report[0].startswith("phase timers")
    assert any(line.endswith("1.0  runner.execute_model") for line in report)


def test_host_phases_times_a_real_cpu_engine(cpu_vllm: str) -> None:
    """benchmarks.decode.host_phases on vLLM's CPU build: the V1 runner's and the engine's phases
    are found and timed once per decode step."""
    import subprocess
    import sys

    from tests.serve_util import cpu_env

    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.decode.host_phases", "--batches", "1,2", "--steps", "4",
         "--context", "8"], cwd=REPO, capture_output=True, text=True, timeout=600,
        env=cpu_env(cpu_vllm, VLLM_ENABLE_V1_MULTIPROCESSING="0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "## batch 1 context 8: 4 steps" in out and "## batch 2 context 8: 4 steps" in out
    for phase in ("engine.step", "scheduler.schedule", "runner.execute_model",
                  "runner._prepare_inputs", "runner.sample_tokens",
                  "output_processor.process_outputs"):
        # one call per step, in both tables
        assert len(re.findall(rf"\s1\.0  {re.escape(phase)}$", out, re.M)) == 2, phase


def test_host_phases_refuses_bad_arguments() -> None:
    from benchmarks.decode import host_phases

    with pytest.raises(SystemExit):
        host_phases.main(["--batches", "0,8"])


def test_startup_trace_times_compiles_and_restores_triton_hooks(tmp_path: Path,
                                                                monkeypatch) -> None:
    from triton import knobs

    from benchmarks.harness import startup_trace

    seen: list[str] = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook",
                        lambda **kw: seen.append(kw["fn"].name))
    fn = SimpleNamespace(name="_my_kernel")
    path = tmp_path / "trace.txt"
    with startup_trace.trace_startup(str(path), "t") as log:
        # What Triton's JITFunction._do_compile calls around one compile.
        assert knobs.runtime.jit_cache_hook(fn=fn, key=1) is False
        sum(range(200_000))
        knobs.runtime.jit_post_compile_hook(fn=fn, key=1)
    assert [n for n, _ in log.compiles] == ["_my_kernel"] and log.compiles[0][1] > 0
    assert seen == ["_my_kernel"]  # the hook that was there still sees every compile
    assert knobs.runtime.jit_cache_hook is None and knobs.runtime.jit_post_compile_hook
    assert knobs.runtime.jit_post_compile_hook(fn=fn) is None and seen[-1] == "_my_kernel"
    text = path.read_text()
    assert "Triton compiles: 1" in text and "_my_kernel" in text and "cumulative" in text


def test_startup_trace_only_when_asked(tmp_path: Path, monkeypatch) -> None:
    from benchmarks.harness import startup_trace

    spec = SimpleNamespace(model="m", mode="plugin_graphs", round=1)
    monkeypatch.delenv("BENCH_STARTUP_PROFILE_DIR", raising=False)
    with startup_trace.maybe_trace_startup(spec) as log:
        assert log is None
    monkeypatch.setenv("BENCH_STARTUP_PROFILE_DIR", str(tmp_path))
    with startup_trace.maybe_trace_startup(spec) as log:
        assert log is not None
    assert (tmp_path / "startup-m-plugin_graphs-r1.txt").is_file()


def test_prefill_profile_needs_every_prompt_of_a_count_in_one_step(monkeypatch) -> None:
    assert profile_prefill.prefill_token_counts("2048,8192", 512, 16) == [2048, 8192]
    with pytest.raises(ValueError, match=r"prefills 16 prompts in one step.*--batches 1,16"):
        profile_prefill.prefill_token_counts("2048,8192", 512, 1)
    # the decode benchmark says so before it starts anything
    from benchmarks.decode import bench as decode

    monkeypatch.setenv("BENCH_PROFILE_PREFILL", "2048")
    args = decode.run_parser().parse_args(["--batches", "1", "--contexts", "512", "--dry-run"])
    with pytest.raises(ValueError, match="caps max_num_seqs at 1"):
        decode.validate_args(args)
    args = decode.run_parser().parse_args(["--batches", "1,4", "--contexts", "512", "--dry-run"])
    decode.validate_args(args)
