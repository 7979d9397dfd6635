"""CPU tests of the decode benchmark harness (benchmarks/): no GPU, no vLLM engine start."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.decode import bench as decode
from benchmarks.decode import report
from benchmarks.harness import decode_points
from benchmarks.harness import machine, stats, sweep, vllm_facts, worker_process
from benchmarks.harness.modes import DEFAULT_MODES, MODES, AbsentReason, Family
from benchmarks.harness.protocol import PointResult, WorkerResult, WorkerSpec
from benchmarks.harness.shapes import (
    ModelShape,
    decode_step_bytes,
    floor_ms,
    prepare_config_dir,
    read_config,
    resident_weight_bytes,
    shipped_config_dir,
)

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.decode", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def _shape(name: str) -> ModelShape:
    return ModelShape.from_config(read_config(shipped_config_dir(name)))


# --- CLI ------------------------------------------------------------------------------------


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
    weights = eager.budget_weight + graphs.budget_weight + nc.budget_weight
    assert hard == 480.0
    assert soft == pytest.approx(480.0 * eager.budget_weight / weights)
    assert first == 480.0 - graphs.startup_estimate_s - nc.startup_estimate_s  # > soft here
    assert eager.budget_weight > nc.budget_weight  # eager steps cost ~10x: a bigger share
    why = sweep.deadlines(470.0, 480.0, graphs, [])
    assert isinstance(why, str) and why.startswith("time budget: 10 s left")


# --- floor byte model -----------------------------------------------------------------------


def test_floor_bytes_qwen3_0_6b() -> None:
    # Hand check, b1 c512. Per layer: q 1024*2048 + k,v 2*1024*1024 + o 2048*1024 = 6,291,456;
    # norms 2*128 + 2*1024 = 2,304; MLP 3*1024*3072 = 9,437,184 -> 15,730,944 * 28 layers
    # = 440,466,432; + final norm 1,024 + LM head 151,936*1,024 = 155,582,464 + 1 embedding row
    # 1,024 = 596,050,944 params * 2 bytes = 1,192,101,888. KV: 28*2*8*128*2 = 114,688 B/token
    # * 512 = 58,720,256.
    step = decode_step_bytes(_shape("qwen3-0.6b"), 1, 512)
    assert step.weights == 1_192_101_888
    assert step.kv == 58_720_256
    assert step.total == 1_250_822_144
    assert step.experts_touched == 0
    assert decode_step_bytes(_shape("qwen3-0.6b"), 64, 4096).kv == 64 * 4096 * 114_688


def test_floor_bytes_qwen3_8b() -> None:
    shape = _shape("qwen3-8b")
    assert shape.kv_bytes_per_token() == 36 * 2 * 8 * 128 * 2
    per_layer = 4096 * 4096 * 2 + 2 * 4096 * 1024 + 2 * 128 + 2 * 4096 + 3 * 4096 * 12288
    params = 36 * per_layer + 4096 + 151936 * 4096 + 4096
    assert decode_step_bytes(shape, 1, 0).weights == 2 * params == 15_136_819_200


def test_floor_bytes_qwen3_30b_a3b_counts_touchable_experts() -> None:
    shape = _shape("qwen3-30b-a3b")
    # b1: top-8 of 128 experts. Per layer: attention 18,874,368 + norms 4,352 + router 262,144
    # + 8 experts * 3*2048*768 = 37,748,736 -> 56,889,600 * 48 = 2,730,700,800; + 2,048 + LM head
    # 311,164,928 + 2,048 = 3,041,869,824 params (the "A3B") -> 6,083,739,648 bytes.
    b1 = decode_step_bytes(shape, 1, 512)
    assert b1.experts_touched == 8
    assert b1.weights == 6_083_739_648
    assert b1.kv == 512 * 48 * 2 * 4 * 128 * 2
    expert = 3 * 2048 * 768 * 2 * 48  # bytes of one expert slot over all layers
    b8 = decode_step_bytes(shape, 8, 512)
    assert b8.experts_touched == 64
    assert b8.weights - b1.weights == 56 * expert + 7 * 2048 * 2
    b32, b64 = decode_step_bytes(shape, 32, 512), decode_step_bytes(shape, 64, 512)
    assert b32.experts_touched == b64.experts_touched == 128  # saturated: every expert is read
    assert b64.weights - b32.weights == 32 * 2048 * 2  # only embedding rows differ


def test_interleave_refuses_engines_the_gpu_cannot_hold() -> None:
    """Qwen3-30B-A3B holds 30.5B parameters (every expert, embedding and LM head apart): two
    engines fit a 140 GiB H200 under --interleave, three do not, and an 80 GiB H100 holds one;
    the refusal quotes the sizes and names the fix."""
    shape = _shape("qwen3-30b-a3b")
    per_layer = 18_874_368 + 4_352 + 262_144 + 128 * 3 * 2048 * 768
    assert resident_weight_bytes(shape) == 2 * (per_layer * 48 + 2048 + 2 * 151_936 * 2048)
    kv, h200, h100 = 15 * 2**29, 143_771 * 2**20, 81_559 * 2**20
    assert sweep.interleave_overflow("qwen3-30b-a3b", shape, kv, 2, h200) is None
    why = sweep.interleave_overflow("qwen3-30b-a3b", shape, kv, 3, h200)
    assert why is not None and "3 engines of qwen3-30b-a3b" in why and "at most 2 mode" in why
    assert "weights 56.9" in why and "--num-layers" in why
    assert "at most 1 mode" in (sweep.interleave_overflow("qwen3-30b-a3b", shape, kv, 2, h100)
                                or "")
    assert sweep.interleave_overflow("qwen3-0.6b", _shape("qwen3-0.6b"), kv, 6, h100) is None


def test_gpu_memory_read_from_nvidia_smi(tmp_path: Path, monkeypatch) -> None:
    """The interleave check's GPU size comes from nvidia-smi's MiB; a failing or absent
    nvidia-smi gives None (the check is then skipped), never an exception."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\n[ "$1" = "-L" ] && exit 1\necho 143771\necho 143771\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert machine.gpu_memory_bytes() == 143_771 * 2**20
    assert machine.nvidia_smi("-L") is None
    smi.write_text("#!/bin/sh\necho 'not a number'\n")
    assert machine.gpu_memory_bytes() is None
    monkeypatch.setenv("PATH", str(tmp_path / "absent"))
    assert machine.gpu_memory_bytes() is None


