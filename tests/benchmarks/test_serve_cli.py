"""The serving benchmark's command line on CPU: help, the dry-run plan, the no-GPU message, option
errors, the time budget's weights; and one run end to end through real `vllm serve` (the CPU
build) with a tiny checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.harness.machine import gpu_problem
from benchmarks.serving import bench as serve
from benchmarks.serving import options as serve_options
from benchmarks.serving import report as serve_report
from benchmarks.serving.server import OFFLOAD_READY_EXTRA_S, SERVE_MODES
from tests.serve_util import cpu_env


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- CLI ----------------------------------------------------------------------------------------
def _cli(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "benchmarks.serving", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_help_documents_every_option():
    out = _cli("--help").stdout
    for action in serve_options.parser()._actions:
        for flag in action.option_strings:
            assert flag in out
    for name in ("plugin", "stock_triton", "moe_offload", "qwen3-30b-a3b", "merge", "targets"):
        assert name in out
    for mode in SERVE_MODES.values():  # a long name sits on its own line, not run on
        assert f"  {mode.name} " in out or f"  {mode.name}\n" in out, mode.name


def test_dry_run_prints_the_plan_and_whether_it_fits_the_budget(tmp_path):
    common = ("--model", "qwen3-30b-a3b", "--modes", "plugin,stock", "--workloads",
              "chat,moe_offload", "--rates", "chat:4,16", "--rates", "moe_offload:0.5",
              "--duration-s", "8", "--plugin-config", '{"idle_capture": true}',
              "--results-dir", str(tmp_path), "--dry-run")
    small = _cli(*common, "--time-budget-s", "200")
    assert small.returncode == 0, small.stderr
    out = small.stdout
    args = serve_options.parser().parse_args(list(common))
    plan = serve_options.Plan(args)
    costs = {m.name: serve_options.mode_cost_s(plan, m, args) for m in plan.modes}
    for name, cost in costs.items():
        assert f"{name}: ~{cost:.0f} s" in out
    assert f"total ~{sum(costs.values()):.0f} s" in out and "does NOT fit" in out
    assert "server moe_offload" in out and "--cpu-offload-gb 29" in out
    assert "r4 32 requests, r16 128 requests" in out  # max(--min-requests, rate x duration)
    assert out.count("settling its idle capture") == 2  # plugin's two servers, not stock's
    assert not list(tmp_path.iterdir())  # nothing written, no server started
    temp = tmp_path / "tmp"
    temp.mkdir()
    big = _cli(*common, "--time-budget-s", "5000", env={**os.environ, "TMPDIR": str(temp)})
    assert big.returncode == 0 and big.stdout.splitlines()[-1].endswith(": fits")
    assert "logs in a new temporary folder" in big.stdout
    assert not list(temp.iterdir())  # the shape's config folder it planned with is gone


@pytest.mark.skipif(gpu_problem() is None, reason="this machine has a GPU")
def test_without_gpu_fails_fast_with_the_reason(tmp_path):
    proc = _cli("--results-dir", str(tmp_path))
    assert proc.returncode == serve.EXIT_NO_GPU
    assert "needs an NVIDIA GPU" in proc.stderr and "--allow-cpu" in proc.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("args,msg", [
    (["--rates", "chat:0"], "positive rates"),
    (["--modes", "stock,turbo"], "unknown mode(s) turbo"),
    (["--workloads", "moe_offload"], "needs a MoE model"),
    (["--model", "/nonexistent"], "neither a shape"),
    (["--rates", "long:1", "--workloads", "chat"], "'long', which is not run"),
    (["--lengths", "chat:10-5:1-2"], "PMIN-PMAX"),
    (["--plugin-config", '{"warmup_steps": -1}'], "warmup_steps"),
    (["--plugin-config", "skip_moe_padding"], "JSON object of moe_graphs settings"),
])
def test_bad_options_name_the_value(args, msg):
    proc = _cli(*args)
    assert proc.returncode == serve.EXIT_USAGE and msg in proc.stderr, proc.stderr


# -- end to end ---------------------------------------------------------------------------------
@pytest.mark.e2e
def test_serve_benchmark_end_to_end_on_cpu_vllm(tiny_qwen3, cpu_vllm, tmp_path):
    """Two modes through real `vllm serve` (CPU build, eager): every request completes, the
    plugin's server registered the plugin and the stock one did not, ratios and saturation are
    computed, and the same requests went to both modes."""
    proc = _cli("--model", tiny_qwen3, "--modes", "plugin,stock", "--workloads",
                "chat,chat_sampled", "--rates", "chat:1,2", "--rates", "chat_sampled:2",
                "--lengths", "chat:16-48:4-6", "--lengths", "chat_sampled:16-48:4-6",
                "--duration-s", "2",
                "--min-requests", "3", "--warmup-s", "1", "--clients", "2", "--allow-cpu",
                "--server-arg=--enforce-eager", "--name", "e2e", "--results-dir",
                str(tmp_path), "--log-dir", str(tmp_path / "logs"), "--no-plot",
                env=cpu_env(cpu_vllm), timeout=300)  # two CPU servers start: 40-60 s each
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "e2e.json").read_text())
    serve_report.check_schema(doc)
    assert len(doc["rows"]) == 6 and not doc["skipped"]
    for row in doc["rows"]:
        assert row["failed"] == 0 and row["completed"] == row["requests"] >= 3, row
        assert 0 < row["ttft_ms"]["p50"] <= row["e2e_ms"]["p50"]
        assert row["output_tokens"] >= 4 * row["completed"]
        assert row["steps"]["engine_steps"] > 0
    by_mode = {(r["mode"], r["rate"]): r for r in doc["rows"] if r["workload"] == "chat"}
    assert by_mode[("plugin", 2)]["output_tokens"] == by_mode[("stock", 2)]["output_tokens"]
    assert "replays" in by_mode[("plugin", 1)]["steps"]
    assert "replays" not in by_mode[("stock", 1)]["steps"]
    assert doc["modes"]["plugin"]["servers"]["default"]["plugin"]
    for mode in ("plugin", "stock"):  # the same warm-up in every mode, at every measured rate
        warmups = doc["modes"][mode]["servers"]["default"]["warmup"]["chat"]
        assert [w["rate"] for w in warmups] == [1, 2] and not any(w["failed"] for w in warmups)
    assert doc["modes"]["stock"]["servers"]["default"]["plugin"] is None
    assert "ttft_p50_stock_over_plugin/tiny/chat/r2" in doc["ratios"] or any(
        k.startswith("ttft_p50_stock_over_plugin/") for k in doc["ratios"])
    assert set(doc["saturation"]) == {"plugin/chat", "stock/chat", "plugin/chat_sampled",
                                      "stock/chat_sampled"}
    assert doc["workloads"]["chat_sampled"]["sampling"]["top_k"] == 20
    assert "ratios (stock time / plugin time" in proc.stdout


def test_time_budget_weights_modes_by_their_cost(tmp_path):
    args = serve_options.parser().parse_args(["--model", "qwen3-30b-a3b", "--rates", "chat:4,8",
                                      "--rates", "long:1", "--rates", "moe_offload:2",
                                      "--log-dir", str(tmp_path)])
    plan = serve_options.Plan(args)
    plugin, stock = (serve_options.mode_cost_s(plan, SERVE_MODES[m], args)
                     for m in ("plugin", "stock"))
    # warm-ups at every measured rate by default: chat at 4 and 8, long at 1, moe_offload at 2
    windows = 4 * (args.warmup_s + 8) + sum(serve_options.window_s(args, r) for r in (4, 8, 1, 2))
    # two plugin servers, each settling its idle capture after ready (30 s by estimate)
    assert plugin == pytest.approx(2 * (60 + 30) + OFFLOAD_READY_EXTRA_S + windows)
    assert stock - plugin == pytest.approx(2 * 10)
    args.warmup_rates = "max"  # one warm-up per workload, at its highest rate
    assert serve_options.mode_cost_s(plan, SERVE_MODES["plugin"], args) == pytest.approx(
        plugin - (args.warmup_s + 8))
    assert serve_options.warmup_rates(args, [8, 2, 4]) == [8]
    args.warmup_rates = "all"
    assert serve_options.warmup_rates(args, [8, 2, 4, 2]) == [2, 4, 8]


@pytest.mark.parametrize("model,kv8,unproven", [
    ("qwen3-30b-a3b-fp8", False, "fp8"),
    ("qwen3-8b-fp8-kv8", True, "fp8,fp8_kv"),
])
def test_fp8_shapes_serve_every_mode_on_the_same_flags(tmp_path, model, kv8, unproven):
    """An FP8 shape: the shipped config with Qwen's block FP8 quantization_config (LM head and
    router gates in bf16), the FP8 KV cache flag for every mode, and the plugin's modes taking
    the FP8 formats no GPU proof has lifted yet over (MOE_GRAPHS_UNPROVEN); stock as it is."""
    args = serve_options.parser().parse_args(["--model", model, "--workloads", "chat",
                                              "--log-dir", str(tmp_path)])
    plan = serve_options.Plan(args)
    cfg = json.loads((plan.model_dir / "config.json").read_text())
    q = cfg["quantization_config"]
    assert (q["quant_method"], q["weight_block_size"]) == ("fp8", [128, 128])
    gates = [m for m in q["modules_to_not_convert"] if m.endswith(".mlp.gate")]
    assert "lm_head" in q["modules_to_not_convert"]
    assert len(gates) == (48 if "30b" in model else 0) and plan.layers == cfg["num_hidden_layers"]
    assert plan.workloads[0][1] == serve_options.DEFAULT_RATES[model.split("-fp8")[0]]["chat"]
    for mode in ("plugin", "stock"):
        sargs = plan.server_args(SERVE_MODES[mode], "default", [], 0.0)
        flag = sargs[sargs.index("--kv-cache-dtype") + 1] if "--kv-cache-dtype" in sargs else None
        assert flag == ("fp8" if kv8 else None), (mode, sargs)
    assert plan.server_env(SERVE_MODES["plugin"]) == {"MOE_GRAPHS_UNPROVEN": unproven}
    assert plan.server_env(SERVE_MODES["stock"]) == {"VLLM_PLUGINS": ""}
    with pytest.raises(ValueError, match="'qwen3-0.6b-fp8' is neither a shape .*qwen3-8b-fp8"):
        serve_options.Plan(serve_options.parser().parse_args(
            ["--model", "qwen3-0.6b-fp8", "--log-dir", str(tmp_path)]))
