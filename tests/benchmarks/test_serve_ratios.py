"""The serving benchmark's CPU side, its results: ratio keys and their intervals, saturation, the
result schema and table, and the merge of result files."""

from __future__ import annotations

import json

import pytest

from benchmarks.serving import report as serve_report
from benchmarks.serving.load import WORKLOADS
from benchmarks.harness.stats import percentile
from benchmarks.serving.server import DEFAULT_MODES, SERVE_MODES


def _row(mode, rate, ttft, tpot, otps, workload="chat"):
    d = lambda v: {"p50": v, "p90": v, "p99": 2 * v, "mean": v}  # noqa: E731
    return {"model": "m", "mode": mode, "workload": workload, "rate": rate, "requests": 10,
            "completed": 10, "failed": 0, "ttft_ms": d(ttft), "tpot_ms": d(tpot),
            "itl_ms": d(tpot), "e2e_ms": d(ttft + 100 * tpot), "send_lag_ms": d(0.5),
            "output_tokens_per_s": otps, "requests_per_s": 1.0, "steps": {}}


def test_ratio_keys_and_direction():
    rows = [_row("plugin", 16, 40.0, 2.0, 3000.0), _row("stock", 16, 50.0, 2.5, 2900.0),
            _row("stock_triton", 16, 60.0, 3.0, 2800.0), _row("stock", 4, 10.0, 1.0, 700.0)]
    r = serve_report.compute_ratios(rows)
    assert r["ttft_p50_stock_over_plugin/m/chat/r16"] == 1.25
    assert r["tpot_p99_stock_triton_over_plugin/m/chat/r16"] == 1.5
    assert r["otps_plugin_over_stock/m/chat/r16"] == pytest.approx(3000 / 2900, abs=1e-3)
    assert not [k for k in r if "/r4" in k]  # no plugin row at rate 4: no ratio
    assert {k.split("/")[0] for k in r} == {
        f"{m}_{a}_over_plugin" for m in serve_report.RATIO_METRICS
        for a in ("stock", "stock_triton")} | {"otps_plugin_over_stock",
                                                "otps_plugin_over_stock_triton"}


def test_sampling_costs_read_each_mode_against_its_own_greedy_twin():
    assert WORKLOADS["chat_sampled"].greedy_twin == "chat"
    rows = [_row("plugin", 16, 40.0, 2.0, 3000.0), _row("stock", 16, 50.0, 2.5, 2900.0),
            _row("plugin", 16, 50.0, 3.0, 2900.0, workload="chat_sampled"),
            _row("stock", 16, 50.0, 2.75, 2800.0, workload="chat_sampled"),
            _row("stock", 4, 10.0, 1.0, 700.0, workload="chat_sampled"),  # no greedy row at 4
            _row("plugin", 2, 5.0, 1.0, 500.0, workload="long")]  # not a sampled workload
    costs = serve_report.sampling_costs(rows)
    assert costs == {"ttft_p50_chat_sampled_over_chat/m/plugin/r16": 1.25,
                     "tpot_p50_chat_sampled_over_chat/m/plugin/r16": 1.5,
                     "tpot_p99_chat_sampled_over_chat/m/plugin/r16": 1.5,
                     "ttft_p50_chat_sampled_over_chat/m/stock/r16": 1.0,
                     "tpot_p50_chat_sampled_over_chat/m/stock/r16": 1.1,
                     "tpot_p99_chat_sampled_over_chat/m/stock/r16": 1.1}
    # rows of two runs (a merge) are not read against each other
    merged = [{**r, "run": "a.json" if r["workload"] == "chat" else "b.json"} for r in rows]
    assert serve_report.sampling_costs(merged) == {}
    doc = serve_report.assemble("n", "m", {}, {}, {}, rows, [])
    assert doc["sampling_costs"] == costs
    assert "tpot_p50_chat_sampled_over_chat/m/plugin/r16" in serve_report.format_table(doc)


