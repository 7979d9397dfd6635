"""CPU tests of the decode benchmark's result rows (benchmarks/decode/report.py and the harness's
statistics): ratio keys and values, repeat summaries, percentiles, and the merge of result files."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from benchmarks.decode import bench as decode
from benchmarks.decode import report
from benchmarks.harness import stats
from benchmarks.harness.protocol import PointResult, WorkerResult
from tests.benchmarks.harness_util import _shape


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