def test_floor_ms_and_layer_override(tmp_path: Path) -> None:
    assert floor_ms(4_300_000_000, 4300.0) == pytest.approx(1.0)
    assert floor_ms(1, None) is None
    config_dir, layers = prepare_config_dir("qwen3-30b-a3b", 12, tmp_path)
    assert layers == 12 and read_config(config_dir)["num_hidden_layers"] == 12
    full, cut = _shape("qwen3-30b-a3b"), ModelShape.from_config(read_config(config_dir))
    assert cut.num_layers == 12 and full.num_layers == 48
    assert decode_step_bytes(cut, 1, 100).kv * 4 == decode_step_bytes(full, 1, 100).kv
    with pytest.raises(ValueError, match="expected 1..48"):
        prepare_config_dir("qwen3-30b-a3b", 49, tmp_path)
    assert prepare_config_dir("qwen3-8b", None, tmp_path) == (shipped_config_dir("qwen3-8b"), 36)


# --- rows, ratios, merge ----------------------------------------------------------------------


def _row(model: str, batch: int, context: int, mode: str, p50: float) -> dict:
    return {
        "model": model,
        "batch": batch,
        "context": context,
        "mode": mode,
        "tpot_ms_p50": p50,
        "tpot_ms_p10": p50 * 0.9,
        "tpot_ms_p90": p50 * 1.1,
        "startup_s": 10.0,
        "capture_s": 2.0,
        "graph_mem_mib": 100.0,
        "floor_ms": 0.5,
        "pct_of_floor": round(50 / p50, 2),
        "num_layers": 28,
        "noisy": False,
    }


def test_ratio_keys_and_values() -> None:
    rows = [
        _row("qwen3-0.6b", 1, 512, m, v)
        for m, v in (
            ("stock_eager", 30.0),
            ("stock_graphs", 2.5),
            ("stock_full_decode", 2.4),
            ("stock_full_decode_nc", 2.0),
        )
    ]
    rows.append(_row("qwen3-0.6b", 8, 4096, "stock_eager", 28.0))  # nothing to compare with
    ratios = report.compute_ratios(rows)
    at = "/qwen3-0.6b/b1/c512"
    assert ratios == {
        # every stock mode over the best stock graph mode (stock_full_decode_nc here)
        f"tpot_stock_eager_over_stock_full_decode_nc{at}": 15.0,
        f"tpot_stock_graphs_over_stock_full_decode_nc{at}": 1.25,
        f"tpot_stock_full_decode_over_stock_full_decode_nc{at}": 1.2,
        # eager over each graph mode
        f"tpot_stock_eager_over_stock_graphs{at}": 12.0,
        f"tpot_stock_eager_over_stock_full_decode{at}": 12.5,
    }
    key_re = re.compile(
        r"^tpot_([a-z_]+)_over_([a-z_]+)/(qwen3-0\.6b|qwen3-8b|qwen3-30b-a3b)/b\d+/c\d+$"
    )
    assert all(key_re.match(k) for k in ratios)