def test_a_second_plugin_mode_gets_its_own_ratios():
    rows = [_row("plugin", 16, 40.0, 2.0, 3000.0), _row("stock", 16, 50.0, 2.5, 2900.0),
            _row("plugin_decode_only", 16, 25.0, 1.25, 3100.0)]
    r = serve_report.compute_ratios(rows)
    assert r["ttft_p50_stock_over_plugin_decode_only/m/chat/r16"] == 2.0
    assert r["tpot_p50_plugin_over_plugin_decode_only/m/chat/r16"] == 1.6
    assert r["ttft_p50_stock_over_plugin/m/chat/r16"] == 1.25
    assert r["otps_plugin_decode_only_over_plugin/m/chat/r16"] == pytest.approx(3100 / 3000,
                                                                                abs=1e-3)
    # times: the other mode's over the plugin mode's; never plugin over itself or reversed
    assert not [k for k in r
                if "_plugin_decode_only_over_plugin/" in k and not k.startswith("otps")]
    assert not [k for k in r if "_over_stock/" in k and not k.startswith("otps")]
    assert "plugin_decode_only" in SERVE_MODES
    assert "plugin_decode_only" not in DEFAULT_MODES
    modes = SERVE_MODES
    assert modes["plugin_decode_only"].settings == {"mixed_graphs": False}
    assert modes["plugin_triton_prefill"].settings == {"prefill_attention": "triton"}
    assert not modes["plugin"].settings  # the plugin's defaults: every step graphed
    assert "plugin_triton_prefill" not in DEFAULT_MODES
    assert modes["plugin_precapture"].settings == {"precapture": True}
    assert "plugin_precapture" not in DEFAULT_MODES


def _sampled_row(mode, ttft, rate=16, workload="chat"):
    """A row whose TTFT p50 / p99 and samples come from `ttft` (ms per request)."""
    row = _row(mode, rate, 1.0, 1.0, 100.0, workload)
    row["ttft_ms"] = {"p50": percentile(ttft, 50), "p90": percentile(ttft, 90),
                      "p99": percentile(ttft, 99), "mean": sum(ttft) / len(ttft)}
    row["samples"] = {"ttft_ms": list(ttft)}
    return row


def test_ratio_intervals_hold_the_ratio_and_tell_a_real_gap_from_noise():
    import random

    rng = random.Random(5)
    prompt = [rng.uniform(50, 150) for _ in range(200)]  # a request's own cost, in both modes
    noise = lambda: [p * rng.uniform(0.9, 1.1) for p in prompt]  # noqa: E731
    plugin, same, slower = noise(), noise(), [2 * p for p in noise()]
    rows = [_sampled_row("plugin", plugin), _sampled_row("stock", slower),
            _sampled_row("stock_triton", same)]
    ratios, iv = serve_report.compute_ratios(rows), serve_report.ratio_intervals(rows)
    for key in ("ttft_p50_stock_over_plugin/m/chat/r16", "ttft_p99_stock_over_plugin/m/chat/r16",
                "ttft_p50_stock_triton_over_plugin/m/chat/r16"):
        assert iv[key][0] <= ratios[key] <= iv[key][1], (key, ratios[key], iv[key])
    assert iv["ttft_p50_stock_over_plugin/m/chat/r16"][0] > 1.8  # twice as slow: clear of 1
    assert iv["ttft_p50_stock_triton_over_plugin/m/chat/r16"][0] < 1.0 < \
        iv["ttft_p50_stock_triton_over_plugin/m/chat/r16"][1]  # the same cost: 1 inside
    # a p99 of 200 requests moves more than their p50
    width = lambda k: iv[k][1] - iv[k][0]  # noqa: E731
    assert width("ttft_p99_stock_triton_over_plugin/m/chat/r16") > \
        width("ttft_p50_stock_triton_over_plugin/m/chat/r16")
    # only metrics with samples; never the throughput ratio
    assert set(iv) == {k for k in ratios if k.startswith("ttft_")}
    # seeded by the key: the same in any file holding the two rows
    assert serve_report.ratio_intervals(rows[:2] + [_sampled_row("stock", slower, rate=4)]) == {
        k: v for k, v in iv.items() if "_stock_over_" in k}


