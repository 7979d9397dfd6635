"""CPU tests of the decode benchmark's command line (benchmarks/decode/): help, the no-GPU
message, usage errors, the dry-run plan, plugin modes, time-budget deadlines and the plot CLI;
no GPU, no vLLM engine start."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from benchmarks.decode import bench as decode
from benchmarks.harness import machine, sweep
from benchmarks.harness.modes import DEFAULT_MODES, MODES, Family
from benchmarks.harness.shapes import read_config
from tests.benchmarks.harness_util import _cli


def test_help_lists_every_option() -> None:
    out = _cli("--help")
    assert out.returncode == 0, out.stderr
    options = [
        s for a in decode.run_parser()._actions for s in a.option_strings if s.startswith("--")
    ]
    assert len(options) >= 17, options
    for opt in options:
        assert opt in out.stdout, f"{opt} missing from --help"
    assert "merge" in out.stdout
    merge_help = _cli("merge", "--help")
    assert merge_help.returncode == 0, merge_help.stderr
    for a in decode.merge_parser()._actions:
        for opt in a.option_strings:
            assert opt in merge_help.stdout


def test_no_gpu_fails_fast_with_message() -> None:
    t0 = time.monotonic()
    out = _cli(
        "--models",
        "qwen3-0.6b",
        "--results-dir",
        "/nonexistent-should-not-be-made",
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    assert time.monotonic() - t0 < 10
    assert out.returncode == decode.EXIT_NO_GPU
    assert "needs an NVIDIA GPU" in out.stderr
    assert "CUDA_VISIBLE_DEVICES" in out.stderr
    assert not Path("/nonexistent-should-not-be-made").exists()


@pytest.mark.skipif(machine.gpu_problem() is None, reason="this machine has a GPU")
def test_no_gpu_detected_on_this_machine() -> None:
    out = _cli("--models", "qwen3-0.6b")
    assert out.returncode == decode.EXIT_NO_GPU
    assert "no NVIDIA GPU found" in out.stderr


def test_bad_option_is_a_usage_error() -> None:
    out = _cli("--models", "qwen3-70b", "--dry-run")
    assert out.returncode == decode.EXIT_USAGE
    assert "unknown model" in out.stderr


def test_dry_run_plan(tmp_path: Path) -> None:
    out = _cli(
        "--dry-run",
        "--models",
        "qwen3-0.6b,qwen3-30b-a3b",
        "--num-layers",
        "6",
        "--batches",
        "8,1",
        "--contexts",
        "512",
        "--log-dir",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["layers"] == {"qwen3-0.6b": 6, "qwen3-30b-a3b": 6}
    workers = plan["workers"]
    # every mode: the plugin's hook exists, so its modes are planned too
    assert [w["mode"] for w in workers] == list(DEFAULT_MODES) * 2
    assert all(not MODES[m].diagnostic for m in DEFAULT_MODES)
    assert MODES["stock_full_decode_nc_v1"].diagnostic
    lens = {w["llm_kwargs"]["max_model_len"] for w in workers}
    assert len(lens) == 1 and lens.pop() >= 512 + 128 + 4
    for w in workers:
        kw = w["llm_kwargs"]
        assert kw["max_num_seqs"] == 8 and kw["load_format"] == "dummy"
        assert kw["skip_tokenizer_init"] is True and kw["enable_prefix_caching"] is False
        assert kw["gpu_memory_utilization"] == 0.85 and kw["seed"] == 0
        if MODES[w["mode"]].family is Family.STOCK:  # vLLM's own backend, or TRITON_ATTN
            if w["mode"].endswith("_triton"):
                assert kw["attention_config"] == {"backend": "TRITON_ATTN"}
            else:
                assert "attention_config" not in kw
            assert w["env"] == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_PLUGINS": ""}
        else:  # the plugin loads through its entry point and brings its own backend
            assert kw["attention_config"] == {"backend": "CUSTOM"}
            assert w["env"] == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        assert read_config(kw["model"])["num_hidden_layers"] == 6
    by_mode = {w["mode"]: w["llm_kwargs"] for w in workers[:len(DEFAULT_MODES)]}
    assert by_mode["plugin_eager"]["enforce_eager"] is True
    assert by_mode["plugin_graphs"]["additional_config"] == {"moe_graphs": {}}
    assert by_mode["stock_eager"]["enforce_eager"] is True
    assert "compilation_config" not in by_mode["stock_graphs"]
    assert by_mode["stock_full_decode"]["compilation_config"] == {
        "cudagraph_mode": "FULL_DECODE_ONLY"
    }
    assert by_mode["stock_full_decode_nc"]["compilation_config"] == {
        "mode": "NONE",
        "cudagraph_mode": "FULL_DECODE_ONLY",
    }
    assert by_mode["stock_full_decode_nc_triton"]["compilation_config"] == by_mode[
        "stock_full_decode_nc"]["compilation_config"]
    assert "compilation_config" not in by_mode["stock_graphs_triton"]


def test_plugin_modes_come_from_the_plugin_hook() -> None:
    import vllm_moe_graphs

    for name in ("plugin_eager", "plugin_graphs"):
        availability = MODES[name].available()
        assert availability.ok, availability.text()
        kw = MODES[name].llm_kwargs({"attention_config": {"backend": "TRITON_ATTN"}})
        assert kw["attention_config"] == {"backend": "CUSTOM"}
    with pytest.raises(NotImplementedError, match="unknown plugin benchmark mode"):
        vllm_moe_graphs.benchmark_llm_kwargs("plugin_turbo")


def test_time_budget_deadlines() -> None:
    eager, graphs, nc = MODES["stock_eager"], MODES["stock_graphs"], MODES["stock_full_decode_nc"]
    hard, first, soft = sweep.deadlines(0.0, 480.0, eager, [graphs, nc])
    weights = eager.budget_weight() + graphs.budget_weight() + nc.budget_weight()
    assert hard == 480.0
    assert soft == pytest.approx(480.0 * eager.budget_weight() / weights)
    assert first == 480.0 - graphs.startup_estimate_s - nc.startup_estimate_s  # > soft here
    assert eager.budget_weight() > nc.budget_weight()  # eager steps cost ~10x: a bigger share
    # two sampling presets: measuring weighs twice beside the same start-ups; eager (the bigger
    # measuring share) gets more of what is left
    _, _, soft2 = sweep.deadlines(0.0, 480.0, eager, [graphs, nc], presets=2)
    two = [m.budget_weight(2) for m in (eager, graphs, nc)]
    assert eager.budget_weight(2) - eager.budget_weight() == 120.0
    assert soft2 == pytest.approx(480.0 * two[0] / sum(two)) and soft2 > soft
    why = sweep.deadlines(470.0, 480.0, graphs, [])
    assert isinstance(why, str) and why.startswith("time budget: 10 s left")


def test_plot_cli_redraws_an_attention_grid_json(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.harness import plot

    rows = [dict(model=m, batch=b, context=c, ratio=1.0 + b / 100, pct_hbm=50.0 + c / 1000,
                 vllm_pct_hbm=40.0) for m in ("qwen3-0.6b", "qwen3-30b-a3b")
            for b in (1, 8) for c in (512, 2048)]
    src = tmp_path / "grid.json"
    src.write_text(json.dumps({"device": "test", "rows": rows}))
    assert plot.main(["attn", str(src)]) == 0
    png = tmp_path / "grid.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"rows": []}))
    assert plot.main(["decode", str(empty)]) == 1 and not (tmp_path / "empty.png").exists()