def test_ratios_with_plugin_rows() -> None:
    rows = [
        _row("qwen3-30b-a3b", 32, 4096, m, v)
        for m, v in (
            ("stock_eager", 40.0),
            ("stock_graphs", 8.0),
            ("plugin_eager", 41.0),
            ("plugin_graphs", 5.0),
        )
    ]
    ratios = report.compute_ratios(rows)
    at = "/qwen3-30b-a3b/b32/c4096"
    assert ratios[f"tpot_stock_eager_over_stock_graphs{at}"] == 5.0
    assert ratios[f"tpot_stock_graphs_over_plugin_graphs{at}"] == 1.6
    assert ratios[f"tpot_stock_eager_over_plugin_graphs{at}"] == 8.0
    assert ratios[f"tpot_plugin_eager_over_plugin_graphs{at}"] == 8.2
    assert ratios[f"tpot_plugin_eager_over_stock_graphs{at}"] == 5.125
    assert len(ratios) == 5
    # an option measured beside the defaults: stock over it, the defaults over it
    rows.append(_row("qwen3-30b-a3b", 32, 4096, "plugin_graphs_fused_router", 4.0))
    ratios = report.compute_ratios(rows)
    assert ratios[f"tpot_stock_graphs_over_plugin_graphs_fused_router{at}"] == 2.0
    assert ratios[f"tpot_plugin_graphs_over_plugin_graphs_fused_router{at}"] == 1.25
    assert ratios[f"tpot_plugin_eager_over_plugin_graphs_fused_router{at}"] == 10.25
    assert len(ratios) == 9


def test_repeat_summary_pairs_repeats() -> None:
    def rep(mode: str, reps: list[float], batch: int = 8) -> dict:
        return {**_row("qwen3-0.6b", batch, 512, mode, statistics.median(reps)),
                "repeat_p50_ms": reps}

    # Repeat 2 ran on a slow host for everyone: pairing cancels it.
    rows = [rep("stock_graphs", [1.6, 3.2, 1.7]), rep("stock_full_decode", [1.5, 3.1, 1.8]),
            rep("plugin_graphs", [1.25, 2.5, 1.5]), rep("stock_eager", [20.0, 21.0, 22.0]),
            rep("plugin_graphs", [1.0], batch=1), rep("stock_graphs", [1.1], batch=1)]
    doc = report.assemble("t", {}, rows, {}, [], [])
    (s,) = report.repeat_summary(doc)  # batch 1 has one repeat: left out
    assert s["batch"] == 8 and s["repeats"] == 3 and s["best_stock"] == "stock_graphs"
    assert s["median_ms"] == {"stock_graphs": 1.7, "stock_full_decode": 1.8,
                              "plugin_graphs": 1.5, "stock_eager": 21.0}
    assert s["best_stock_over_plugin"] == round(1.7 / 1.5, 4)
    # per repeat: min(1.6, 1.5)/1.25 = 1.2, min(3.2, 3.1)/2.5 = 1.24, min(1.7, 1.8)/1.5 = 1.1333
    assert s["paired_ratio_median"] == 1.2
    assert (s["paired_ratio_min"], s["paired_ratio_max"]) == (1.1333, 1.24)
    text = report.format_repeat_summary(doc)
    assert "qwen3-0.6b b8 c512 (3 repeats)" in text and "paired per repeat x1.20" in text
    assert report.format_repeat_summary(report.assemble("t", {}, rows[4:], {}, [], [])) == ""


def test_percentile_and_build_rows() -> None:
    assert stats.percentile([1, 2, 3, 4, 5], 50) == 3
    assert stats.percentile([1, 2, 3, 4], 10) == pytest.approx(1.3)
    with pytest.raises(ValueError):
        stats.percentile([], 50)
    steps = [float(v) for v in range(1, 101)]
    result = WorkerResult(
        model="qwen3-0.6b",
        mode="stock_graphs",
        status="ok",
        startup_s=66.0,
        capture_s=5.5,
        graph_mem_mib=300.0,
        resolved={"cudagraph_mode": "FULL_AND_PIECEWISE"},
        points=[
            PointResult(1, 512, step_ms=steps, repeat_p50_ms=[50.5], repeats_done=1),
            PointResult(8, 512, error="boom"),
        ],
    )
    (row,) = report.build_rows(result, _shape("qwen3-0.6b"), bandwidth_gbps=4300.0)
    assert (row.tpot_ms_p10, row.tpot_ms_p50, row.tpot_ms_p90) == (10.9, 50.5, 90.1)
    assert row.floor_bytes == 1_250_822_144
    assert row.floor_ms == pytest.approx(1_250_822_144 / 4.3e12 * 1e3, abs=1e-4)
    assert row.pct_of_floor == pytest.approx(100 * row.floor_ms / 50.5, abs=0.01)
    assert row.noisy and row.steps == 100 and row.cudagraph_mode == "FULL_AND_PIECEWISE"