def test_ratio_intervals_need_samples_of_enough_paired_requests():
    few = serve_report.MIN_PAIRED - 1
    rows = [_sampled_row("plugin", [10.0] * 20), _sampled_row("stock", [12.0] * 20)]
    rows[1]["samples"]["ttft_ms"][few:] = [None] * (20 - few)  # failed in stock: not paired
    assert serve_report.ratio_intervals(rows) == {}
    rows = [_row("plugin", 16, 40.0, 2.0, 3000.0), _row("stock", 16, 50.0, 2.5, 2900.0)]
    assert serve_report.ratio_intervals(rows) == {}  # rows of a file written before samples
    doc = serve_report.assemble("n", "m", {}, {}, {}, rows, [])
    assert "ratio_intervals" not in doc and "[95% interval]" not in \
        serve_report.format_table(doc)


def test_ratio_intervals_of_rows_from_two_runs_resample_each_row_on_its_own():
    # the plugin's row ran 64 requests, the slow ones late; stock_triton's ran 32 in another
    # run: pairing request i with request i would compare the plugin's first 32 only
    plugin = [10.0 + i % 7 for i in range(32)] + [40.0 + i % 5 for i in range(32)]
    rows = [{**_sampled_row("plugin", plugin), "run": "a.json"},
            {**_sampled_row("stock_triton", [30.0 + i % 5 for i in range(32)]), "run": "b.json"}]
    ratios, iv = serve_report.compute_ratios(rows), serve_report.ratio_intervals(rows)
    for key in ("ttft_p50_stock_triton_over_plugin/m/chat/r16",
                "ttft_p99_stock_triton_over_plugin/m/chat/r16"):
        assert iv[key][0] <= ratios[key] <= iv[key][1], (key, ratios[key], iv[key])
    # one run but request lists of unequal length: not the same requests, so not paired either
    rows = [{**r, "run": None} for r in rows]
    assert serve_report.ratio_intervals(rows) == iv
    # each row needs MIN_PAIRED completed requests of its own
    rows[1]["samples"]["ttft_ms"][serve_report.MIN_PAIRED - 1:] = [None] * 32
    assert serve_report.ratio_intervals(rows) == {}


def test_a_result_file_carries_the_intervals_and_its_table_prints_them(tmp_path):
    rows = [_sampled_row("plugin", [10.0 + i % 7 for i in range(40)]),
            _sampled_row("stock", [20.0 + i % 5 for i in range(40)])]
    doc = serve_report.assemble("n", "m", {}, {}, {"plugin": {}, "stock": {}}, rows, [])
    key = "ttft_p50_stock_over_plugin/m/chat/r16"
    lo, hi = doc["ratio_intervals"][key]
    assert lo <= doc["ratios"][key] <= hi
    line = next(ln for ln in serve_report.format_table(doc).splitlines() if key in ln)
    assert line.endswith(f"[{lo:.2f}, {hi:.2f}]"), line
    path = serve_report.write(doc, tmp_path)
    merged = tmp_path / "merged"
    assert serve_report.merge([str(path)], "again", merged) == 0
    assert json.loads((merged / "again.json").read_text())["ratio_intervals"] == \
        doc["ratio_intervals"]


def test_saturation_is_the_latency_knee():
    rows = [_row("stock", 4, 30, 2, 800), _row("stock", 16, 35, 3, 3100),
            _row("stock", 32, 60, 8.5, 4000), _row("stock", 64, 900, 20, 4100),
            _row("plugin", 4, 30, 2, 800), _row("plugin", 8, 121, 2, 1600),
            _row("stock_triton", 4, 30, 2, 800), _row("stock_triton", 8, 119, 7.9, 1600)]
    sat = serve_report.saturation(rows)
    assert sat["stock/chat"]["saturated_at"] == 32  # TPOT p50 past 4x the lowest rate's
    assert sat["stock/chat"]["max_output_tokens_per_s"] == 4100
    assert sat["stock/chat"]["at_rate"] == 64
    assert sat["plugin/chat"]["saturated_at"] == 8  # TTFT p50 past 4x
    assert sat["stock_triton/chat"]["saturated_at"] is None  # both just under 4x


def test_result_schema_and_table():
    rows = [_row("plugin", 16, 40.0, 2.0, 3000.0), _row("stock", 16, 50.0, 2.5, 2900.0)]
    doc = serve_report.assemble("n", "m", {"gpu_name": "x"},
                                serve_report.workloads_section([(WORKLOADS["chat"], [16])]),
                                {"plugin": {}, "stock": {}}, rows, [])
    assert doc["workloads"]["chat"]["prompt_len"] == [128, 1024]
    serve_report.check_schema(doc)
    assert json.loads(json.dumps(doc)) == doc
    table = serve_report.format_table(doc)
    assert "ttft_p50_stock_over_plugin/m/chat/r16" in table and "not saturated" in table
    del doc["rows"][0]["ttft_ms"]
    with pytest.raises(ValueError, match="row 0 lacks ttft_ms"):
        serve_report.check_schema(doc)
    with pytest.raises(ValueError, match="lacks ratios"):
        serve_report.check_schema({k: v for k, v in doc.items() if k != "ratios"})


