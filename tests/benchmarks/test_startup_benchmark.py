"""`benchmarks.startup`: the cold / warm start-up protocol, with the stand-in worker (no GPU)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from benchmarks.harness import worker_process
from benchmarks.startup import bench as startup


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *extra: str) -> dict:
    monkeypatch.setattr(worker_process.WorkerProcess, "module",
                        "tests.benchmarks._fake_mode_worker")
    monkeypatch.setattr(startup, "prime", lambda *a: {"fake": True})
    rc = startup.main(["--modes", "stock_graphs,stock_full_decode_nc,plugin_graphs",
                       "--allow-cpu", "--results-dir", str(tmp_path), "--log-dir",
                       str(tmp_path / "logs"), "--name", "s", *extra])
    assert rc == 0
    return json.loads((tmp_path / "s.json").read_text())


def test_cold_then_warm_rounds_each_mode_with_its_own_caches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for mode, cold in (("STOCK_GRAPHS", "9.0"), ("STOCK_FULL_DECODE_NC", "3.0"),
                       ("PLUGIN_GRAPHS", "2.5")):
        monkeypatch.setenv(f"FAKE_COLD_S_{mode}", cold)
    monkeypatch.setenv("FAKE_WARM_S_STOCK_GRAPHS", "3.0")
    monkeypatch.setenv("FAKE_WARM_S_PLUGIN_GRAPHS", "1.2")
    monkeypatch.setenv("FAKE_COLD_JIT", "stock_graphs")
    doc = _run(tmp_path, monkeypatch, "--warm-rounds", "2")
    runs = doc["runs"]
    assert [(r["mode"], r["round"]) for r in runs] == [
        ("stock_graphs", 0), ("stock_full_decode_nc", 0), ("plugin_graphs", 0),
        ("stock_full_decode_nc", 1), ("plugin_graphs", 1), ("stock_graphs", 1),
        ("plugin_graphs", 2), ("stock_graphs", 2), ("stock_full_decode_nc", 2)]
    assert all(r["status"] == "ok" and r["error"] is None for r in runs)
    # Cold only in round 0: every mode's warm starts found what its own cold start left.
    assert [r["cache"] for r in runs] == ["cold"] * 3 + ["warm"] * 6
    by = {(r["mode"], r["round"]): r for r in runs}
    assert by[("plugin_graphs", 0)]["startup_s"] == 2.5
    assert by[("plugin_graphs", 1)]["startup_s"] == by[("plugin_graphs", 2)]["startup_s"] == 1.2
    assert by[("stock_full_decode_nc", 2)]["startup_s"] == 1.0
    assert by[("stock_graphs", 1)]["first_point"] == {
        "batch": 8, "context": 512, "wall_s": 0.5, "prefill_s": 0.1, "tpot_p50_ms": 1.0}
    roots = {}
    for mode in ("stock_graphs", "stock_full_decode_nc", "plugin_graphs"):
        results = [json.loads((tmp_path / "logs" / f"result-{mode}-r{r}.json").read_text())
                   for r in range(3)]
        assert len({res["resolved"]["cache_root"] for res in results}) == 1
        roots[mode] = results[0]["resolved"]["cache_root"]
    assert len(set(roots.values())) == 3, roots
    modes = doc["summary"]["modes"]
    assert modes["plugin_graphs"]["cold"]["startup_s"] == 2.5
    assert modes["plugin_graphs"]["warm"] == {
        "n": 2, "startup_s": 1.2, "startup_samples_s": [1.2, 1.2], "first_point_s": 0.5,
        "jit_in_requests": [], "ready_and_first_point_s": 1.7}
    # vLLM's JIT monitor records in a start's log are counted per run
    assert by[("stock_graphs", 0)]["jit_in_requests"] == ["_fake_kernel"]
    assert by[("stock_graphs", 1)]["jit_in_requests"] == []
    assert modes["stock_graphs"]["cold"]["jit_in_requests"] == ["_fake_kernel"]
    targets = {t["cache"]: t for t in doc["summary"]["targets"]}
    assert targets["cold"]["vs_stock_graphs"] == round(2.5 / 9.0, 3)
    assert targets["cold"]["not_slower_than_nc"] and targets["cold"]["under_third_of_stock_graphs"]
    assert targets["warm"]["vs_stock_full_decode_nc"] == 1.2
    assert not targets["warm"]["not_slower_than_nc"]
    assert not targets["warm"]["under_third_of_stock_graphs"]
    out = capsys.readouterr().out
    assert "plugin_graphs warm: 1.20x stock_full_decode_nc (NOT met: not slower)" in out
    assert "stock_graphs: Triton compiles after ready (vLLM's JIT monitor): _fake_kernel" in out


def test_cold_rounds_rotate_the_first_mode_and_each_start_new_caches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FAKE_COLD_S_PLUGIN_GRAPHS", "2.5")
    monkeypatch.setenv("FAKE_WARM_S_PLUGIN_GRAPHS", "1.2")
    doc = _run(tmp_path, monkeypatch, "--cold-rounds", "3", "--warm-rounds", "1")
    runs = doc["runs"]
    modes = ["stock_graphs", "stock_full_decode_nc", "plugin_graphs"]
    # each mode is the first cold start once; the warm round rotates as with one cold round
    assert [(r["mode"], r["round"]) for r in runs] == [
        *[(m, 0) for m in modes], *[(m, 1) for m in modes[1:] + modes[:1]],
        *[(m, 2) for m in modes[2:] + modes[:2]], *[(m, 3) for m in modes[1:] + modes[:1]]]
    assert doc["protocol"]["cold_rounds"] == 3
    assert [[r["round"], r["mode"]] for r in runs] == doc["protocol"]["schedule"]
    # the fake worker is cold exactly when its cache root is new: every cold round found none
    assert [r["cache"] for r in runs] == ["cold"] * 9 + ["warm"] * 3
    by = {(r["mode"], r["round"]): r for r in runs}
    assert [by[("plugin_graphs", k)]["startup_s"] for k in range(4)] == [2.5, 2.5, 2.5, 1.2]
    for mode in modes:
        roots = [json.loads((tmp_path / "logs" / f"result-{mode}-r{k}.json").read_text())
                 ["resolved"]["cache_root"] for k in range(4)]
        assert len(set(roots[:3])) == 3 and roots[3] == roots[2], roots
    summary = doc["summary"]["modes"]["plugin_graphs"]
    assert summary["cold"]["n"] == 3 and summary["cold"]["startup_samples_s"] == [2.5] * 3
    assert summary["warm"]["n"] == 1 and summary["warm"]["startup_s"] == 1.2
    out = capsys.readouterr().out
    assert "3 cold and 1 warm round(s)" in out
    assert "2.5, 2.5, 2.5 / 1.2" in out


def test_budget_skips_starts_that_cannot_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # 110 s budget - 15 s reserve = 95 s. Estimates: a mode's start-up estimate + 30 s before its
    # first start (stock_graphs 120 s: never fits; nc 65 s, plugin 75 s), then its cold wall
    # minus its cold start-up plus 20 s (about 20 s here: both warm starts fit).
    doc = _run(tmp_path, monkeypatch, "--warm-rounds", "1", "--time-budget-s", "110")
    assert [(r["mode"], r["round"]) for r in doc["runs"]] == [
        ("stock_full_decode_nc", 0), ("plugin_graphs", 0), ("stock_full_decode_nc", 1),
        ("plugin_graphs", 1)]
    assert [(s["mode"], s["round"]) for s in doc["skipped"]] == [("stock_graphs", 0),
                                                                 ("stock_graphs", 1)]
    assert all("time budget" in s["reason"] for s in doc["skipped"])
    # no stock_graphs start: each start-up is judged against stock_full_decode_nc alone
    targets = {t["cache"]: t for t in doc["summary"]["targets"]}
    assert set(targets) == {"cold", "warm"}
    for cache, t in targets.items():
        nc = doc["summary"]["modes"]["stock_full_decode_nc"][cache]["startup_s"]
        assert t["vs_stock_full_decode_nc"] == round(t["startup_s"] / nc, 3)
        assert t["not_slower_than_nc"] == (t["startup_s"] <= nc)
        assert "vs_stock_graphs" not in t and "under_third_of_stock_graphs" not in t
    assert "plugin_graphs cold: " in capsys.readouterr().out


def test_prime_runs_the_real_imports(tmp_path: Path) -> None:
    """The prime process imports torch, vLLM and the plugin and resolves a model config (CPU)."""
    from benchmarks.harness.shapes import prepare_config_dir

    config_dir, _ = prepare_config_dir("qwen3-0.6b", 2, tmp_path)
    t0 = time.monotonic()
    facts = startup.prime(config_dir, tmp_path, allow_cpu=True)
    assert "error" not in facts, facts
    assert facts["model_config_s"] > 0 and facts["import_s"] > 0
    assert facts["cuda"] is False and 0 < facts["wall_s"] <= time.monotonic() - t0 + 0.01


def test_bad_arguments_quote_the_value(capsys: pytest.CaptureFixture[str]) -> None:
    assert startup.main(["--batch", "0", "--allow-cpu"]) == startup.EXIT_USAGE
    assert "--batch must be > 0, got 0" in capsys.readouterr().err
    assert startup.main(["--cold-rounds", "0", "--allow-cpu"]) == startup.EXIT_USAGE
    assert "--cold-rounds must be >= 1, got 0" in capsys.readouterr().err
    assert startup.main(["--modes", "nope", "--allow-cpu"]) == startup.EXIT_USAGE
    assert "unknown mode(s) nope" in capsys.readouterr().err