def test_merge_recomputes_everything(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_rows = [
        _row("qwen3-0.6b", 1, 512, "stock_eager", 30.0),
        _row("qwen3-0.6b", 1, 512, "stock_graphs", 2.5),
    ]
    b_rows = [
        _row("qwen3-0.6b", 1, 512, "stock_graphs", 3.0),  # re-measured: B wins
        _row("qwen3-8b", 1, 512, "stock_full_decode_nc", 4.0),
        _row("qwen3-8b", 1, 512, "stock_eager", 32.0),
    ]
    env_a = {"gpu_name": "NVIDIA H200", "layers": {"qwen3-0.6b": 28}, "vllm": "0.26.0"}
    env_b = {"gpu_name": "NVIDIA H200", "layers": {"qwen3-8b": 36}, "vllm": "0.26.0"}
    absent = {"plugin_graphs": "not implemented yet"}
    doc_a = report.assemble("a", env_a, a_rows, absent, [], [])
    doc_b = report.assemble(
        "b",
        env_b,
        b_rows,
        absent,
        [{"model": "qwen3-8b", "mode": "stock_graphs", "error": "OOM"}],
        [],
    )
    pa, pb = report.write(doc_a, tmp_path), report.write(doc_b, tmp_path)
    rc = decode.main(
        ["merge", str(pa), str(pb), "--name", "ab", "--results-dir", str(tmp_path), "--no-plot"]
    )
    assert rc == 0
    merged = json.loads((tmp_path / "ab.json").read_text())
    assert merged["name"] == "ab" and len(merged["rows"]) == 4
    assert merged["env"]["layers"] == {"qwen3-0.6b": 28, "qwen3-8b": 36}
    assert merged["env"]["gpu_name"] == "NVIDIA H200" and merged["env"]["merged_from"] == [
        str(pa),
        str(pb),
    ]
    assert merged["absent"] == absent
    assert merged["ratios"] == {
        "tpot_stock_eager_over_stock_graphs/qwen3-0.6b/b1/c512": 10.0,
        "tpot_stock_eager_over_stock_full_decode_nc/qwen3-8b/b1/c512": 8.0,
    }
    assert merged["failures"][0]["error"] == "OOM"
    out = capsys.readouterr().out.rstrip().splitlines()
    assert any(line.startswith("qwen3-8b") and "stock_full_decode_nc" in line for line in out)
    assert out[-1].startswith("failed  qwen3-8b stock_graphs")  # the table comes last
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert (
        decode.main(["merge", str(bad), "--name", "x", "--results-dir", str(tmp_path)])
        == decode.EXIT_USAGE
    )


# --- worker pieces --------------------------------------------------------------------------


def test_log_tap_reads_vllm_capture_record() -> None:
    tap = vllm_facts.VllmLogTap()
    logger = logging.getLogger("vllm.test_benchmark_harness")
    logger.addHandler(tap)
    logger.setLevel(logging.INFO)
    try:
        logger.info(vllm_facts.CAPTURE_MSG, 7.6, 0.3125)
        logger.info(vllm_facts.INIT_MSG_PREFIX + " %.2f s", 61.25)
    finally:
        logger.removeHandler(tap)
    assert tap.capture_s == 7.6 and tap.graph_mem_gib == 0.3125 and tap.captures == 1
    assert tap.init_engine_s == 61.25


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_capture_message_is_vllms_own() -> None:
    root = Path(importlib.util.find_spec("vllm").origin).parent  # no import of vLLM
    for rel in ("v1/worker/gpu_model_runner.py", "v1/worker/gpu/model_runner.py"):
        assert f'"{vllm_facts.CAPTURE_MSG}"' in (root / rel).read_text(), rel
    assert vllm_facts.INIT_MSG_PREFIX in (root / "v1/engine/core.py").read_text()


class _Engine:
    """Stand-in for LLMEngine's add_request/step/has_unfinished_requests/abort_request with
    chunked prefill (decodes first, then prefill chunks within the token budget). With `lag`, a
    step returns the previous batch's outputs, as async scheduling (batch queue of 2) does."""

    def __init__(self, budget: int, lag: bool) -> None:
        self.budget, self.lag, self.reqs, self.held = budget, lag, {}, []
        self.prefill_sleep_s = 0.05

    def add_request(self, rid: str, prompt: dict, params: SimpleNamespace) -> str:
        self.reqs[rid] = {
            "left": len(prompt["prompt_token_ids"]),
            "out": 0,
            "max": params.max_tokens,
        }
        return rid + "-x"

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs or self.held)

    def abort_request(self, ids: list[str]) -> None:
        for rid in ids:
            self.reqs.pop(rid, None)

    def step(self) -> list[SimpleNamespace]:
        if not self.lag:
            return self._schedule()
        out, self.held = self.held, (self._schedule() if self.reqs else [])
        return out

    def _schedule(self) -> list[SimpleNamespace]:
        budget, new = self.budget, {}
        for rid, r in self.reqs.items():
            if r["left"] == 0:
                new[rid], budget = 1, budget - 1
        for rid, r in self.reqs.items():
            if r["left"] and budget > 0:
                take = min(r["left"], budget)
                r["left"], budget = r["left"] - take, budget - take
                if r["left"] == 0:
                    new[rid] = 1
                time.sleep(self.prefill_sleep_s)  # prefill is slow: it must never be timed
        outs = []
        for rid, n in new.items():
            self.reqs[rid]["out"] += n
            done = self.reqs[rid]["out"] >= self.reqs[rid]["max"]
            outs.append(
                SimpleNamespace(
                    request_id=rid, finished=done, outputs=[SimpleNamespace(token_ids=[0] * n)]
                )
            )
            if done:
                del self.reqs[rid]
        return outs