def test_merge_keeps_each_rows_run_and_lists_ratios_across_runs(tmp_path, capsys):
    env = {"gpu_name": "x"}
    section = serve_report.workloads_section([(WORKLOADS["chat"], [4, 16])])
    a = serve_report.assemble("a", "m", {**env, "options": {"duration_s": 8.0}}, section,
                              {"plugin": {}, "stock": {}},
                              [_row("plugin", 16, 40.0, 2.0, 3000.0),
                               _row("stock", 16, 50.0, 2.5, 2900.0),
                               _row("stock", 4, 20.0, 2.0, 800.0)], [])
    b = serve_report.assemble("b", "m", {**env, "options": {"duration_s": 16.0}}, section,
                              {"plugin": {}, "stock_triton": {}},
                              [_row("plugin", 4, 10.0, 1.0, 810.0),
                               _row("stock_triton", 16, 60.0, 3.0, 2800.0)], [])
    pa, pb = serve_report.write(a, tmp_path), serve_report.write(b, tmp_path)
    assert "ratios_across_runs" not in a  # one run: every ratio side by side
    assert serve_report.merge([str(pa), str(pb)], "ab", tmp_path) == 0
    doc = json.loads((tmp_path / "ab.json").read_text())
    assert {(r["mode"], r["rate"]): r["run"] for r in doc["rows"]} == {
        ("plugin", 16): "a.json", ("stock", 16): "a.json", ("stock", 4): "a.json",
        ("plugin", 4): "b.json", ("stock_triton", 16): "b.json"}
    across = doc["ratios_across_runs"]
    assert "ttft_p50_stock_triton_over_plugin/m/chat/r16" in across  # plugin row from a.json
    assert "ttft_p50_stock_over_plugin/m/chat/r4" in across  # stock row from a.json
    assert not [k for k in across if k.endswith("/r16") and "_stock_over_" in k]
    assert set(across) <= set(doc["ratios"])
    table = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()
             if ln.startswith("  ") and "_over_" in ln}
    assert table["ttft_p50_stock_over_plugin/m/chat/r4"].endswith(" *")
    assert not table["ttft_p50_stock_over_plugin/m/chat/r16"].endswith("*")
    # merging the merged file again keeps each row's first run and the files it came from
    assert serve_report.merge([str(tmp_path / "ab.json")], "ab2", tmp_path) == 0
    again = json.loads((tmp_path / "ab2.json").read_text())
    assert again["ratios_across_runs"] == across
    assert [src["file"] for src in again["env"]["merged_from"]] == ["a.json", "b.json"]
    # every run's options, not only the last one's
    assert [src["options"] for src in again["env"]["merged_from"]] == [
        {"duration_s": 8.0}, {"duration_s": 16.0}]


def test_merge_drops_a_skipped_point_that_another_run_measured(tmp_path):
    section = serve_report.workloads_section([(WORKLOADS["chat"], [4, 16])])
    a = serve_report.assemble("a", "m", {}, section, {"plugin": {}, "stock": {}},
                              [_row("plugin", 4, 10.0, 1.0, 810.0),
                               _row("stock", 4, 20.0, 2.0, 800.0)],
                              ["stock/chat/r16: time budget", "plugin/chat/r16: time budget"])
    b = serve_report.assemble("b", "m", {}, section, {"stock": {}},
                              [_row("stock", 16, 50.0, 2.5, 2900.0)],
                              ["stock/long/r2: time budget"])
    paths = [str(serve_report.write(d, tmp_path)) for d in (a, b)]
    assert serve_report.merge(paths, "ab", tmp_path) == 0
    doc = json.loads((tmp_path / "ab.json").read_text())
    assert doc["skipped"] == ["plugin/chat/r16: time budget", "stock/long/r2: time budget"]
