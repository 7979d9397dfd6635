"""CPU tests of the decode benchmark's sampling presets (`--sampling`, benchmarks/harness/
sampling.py): the option and its errors, the plan, each preset's vLLM SamplingParams, the
worker's runs point by point and preset by preset, rows, ratio keys, the cost of sampling, the
step profile's presets and a whole interleaved run through stand-in workers."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.decode import bench as decode
from benchmarks.decode import report
from benchmarks.decode.sampling_cost import format_sampling_cost, sampling_cost
from benchmarks.harness import decode_points, machine, profile_steps, worker_process
from benchmarks.harness.protocol import PointResult, WorkerResult, WorkerSpec
from benchmarks.harness.sampling import PRESETS, QWEN3_CHAT_SAMPLING, parse_presets
from benchmarks.serving.load import WORKLOADS
from tests.benchmarks.harness_util import _cli, _shape


def test_sampling_option_defaults_to_greedy_and_keeps_order() -> None:
    assert decode.run_parser().parse_args([]).sampling == ["greedy"]
    args = decode.run_parser().parse_args(["--sampling", "qwen3, greedy,qwen3"])
    decode.validate_args(args)
    assert parse_presets(args.sampling) == ["qwen3", "greedy"]


@pytest.mark.parametrize("value,bad", [("greedy,nucleus", "'nucleus'"), ("Greedy", "'Greedy'"),
                                       (",", "(none given)")])
def test_bad_sampling_is_a_usage_error_naming_it_and_the_valid_ones(value: str, bad: str) -> None:
    out = _cli("--dry-run", "--models", "qwen3-0.6b", "--sampling", value)
    assert out.returncode == decode.EXIT_USAGE, out.stdout
    assert f"unknown sampling preset(s) {bad}; valid: greedy, qwen3, qwen3_unseeded" in out.stderr


def test_dry_run_plan_carries_the_presets(tmp_path: Path) -> None:
    out = _cli("--dry-run", "--models", "qwen3-0.6b", "--modes", "plugin_graphs,stock_graphs",
               "--sampling", "greedy,qwen3", "--log-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert [w["sampling"] for w in plan["workers"]] == [["greedy", "qwen3"]] * 2
    assert plan["sampling"] == {
        "greedy": {"temperature": 0.0, "seeded": False},
        "qwen3": {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "seeded": True}}
    plain = json.loads(_cli("--dry-run", "--models", "qwen3-0.6b", "--modes", "plugin_graphs",
                            "--log-dir", str(tmp_path)).stdout)
    assert plain["workers"][0]["sampling"] == ["greedy"]
    spec = WorkerSpec(**{**plan["workers"][0], "batches": [8, 1], "contexts": [512]})
    assert spec.runs() == [(1, 512, "greedy"), (1, 512, "qwen3"), (8, 512, "greedy"),
                           (8, 512, "qwen3")]  # a point's presets back to back


def test_presets_share_qwen3s_numbers_with_the_serving_workload() -> None:
    assert WORKLOADS["chat_sampled"].sampling is QWEN3_CHAT_SAMPLING
    assert PRESETS["greedy"].kwargs(seed=7, index=3) == {"temperature": 0.0}
    assert PRESETS["qwen3"].kwargs(seed=7, index=3) == {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "seed": 10}
    assert PRESETS["qwen3"].kwargs(7, 4)["seed"] == 11  # one fixed seed per request
    assert PRESETS["qwen3_unseeded"].kwargs(7, 3) == dict(WORKLOADS["chat_sampled"].sampling)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_request_params_are_vllm_sampling_params_of_the_preset() -> None:
    from vllm.sampling_params import RequestOutputKind, SamplingType

    from benchmarks.harness.mode_worker import request_params

    greedy = request_params(40, "greedy", seed=5, index=3)
    assert greedy.sampling_type is SamplingType.GREEDY and greedy.seed is None
    sampled = [request_params(40, "qwen3", seed=5, index=i) for i in range(3)]
    unseeded = request_params(40, "qwen3_unseeded", seed=5, index=3)
    for p in (greedy, *sampled, unseeded):  # exactly 40 tokens, ids only, every step's new ones
        assert (p.max_tokens, p.ignore_eos, p.min_tokens, p.detokenize) == (40, True, 0, False)
        assert p.output_kind is RequestOutputKind.DELTA
    assert [p.seed for p in sampled] == [5, 6, 7]
    for p in (*sampled, unseeded):
        assert (p.temperature, p.top_p, p.top_k) == (0.7, 0.8, 20)
    assert sampled[0].sampling_type is SamplingType.RANDOM_SEED
    assert unseeded.sampling_type is SamplingType.RANDOM and unseeded.seed is None


def test_measure_points_runs_every_preset_and_skips_them_apart(monkeypatch) -> None:
    calls = []

    def fake_run_point(llm, spec, batch, context, tag, rng, resolved, mp, mk, sampling):
        calls.append((batch, context, sampling, tag))
        return [2.0 if sampling == "qwen3" else 1.0] * 4, 0.1

    monkeypatch.setattr(decode_points, "run_point", fake_run_point)
    spec = WorkerSpec(model="m", config_dir="", mode="plugin_graphs", llm_kwargs={}, env={},
                      batches=[1, 8], contexts=[512], repeats=2, decode_tokens=4,
                      warmup_steps=0, vocab_size=10, seed=0, result_path="",
                      sampling=["greedy", "qwen3"])
    spec.soft_deadline = 0.0  # long past: repeat 2 starts nothing
    result = WorkerResult(model="m", mode="plugin_graphs")
    decode_points.measure_points(decode_points.Bench(None, spec, result, lambda: None, None,
                                                     None))
    assert [c[:3] for c in calls] == [(1, 512, "greedy"), (1, 512, "qwen3"),
                                      (8, 512, "greedy"), (8, 512, "qwen3")]
    assert calls[1][3] == "r0b1c512-qwen3"
    assert result.point(8, 512, "qwen3").step_ms == [2.0] * 4
    assert result.point(8, 512).step_ms == [1.0] * 4
    assert sorted((s["batch"], s["sampling"]) for s in result.skipped) == [
        (1, "greedy"), (1, "qwen3"), (8, "greedy"), (8, "qwen3")]


def _row(mode: str, batch: int, p50: float, sampling: str | None = None,
         reps: list[float] | None = None) -> dict:
    row = {"model": "qwen3-0.6b", "batch": batch, "context": 512, "mode": mode,
           "tpot_ms_p50": p50, "tpot_ms_p10": p50, "tpot_ms_p90": p50, "startup_s": 1.0,
           "capture_s": 1.0, "graph_mem_mib": 1.0, "floor_ms": 0.5, "pct_of_floor": 50.0,
           "num_layers": 28, "noisy": False, "repeat_p50_ms": reps or [p50]}
    return row if sampling is None else {**row, "sampling": sampling}  # None: an older file


def test_ratio_keys_keep_greedy_names_and_add_the_cost_of_sampling() -> None:
    rows = [_row("stock_graphs", 8, 2.0), _row("plugin_graphs", 8, 1.5),
            _row("stock_graphs", 8, 2.5, "qwen3"), _row("plugin_graphs", 8, 2.4, "qwen3"),
            _row("plugin_graphs", 1, 1.2, "qwen3")]  # no greedy partner: no rule-5 ratio
    at = "qwen3-0.6b/b8/c512"
    assert report.compute_ratios(rows) == {
        f"tpot_stock_graphs_over_plugin_graphs/{at}": round(2.0 / 1.5, 4),  # as before presets
        f"tpot_stock_graphs_over_plugin_graphs/{at}/qwen3": round(2.5 / 2.4, 4),
        f"tpot_qwen3_over_greedy/stock_graphs/{at}": 1.25,
        f"tpot_qwen3_over_greedy/plugin_graphs/{at}": 1.6}
    assert report.ratio_key("a", "b", "m", 1, 2) == "tpot_a_over_b/m/b1/c2"


def test_rows_table_and_summaries_tell_the_presets_apart() -> None:
    result = WorkerResult(model="qwen3-0.6b", mode="plugin_graphs", status="ok", points=[
        PointResult(8, 512, "qwen3", step_ms=[2.0, 2.2], repeat_p50_ms=[2.0, 2.2],
                    repeats_done=2),
        PointResult(8, 512, step_ms=[1.0, 1.5], repeat_p50_ms=[1.0, 1.5], repeats_done=2)])
    built = [r.sampling for r in report.build_rows(result, _shape("qwen3-0.6b"), None)]
    assert built == ["greedy", "qwen3"]
    rows = [_row("plugin_graphs", 8, 2.1, "qwen3", [2.0, 2.2]),
            _row("stock_graphs", 8, 2.5, "qwen3", [2.4, 2.6]),
            _row("plugin_graphs", 8, 1.25, "greedy", [1.0, 1.5]),
            _row("stock_graphs", 8, 2.0, None, [1.9, 2.1])]
    doc = report.assemble("t", {}, rows, {}, [{"model": "qwen3-0.6b", "mode": "stock_graphs",
                                               "batch": 1, "context": 512, "sampling": "qwen3",
                                               "error": "boom"}], [])
    assert [(r["mode"], report.sampling_of(r)) for r in doc["rows"]] == [
        ("stock_graphs", "greedy"), ("plugin_graphs", "greedy"),
        ("stock_graphs", "qwen3"), ("plugin_graphs", "qwen3")]
    assert doc["sampling"]["qwen3"]["seeded"] is True
    (cost,) = [e for e in doc["sampling_cost"] if e["mode"] == "plugin_graphs"]
    assert (cost["added_ms"], cost["ratio"]) == (0.85, 1.68)
    assert cost["paired_ratio_median"] == round(statistics.median([2.0, 2.2 / 1.5]), 4)
    table = report.format_table(doc).splitlines()
    assert "sampling" in table[0] and table[3].split()[3:5] == ["plugin_graphs", "greedy"]
    assert table[4].split()[3:5] == ["stock_graphs", "qwen3"]
    assert "failed  qwen3-0.6b stock_graphs b1/c512/qwen3: boom" in table
    greedy_only = report.assemble("g", {}, rows[2:], {}, [], [])
    assert "sampling" not in report.format_table(greedy_only).splitlines()[0]
    assert format_sampling_cost(greedy_only) == "" and greedy_only["sampling_cost"] == []
    summary = report.format_ratio_summary(doc).splitlines()
    assert summary[1].startswith("qwen3-0.6b b8 c512/qwen3: best stock graphs stock_graphs")
    assert [s["sampling"] for s in report.repeat_summary(doc)] == ["greedy", "qwen3"]
    assert format_sampling_cost(doc).splitlines() == [
        "sampling qwen3 over greedy, qwen3-0.6b c512 stock_graphs: "
        "b8 2.500 - 2.000 = +0.500 ms (x1.25, paired x1.25)",
        "sampling qwen3 over greedy, qwen3-0.6b c512 plugin_graphs: "
        "b8 2.100 - 1.250 = +0.850 ms (x1.68, paired x1.73)"]
    merged = report.merge([("a", doc), ("b", report.assemble("b", {}, [rows[0]], {}, [], []))],
                          "ab")
    assert len(merged["rows"]) == 4  # the sampled row does not replace its greedy one
    assert sampling_cost(merged["rows"]) == doc["sampling_cost"]


def test_step_profile_runs_each_batch_under_each_preset(tmp_path: Path, monkeypatch) -> None:
    from tests.benchmarks.harness_util import _Engine

    engine = _Engine(budget=700, lag=False)
    engine.prefill_sleep_s = 0.0
    llm = SimpleNamespace(llm_engine=engine, _preprocess_cmpl=lambda prompts: prompts)
    d = profile_steps._Decoding(llm, 2, 8, 20, 100,
                                lambda n, s, i: SimpleNamespace(max_tokens=n, key=(s, i)),
                                lambda ids: {"prompt_token_ids": ids}, "t", "qwen3")
    assert {r: p.key for r, p in engine.params.items()} == {"t-0": ("qwen3", 0),
                                                             "t-1": ("qwen3", 1)}
    d.close()
    calls = []

    def fake_profile_batch(llm, batch, context, steps, vocab, mp, mk, label, pstats, sampling):
        calls.append((batch, sampling, Path(pstats).name))
        return f"## {label} batch {batch} sampling {sampling}\n"

    monkeypatch.setattr(profile_steps, "profile_batch", fake_profile_batch)
    engine.model_config = SimpleNamespace(max_model_len=4096)
    spec = WorkerSpec(model="m", config_dir="", mode="stock_graphs", llm_kwargs={}, env={},
                      batches=[1, 8], contexts=[512], repeats=1, decode_tokens=4,
                      warmup_steps=0, vocab_size=10, seed=0, result_path="",
                      sampling=["greedy", "qwen3"])
    path = profile_steps.profile_run(llm, spec, None, None, str(tmp_path))
    assert calls == [(1, "greedy", "profile-m-stock_graphs-b1.pstats"),
                     (1, "qwen3", "profile-m-stock_graphs-b1-qwen3.pstats"),
                     (8, "greedy", "profile-m-stock_graphs-b8.pstats"),
                     (8, "qwen3", "profile-m-stock_graphs-b8-qwen3.pstats")]
    assert Path(path).read_text().count("sampling qwen3") == 2


def test_interleaved_run_measures_every_preset_side_by_side(tmp_path: Path, monkeypatch,
                                                            capsys) -> None:
    """`benchmarks.decode --interleave --sampling greedy,qwen3` end to end through stand-in
    workers: the plan line, the commands each worker got, rows, rule-5 ratios, the printout."""
    monkeypatch.setattr(worker_process.WorkerProcess, "module",
                        "tests.benchmarks._fake_mode_worker")
    monkeypatch.setattr(machine, "gpu_problem", lambda: None)
    monkeypatch.setattr(machine, "gpu_memory_bytes", lambda: None)
    monkeypatch.setenv("FAKE_STEP_MS_STOCK_GRAPHS", "2.0")
    monkeypatch.setenv("FAKE_SAMPLED_MS", "0.5")
    rc = decode.main(["--models", "qwen3-0.6b", "--num-layers", "2", "--modes",
                      "plugin_graphs,stock_graphs", "--batches", "1,8", "--contexts", "512",
                      "--repeats", "2", "--interleave", "--sampling", "greedy,qwen3", "--name",
                      "s", "--results-dir", str(tmp_path), "--log-dir", str(tmp_path / "logs"),
                      "--no-plot"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "each: 2 point(s) x 2 sampling preset(s) (greedy, qwen3) x 2 repeat(s)" in out
    log = (tmp_path / "logs" / "result-qwen3-0.6b-plugin_graphs.json.commands").read_text()
    cmds = [ln.split(" ", 1)[1] for ln in log.splitlines()]
    assert cmds[:4] == ["point 1 512 -1", "point 1 512 -1 qwen3", "point 8 512 -1",
                        "point 8 512 -1 qwen3"]
    assert cmds.count("point 8 512 1 qwen3") == 1 and len(cmds) == 3 * 4 + 1  # and quit
    doc = json.loads((tmp_path / "s.json").read_text())
    assert len(doc["rows"]) == 8 and doc["env"]["options"]["sampling"] == ["greedy", "qwen3"]
    assert doc["ratios"]["tpot_qwen3_over_greedy/plugin_graphs/qwen3-0.6b/b8/c512"] == 1.5
    assert doc["ratios"]["tpot_qwen3_over_greedy/stock_graphs/qwen3-0.6b/b1/c512"] == 1.25
    assert doc["ratios"]["tpot_stock_graphs_over_plugin_graphs/qwen3-0.6b/b1/c512"] == 2.0
    assert doc["ratios"]["tpot_stock_graphs_over_plugin_graphs/qwen3-0.6b/b1/c512/qwen3"] == (
        round(2.5 / 1.5, 4))
    assert ("sampling qwen3 over greedy, qwen3-0.6b c512 plugin_graphs: b1 1.500 - 1.000 = "
            "+0.500 ms (x1.50, paired x1.50)") in out