@pytest.mark.parametrize("lag", [False, True], ids=["sync", "async-scheduling"])
def test_run_point_times_decode_only_steps(lag: bool) -> None:
    engine = _Engine(budget=1000, lag=lag)
    llm = SimpleNamespace(llm_engine=engine, _preprocess_cmpl=lambda prompts: prompts)
    spec = WorkerSpec(
        model="m",
        config_dir="",
        mode="stock_eager",
        llm_kwargs={},
        env={},
        batches=[4],
        contexts=[600],
        repeats=1,
        decode_tokens=20,
        warmup_steps=0,
        vocab_size=100,
        seed=0,
        result_path="",
    )
    resolved = {
        "max_num_batched_tokens": 1000,
        "max_model_len": 700,
        "num_gpu_blocks": 200,
        "block_size": 16,
    }
    calls = []
    real_step = engine.step

    def step() -> list[SimpleNamespace]:
        outs = real_step()
        calls.append({o.request_id: len(o.outputs[0].token_ids) for o in outs})
        return outs

    engine.step = step
    steps, prefill_s = decode_points.run_point(
        llm,
        spec,
        4,
        600,
        "t",
        random.Random(0),
        resolved,
        make_params=lambda n: SimpleNamespace(max_tokens=n),
        make_prompt=lambda ids: {"prompt_token_ids": ids},
    )
    assert len(steps) == 20 and all(s >= 0 for s in steps)
    assert max(steps) < 25, steps  # no step that scheduled a prefill chunk (50 ms) was timed
    assert prefill_s >= 0.1
    assert not engine.has_unfinished_requests()
    first_full = next(i for i, c in enumerate(calls) if len(c) == 4)
    assert first_full >= 2 + lag  # 2400 prompt tokens in chunks of <= 1000: mixed steps first
    resolved["num_gpu_blocks"] = 10  # 160 tokens of KV cannot hold 4 x 600
    with pytest.raises(RuntimeError, match="KV cache holds 160 tokens"):
        decode_points.run_point(
            llm,
            spec,
            4,
            600,
            "u",
            random.Random(0),
            resolved,
            make_params=lambda n: SimpleNamespace(max_tokens=n),
            make_prompt=lambda ids: {"prompt_token_ids": ids},
        )


def test_decode_intervals_and_spec_order() -> None:
    intervals = decode_points.decode_intervals([[0.0, 0.001, 0.003], [], [1.0, 1.002]])
    assert intervals == pytest.approx([1.0, 2.0, 2.0])
    spec = WorkerSpec(
        model="m",
        config_dir="",
        mode="x",
        llm_kwargs={},
        env={},
        batches=[1, 8, 32, 64],
        contexts=[512, 4096],
        repeats=1,
        decode_tokens=1,
        warmup_steps=0,
        vocab_size=1,
        seed=0,
        result_path="",
    )
    assert spec.points()[:3] == [(1, 512), (1, 4096), (8, 512)] and spec.points()[-1] == (64, 4096)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_stock_kwargs_accepted_by_vllm_engine_args(tmp_path: Path) -> None:
    """The slowest test here (~10 s: a subprocess imports vLLM, with VLLM_PLUGINS= so no plugin
    loads): vLLM 0.26 accepts every kwarg and config key of every stock mode, and our check
    rejects a misspelt compilation_config key."""
    stock = [m for m, mode in MODES.items() if mode.family is Family.STOCK]  # diagnostic too
    args = decode.run_parser().parse_args(
        ["--models", "qwen3-0.6b", "--modes", ",".join(stock), "--dry-run"])
    specs, _, _, _ = sweep.plan(args, tmp_path)
    assert [s.mode for s in specs] == stock
    bad = dataclasses.replace(
        specs[0],
        mode="misspelt",
        llm_kwargs={**specs[0].llm_kwargs, "compilation_config": {"cuda_graph_mode": "FULL"}},
    )
    paths = []
    for i, spec in enumerate([*specs, bad]):
        paths.append(tmp_path / f"spec{i}.json")
        paths[-1].write_text(json.dumps(dataclasses.asdict(spec)))
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.harness.mode_worker", "--validate", *map(str, paths)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **specs[0].env},
    )
    assert out.returncode == 1, out.stderr[-2000:]
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert [x["mode"] for x in lines] == [s.mode for s in specs] + ["misspelt"]
    for checked in lines[:-1]:
        backend = "TRITON_ATTN" if checked["mode"].endswith("_triton") else "None"
        assert checked["attention_backend"] == backend and checked["load_format"] == "dummy"
        assert checked["enable_prefix_caching"] is False and checked["max_num_seqs"] == 64
    by_mode = {x["mode"]: x for x in lines}
    assert by_mode["stock_eager"]["enforce_eager"] is True
    assert by_mode["stock_full_decode"]["cudagraph_mode"] == "FULL_DECODE_ONLY"
    assert by_mode["stock_full_decode_nc"]["compilation_mode"] == "NONE"
    v1 = by_mode["stock_full_decode_nc_v1"]
    assert (v1["compilation_mode"], v1["cudagraph_mode"]) == ("NONE", "FULL_DECODE_ONLY")
    assert "compilation_config.cuda_graph_mode" in lines[-1]["error"]


