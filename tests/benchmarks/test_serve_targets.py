"""`benchmarks.serving targets`: the serving targets read from result files, and the README's
headline table, which must be what the committed result files say."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks.serving import report as serve_report
from benchmarks.serving import targets as serve_targets
from benchmarks.serving.load import WORKLOADS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(REPO, "benchmarks", "results")
SERVE_RESULTS = ("h200-serve-qwen3-0.6b.json", "h200-serve-qwen3-30b-a3b.json")


def _row(mode: str, workload: str, rate: float, ttft: float, tpot: float, otps: float,
         replayed: float | None = 1.0) -> dict:
    def d(v: float) -> dict:
        return {"p50": v, "p90": v, "p99": v * 2, "mean": v}

    return {"model": "m", "mode": mode, "workload": workload, "rate": rate, "requests": 10,
            "completed": 10, "failed": 0, "ttft_ms": d(ttft), "tpot_ms": d(tpot),
            "itl_ms": d(tpot), "e2e_ms": d(ttft + 100 * tpot), "send_lag_ms": d(0.1),
            "output_tokens_per_s": otps, "requests_per_s": 1.0,
            "steps": {} if replayed is None or mode != "plugin" else {"replayed_share": replayed}}


def _doc(rows: list[dict]) -> dict:
    return serve_report.assemble("t", "m", {}, {}, {}, rows, [])


def test_a_doc_that_meets_every_target_has_no_miss():
    rows = []
    for rate, stock_ttft in ((4, 60.0), (16, 80.0), (32, 400.0)):  # r32: 5x r4, saturated
        rows += [_row("plugin", "chat", rate, 40.0, 2.0, 1000.0 * rate),
                 _row("stock", "chat", rate, stock_ttft, 2.5, 900.0 * rate)]
    for rate, stock_ttft in ((1, 100.0), (2, 100.0), (8, 900.0)):
        rows += [_row("plugin", "long", rate, 100.0, 10.0, 100.0 * rate),
                 _row("stock", "long", rate, stock_ttft, 10.0, 100.0 * rate)]
    doc = _doc(rows)
    assert serve_targets.misses(doc) == []
    lines = serve_targets.headline_rows(doc)
    assert lines[0] == "| m | chat | 4 | 1.50x / 1.50x | 1.25x / 1.25x | 1.11x | 100% |"
    assert lines[2].startswith("| m | chat | 32 (stock saturated) | 10.00x")
    assert [ln.split(" | ")[1] for ln in lines] == ["chat"] * 3 + ["long"] * 3


def test_each_kind_of_miss_is_listed_with_its_value_and_floor():
    rows = [_row("plugin", "chat", 4, 40.0, 2.0, 4000.0, replayed=0.9),
            _row("stock", "chat", 4, 60.0, 2.2, 4000.0),  # TPOT 1.10x < 1.2x
            _row("plugin", "chat", 8, 40.0, 2.0, 8000.0),
            _row("stock", "chat", 8, 60.0, 2.5, 8000.0),
            _row("plugin", "long", 1, 100.0, 10.0, 100.0),
            _row("stock", "long", 1, 99.0, 10.0, 100.0),  # TTFT 0.99x < 1.0x, 2 captures
            _row("plugin", "long", 4, 900.0, 10.0, 90.0),  # saturated, fewer tokens/s
            _row("stock", "long", 4, 900.0, 10.0, 100.0)]
    rows[4]["steps"].update(captures=2, step_captures=1,
                            capture_s_by_kind={"mixed": 0.25, "decode": 0.125})
    missed = serve_targets.misses(_doc(rows))
    held = "; the plugin's window held 2 captures, 1 inside steps (0.38 s)"
    assert missed == [
        "m chat r4: tpot_p50 1.10x < 1.2x", "m chat r4: tpot_p99 1.10x < 1.2x",
        "m chat: no saturated point up to 8 req/s (output tok/s at saturation not shown)",
        "m chat r4: 90.0% of steps replayed < 95%", "m chat r16: no replayed share measured",
        "m long r1: ttft_p50 0.99x < 1.0x" + held, "m long r1: ttft_p99 0.99x < 1.0x" + held,
        "m long r4 (saturated): output tok/s 0.90x of stock's < 1.0x"], missed


def test_a_miss_of_rows_with_samples_gives_its_interval():
    rows = [_row("plugin", "long", 1, 100.0, 10.0, 100.0), _row("stock", "long", 1, 98.0, 10.0,
                                                                100.0)]
    for row, scale in zip(rows, (1.0, 0.98)):  # every request 2% faster in stock
        row["samples"] = {"ttft_ms": [scale * (90.0 + i % 20) for i in range(40)]}
    doc = _doc(rows)
    lo, hi = doc["ratio_intervals"]["ttft_p50_stock_over_plugin/m/long/r1"]
    assert lo <= 0.98 <= hi < 1.0
    assert f"m long r1: ttft_p50 0.98x < 1.0x (95% interval {lo:.2f}-{hi:.2f}x)" in \
        serve_targets.misses(doc)


def test_a_workload_without_both_modes_is_a_miss_not_a_pass():
    missed = serve_targets.misses(_doc([_row("plugin", "chat", 4, 40.0, 2.0, 100.0),
                                        _row("stock_triton", "chat", 4, 60.0, 3.0, 100.0)]))
    assert missed == ["m chat: no point with both plugin and stock",
                      "m long: no point with both plugin and stock"]


def test_readme_headline_table_is_what_the_committed_results_say():
    """The README's headline rows are rows `targets` prints for the committed serving results,
    exactly: a few of them (docs/benchmarking.md has every rate), none that they do not give."""
    paths = [os.path.join(RESULTS, name) for name in SERVE_RESULTS]
    proc = subprocess.run([sys.executable, "-m", "benchmarks.serving", "targets", *paths],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| Qwen3")]
    assert len(rows) >= 8, proc.stdout
    readme = open(os.path.join(REPO, "README.md")).read().splitlines()
    table = [ln for ln in readme if ln.startswith("| Qwen3")
             and any(f"| {w} |" in ln for w in WORKLOADS)]  # any workload's row, chat_sampled too
    assert len(table) >= 4, table
    assert [ln for ln in table if ln not in rows] == [], (
        "README's serving rows differ from `benchmarks.serving targets`")
    assert "targets against stock" in proc.stdout


def test_committed_merged_results_list_the_run_of_every_row():
    """A merged serving result names, in `env.merged_from`, every run one of its rows was
    measured in (with its date and commit), so each number can be traced to its run."""
    merged = 0
    for name in sorted(os.listdir(RESULTS)):
        if not (name.startswith(("h100-serve-", "h200-serve-")) and name.endswith(".json")):
            continue  # the serving benchmark's results, by the GPU they ran on
        with open(os.path.join(RESULTS, name)) as f:
            doc = json.load(f)
        sources = doc["env"].get("merged_from")
        runs = {r["run"] for r in doc["rows"] if "run" in r}
        if not sources:
            assert not runs - {name}, (name, runs)
            continue
        merged += 1
        files = {s["file"] for s in sources}
        assert runs <= files, (name, sorted(runs - files))
        assert all(s.get("date") and s.get("git_commit") for s in sources), (name, sources)
    assert merged >= 2


def test_coverage_lists_missing_modes_rates_offload_failures_and_client_lag():
    rows = []
    for rate in (1, 2, 4, 8):  # chat: 4 rates of the three modes, stock saturated at 8
        rows += [_row("plugin", "chat", rate, 40.0, 2.0, 100.0 * rate),
                 _row("stock", "chat", rate, 400.0 if rate == 8 else 60.0, 2.5, 90.0 * rate),
                 _row("stock_triton", "chat", rate, 70.0, 3.0, 80.0 * rate)]
    rows += [_row("plugin", "long", 1, 100.0, 10.0, 100.0),  # long: few rates, no saturation
             _row("stock", "long", 1, 100.0, 10.0, 100.0)]
    rows[0]["failed"] = 2
    rows[1]["send_lag_ms"] = {"p50": 1.0, "p99": 12.5}
    rows[-3]["send_lag_ms"] = {"p50": 1.0, "p99": 50.0}  # stock_triton chat r8: not saturated
    doc = _doc(rows)
    assert serve_targets.coverage(doc) == [
        "m long plugin: 1 rates (1), needs 4", "m long stock: 1 rates (1), needs 4",
        "m long stock_triton: 0 rates (none), needs 4",
        "m long: no measured rate saturated any mode",
        "m chat r1 plugin: 2 failed requests",
        "m chat r1 stock: client send lag p99 12.5 ms >= 10 ms",
        "m chat r8 stock_triton: client send lag p99 50.0 ms >= 10 ms"]
    doc["model"] = "qwen3-30b-a3b"  # the MoE shape also needs moe_offload, plugin and stock
    assert "qwen3-30b-a3b moe_offload stock: 0 rates (none), needs 2" in serve_targets.coverage(doc)