def test_plugin_counters_read_the_plugins_metrics() -> None:
    """The mode worker's summary of the plugin's own counters (replays, fallbacks, pool), read
    back through the real metrics transport in a fresh interpreter."""
    code = """
import json
from vllm_moe_graphs import metrics_transport
from vllm_moe_graphs.capability import Reason
from vllm_moe_graphs.metrics import Mode, recorder
metrics_transport.setup_root()
rec = recorder(0)
rec.set_mode(Mode.GRAPHS)
rec.replay(5); rec.fallback(Reason.MIXED_BATCH, 2); rec.capture(0.25)
from vllm_moe_graphs.graphs.kinds import StepKind
rec.set_memory({StepKind.DECODE: 3 * 2**20}, 1024)
from benchmarks.harness.mode_worker import plugin_counters
print(json.dumps(plugin_counters()))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120,
                         env={k: v for k, v in os.environ.items() if not k.startswith("MOE_")})
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["mode"] == "graphs" and got["replays"] == 5 and got["captures"] == 1
    assert got["fallbacks"] == {"mixed_batch": 2} and got["pool_bytes"] == 3 * 2**20
    assert got["capture_seconds"] == pytest.approx(0.25) and got["scratch_bytes"] == 1024


def test_rounds_alternate_mode_order_and_keep_files_apart(tmp_path: Path) -> None:
    out = _cli("--dry-run", "--models", "qwen3-0.6b", "--modes",
               "stock_full_decode_nc,plugin_graphs,stock_graphs", "--rounds", "3",
               "--num-layers", "2", "--log-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    workers = json.loads(out.stdout)["workers"]
    order = ["stock_full_decode_nc", "plugin_graphs", "stock_graphs"]
    assert [w["mode"] for w in workers] == order + order[::-1] + order
    assert [w["round"] for w in workers] == [0] * 3 + [1] * 3 + [2] * 3
    paths = [w["result_path"] for w in workers]
    assert len(set(paths)) == 9
    assert paths[0].endswith("result-qwen3-0.6b-stock_full_decode_nc.json")
    assert paths[5].endswith("result-qwen3-0.6b-stock_full_decode_nc-r1.json")
    bad = _cli("--dry-run", "--rounds", "0")
    assert bad.returncode == 2 and "--rounds must be >= 1, got 0" in bad.stderr


def test_merge_rounds_pools_steps_and_keeps_the_first_engine() -> None:
    from benchmarks.harness.protocol import merge_rounds

    def result(mode: str, startup: float, steps: list[float], rnd_error: str | None = None):
        pts = [PointResult(1, 512, step_ms=list(steps), repeat_p50_ms=[steps[0]],
                           prefill_s=[0.1], repeats_done=1)]
        if rnd_error:
            pts.append(PointResult(8, 512, error=rnd_error))
        return WorkerResult(model="qwen3-0.6b", mode=mode, status="ok", startup_s=startup,
                            points=pts)

    first = result("plugin_graphs", 30.0, [1.7, 1.6])
    merged = merge_rounds([first, result("stock_graphs", 46.0, [1.5]),
                           result("stock_graphs", 44.0, [2.0]),
                           result("plugin_graphs", 6.0, [1.4, 1.3], rnd_error="boom")])
    assert [(r.mode, r.startup_s) for r in merged] == [("plugin_graphs", 30.0),
                                                        ("stock_graphs", 46.0)]
    plugin = merged[0]
    p1 = plugin.point(1, 512)
    assert p1.step_ms == [1.7, 1.6, 1.4, 1.3] and p1.repeat_p50_ms == [1.7, 1.4]
    assert p1.repeats_done == 2 and p1.prefill_s == [0.1, 0.1]
    assert plugin.point(8, 512).error == "boom"  # no round measured it
    assert first.points[0].step_ms == [1.7, 1.6], "the inputs are not changed"
    failed = WorkerResult(model="qwen3-0.6b", mode="stock_eager", status="failed", error="oom")
    (late,) = merge_rounds([failed, result("stock_eager", 7.0, [20.0])])
    assert late.status == "ok" and late.startup_s == 7.0, "engine facts of the round that ran"
    (row,) = report.build_rows(merged[1], _shape("qwen3-0.6b"), None)
    assert row.repeats == 2 and row.repeat_p50_ms == [1.5, 2.0] and row.steps == 2


# --- interleaved runs -----------------------------------------------------------------------


def test_interleave_plan_fixed_kv_cache_and_no_rounds(tmp_path: Path) -> None:
    out = _cli("--dry-run", "--models", "qwen3-0.6b", "--modes", "stock_full_decode,plugin_graphs",
               "--batches", "1,64", "--contexts", "512", "--interleave", "--log-dir",
               str(tmp_path))
    assert out.returncode == 0, out.stderr
    workers = json.loads(out.stdout)["workers"]
    assert [w["interleaved"] for w in workers] == [True, True]
    kw = workers[0]["llm_kwargs"]
    assert kw["gpu_memory_utilization"] == sweep.INTERLEAVE_GPU_MEMORY_UTILIZATION
    # 28 layers x 8 kv heads x 128 x 2 (K, V) x 2 bytes = 114688 B/token, 64 x max_model_len
    need = 114688 * 64 * kw["max_model_len"] * sweep.KV_HEADROOM
    assert need <= kw["kv_cache_memory_bytes"] < need + 256 * 2**20
    assert kw["kv_cache_memory_bytes"] % (256 * 2**20) == 0
    plain = json.loads(_cli("--dry-run", "--models", "qwen3-0.6b", "--modes", "plugin_graphs",
                            "--log-dir", str(tmp_path)).stdout)["workers"][0]
    assert not plain["interleaved"] and "kv_cache_memory_bytes" not in plain["llm_kwargs"]
    bad = _cli("--dry-run", "--interleave", "--rounds", "2")
    assert bad.returncode == 2 and "--interleave and --rounds 2 do not combine" in bad.stderr


def test_serve_commands_records_repeats_not_warmups(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def fake_run_point(llm, spec, batch, context, tag, rng, resolved, mp, mk):
        calls.append((batch, context, tag))
        if batch == 3:
            raise RuntimeError("no room")
        return [1.0, 2.0, 3.0], 0.5

    monkeypatch.setattr(decode_points, "run_point", fake_run_point)
    spec = WorkerSpec(model="m", config_dir="", mode="plugin_graphs", llm_kwargs={}, env={},
                      batches=[1, 3], contexts=[512], repeats=2, decode_tokens=3,
                      warmup_steps=0, vocab_size=10, seed=0, result_path="", interleaved=True)
    result = WorkerResult(model="m", mode="plugin_graphs")
    saves = []
    commands = ["point 1 512 -1\n", "\n", "point 1 512 0\n", "point 3 512 0\n", "bogus\n",
                "point 1 512 1\n", "quit\n", "point 1 512 2\n"]
    bench = decode_points.Bench(None, spec, result, lambda: saves.append(1), None, None)
    decode_points.serve_commands(bench, commands)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith("[bench] ")]
    assert lines == ["[bench-ready]", "[bench-done] ok", "[bench-done] ok", "[bench-done] error",
                     "[bench-done] error unknown command 'bogus'", "[bench-done] ok"]
    assert [c[:2] for c in calls] == [(1, 512), (1, 512), (3, 512), (1, 512)]  # not after quit
    p = result.point(1, 512)
    assert p.repeats_done == 2 and p.step_ms == [1.0, 2.0, 3.0] * 2  # the warm-up is not kept
    assert p.repeat_p50_ms == [2.0, 2.0]
    assert "no room" in result.point(3, 512).error


def _interleaved_specs(tmp_path: Path, modes: list[str], repeats: int = 2) -> list[WorkerSpec]:
    return [WorkerSpec(model="m", config_dir="", mode=m, llm_kwargs={}, env={},
                       batches=[1, 8], contexts=[512], repeats=repeats, decode_tokens=4,
                       warmup_steps=0, vocab_size=10, seed=0,
                       result_path=str(tmp_path / f"result-{m}.json"), interleaved=True)
            for m in modes]


def _commands(path: Path) -> list[tuple[float, str]]:
    return [(float(t), rest.strip()) for t, rest in
            (ln.split(" ", 1) for ln in path.read_text().splitlines())]


def test_interleaved_modes_take_turns_point_by_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker_process.WorkerProcess, "module",
                        "tests.benchmarks._fake_mode_worker")
    monkeypatch.setenv("FAKE_STEP_MS_STOCK_GRAPHS", "2.0")
    modes = ["stock_full_decode", "plugin_graphs", "stock_graphs"]
    specs = _interleaved_specs(tmp_path, modes)
    results, failures, skipped = sweep.execute_interleaved(specs, tmp_path, None, 60.0)
    assert failures == [] and skipped == []
    assert [r.mode for r in results] == modes and all(r.status == "ok" for r in results)
    for r in results:  # the warm-up pass is not recorded; both repeats of both points are
        assert [(p.batch, p.repeats_done) for p in r.points] == [(1, 2), (8, 2)]
    assert results[2].point(1, 512).step_ms == [2.0] * 8
    # Every (repeat, point) ran once per mode, all modes before the next one, first mode rotating
    log = sorted((t, cmd, m) for m in modes
                 for t, cmd in _commands(tmp_path / f"result-{m}.json.commands"))
    cmds = [(cmd, m) for _, cmd, m in log if cmd != "quit"]
    assert len(cmds) == 3 * 2 * 3  # (warm-up + 2 repeats) x 2 points x 3 modes
    groups = [cmds[i:i + 3] for i in range(0, len(cmds), 3)]
    for group in groups:
        assert len({c for c, _ in group}) == 1 and {m for _, m in group} == set(modes)
    assert [c for c, _ in (g[0] for g in groups)] == [
        "point 1 512 -1", "point 8 512 -1", "point 1 512 0", "point 8 512 0",
        "point 1 512 1", "point 8 512 1"]
    firsts = [g[0][1] for g in groups]
    assert len(set(firsts)) == 3, f"the first mode must rotate, got {firsts}"


def test_interleaved_run_survives_a_dying_worker_and_the_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker_process.WorkerProcess, "module",
                        "tests.benchmarks._fake_mode_worker")
    monkeypatch.setenv("FAKE_DIE_MODE", "plugin_graphs")
    specs = _interleaved_specs(tmp_path, ["stock_full_decode", "plugin_graphs"], repeats=50)
    t_end = time.time() + 25.0  # start-ups are estimated at >= 35 s: the first is refused
    results, failures, skipped = sweep.execute_interleaved(specs, tmp_path, t_end, 60.0)
    assert results == [] and {s["mode"] for s in skipped} == {"stock_full_decode",
                                                              "plugin_graphs"}
    t_end = time.time() + 100.0  # both start; plugin dies at its first repeat; 50 repeats
    results, failures, skipped = sweep.execute_interleaved(specs, tmp_path, t_end, 60.0)
    by_mode = {r.mode: r for r in results}
    assert by_mode["stock_full_decode"].status == "ok"
    assert by_mode["stock_full_decode"].point(1, 512).repeats_done == 50
    assert [f["mode"] for f in failures] == ["plugin_graphs"]
    assert "exited" in failures[0]["error"]


def test_interleaved_worker_drives_a_real_cpu_engine(tmp_path: Path, cpu_vllm: str) -> None:
    """The real mode worker in interleaved mode on vLLM's CPU build (`--allow-cpu`): a real
    engine starts, answers a warm-up and two repeats through stdin, and quits cleanly."""
    from tests.serve_util import cpu_env
    from tests.tiny_models import build_checkpoint

    model = build_checkpoint(str(tmp_path / "tiny"))
    spec = WorkerSpec(
        model="tiny", config_dir=model, mode="stock_eager",
        llm_kwargs={"model": model, "load_format": "dummy", "skip_tokenizer_init": True,
                    "dtype": "bfloat16", "seed": 0, "max_num_seqs": 2, "max_model_len": 128,
                    "enforce_eager": True, "enable_prefix_caching": False},
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, batches=[2], contexts=[16], repeats=2,
        decode_tokens=8, warmup_steps=1, vocab_size=100, seed=0,
        result_path=str(tmp_path / "result.json"), interleaved=True)
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(dataclasses.asdict(spec)))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.harness.mode_worker", str(spec_path), "--allow-cpu"],
        input="point 2 16 -1\npoint 2 16 0\npoint 2 16 1\nquit\n", cwd=REPO,
        env=cpu_env(cpu_vllm, VLLM_ENABLE_V1_MULTIPROCESSING="0"), capture_output=True,
        text=True, timeout=600)
    control = [ln for ln in proc.stdout.splitlines() if ln.startswith("[bench-")]
    assert control == ["[bench-ready]"] + ["[bench-done] ok"] * 3, proc.stdout[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "ok", result.get("error")
    (point,) = result["points"]
    assert point["repeats_done"] == 2 and len(point["repeat_p50_ms"]) == 2  # no warm-up
    assert len(point["step_ms"]) == 2 * 8 and all(s > 0 for s in point["step_ms"])


def test_interleaved_budget_cuts_whole_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an unmeasured point is estimated at 5 s a mode: 12 s hold the warm-up pass and a few more
    monkeypatch.setattr(worker_process.WorkerProcess, "module",
                        "tests.benchmarks._fake_mode_worker")
    monkeypatch.setattr(sweep, "MODES", {m: SimpleNamespace(startup_estimate_s=0.0)
                                         for m in ("stock_full_decode", "plugin_graphs")})
    monkeypatch.setattr(sweep, "MIN_MEASURE_S", 0.0)
    monkeypatch.setenv("FAKE_SLEEP_S", "0.25")
    specs = _interleaved_specs(tmp_path, ["stock_full_decode", "plugin_graphs"], repeats=20)
    results, failures, skipped = sweep.execute_interleaved(specs, tmp_path, time.time() + 12.0,
                                                           60.0)
    assert failures == []
    done = {(r.mode, p.batch): p.repeats_done for r in results for p in r.points}
    assert 1 <= done[("plugin_graphs", 1)] < 20
    for b in (1, 8):  # a pass is all modes or none: every mode got the same repeats
        assert done[("stock_full_decode", b)] == done[("plugin_graphs", b)]
    cut = {(s["mode"], s["batch"]): s["repeats_skipped"] for s in skipped}
    assert all(done[k] + cut[k] == 20 for k in done), (done, cut)


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
