"""CPU tests of the decode benchmark's interleaved runs (benchmarks/harness/sweep.py): modes take
turns point by point in workers that survive a dying one and the time budget, and one worker
drives a real engine on vLLM's CPU build."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.harness import decode_points
from benchmarks.harness import sweep, worker_process
from benchmarks.harness.protocol import WorkerResult, WorkerSpec
from tests.benchmarks.harness_util import _cli


REPO = Path(__file__).resolve().parents[2]


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

    def fake_run_point(llm, spec, batch, context, tag, rng, resolved, mp, mk, sampling):
        calls.append((batch, context, sampling, tag))
        if batch == 3:
            raise RuntimeError("no room")
        return [1.0, 2.0, 3.0] if sampling == "greedy" else [4.0], 0.5

    monkeypatch.setattr(decode_points, "run_point", fake_run_point)
    spec = WorkerSpec(model="m", config_dir="", mode="plugin_graphs", llm_kwargs={}, env={},
                      batches=[1, 3], contexts=[512], repeats=2, decode_tokens=3,
                      warmup_steps=0, vocab_size=10, seed=0, result_path="", interleaved=True)
    result = WorkerResult(model="m", mode="plugin_graphs")
    saves = []
    commands = ["point 1 512 -1\n", "\n", "point 1 512 0\n", "point 1 512 0 qwen3\n",
                "point 3 512 0\n", "bogus\n", "point 1 512 1 nucleus\n", "point 1 512 1\n",
                "quit\n", "point 1 512 2\n"]
    bench = decode_points.Bench(None, spec, result, lambda: saves.append(1), None, None)
    decode_points.serve_commands(bench, commands)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith("[bench] ")]
    assert lines == ["[bench-ready]", "[bench-done] ok", "[bench-done] ok", "[bench-done] ok",
                     "[bench-done] error", "[bench-done] error unknown command 'bogus'",
                     "[bench-done] error unknown sampling preset 'nucleus'", "[bench-done] ok"]
    assert [c[:3] for c in calls] == [(1, 512, "greedy"), (1, 512, "greedy"),
                                      (1, 512, "qwen3"), (3, 512, "greedy"),
                                      (1, 512, "greedy")]  # not after quit
    assert calls[2][3] == "i0b1c512-qwen3"  # request ids apart from the greedy repeat's
    p = result.point(1, 512)
    assert p.repeats_done == 2 and p.step_ms == [1.0, 2.0, 3.0] * 2  # the warm-up is not kept
    assert p.repeat_p50_ms == [2.0, 2.0]
    sampled = result.point(1, 512, "qwen3")
    assert sampled.repeats_done == 1 and sampled.step_ms == [4.0]
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
    engine starts, answers a warm-up and two repeats through stdin, one more under the seeded
    `qwen3` preset (real SamplingParams with top-p/top-k and a seed per request), and quits
    cleanly."""
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
        input="point 2 16 -1\npoint 2 16 0\npoint 2 16 1\npoint 2 16 0 qwen3\nquit\n", cwd=REPO,
        env=cpu_env(cpu_vllm, VLLM_ENABLE_V1_MULTIPROCESSING="0"), capture_output=True,
        text=True, timeout=600)
    control = [ln for ln in proc.stdout.splitlines() if ln.startswith("[bench-")]
    assert control == ["[bench-ready]"] + ["[bench-done] ok"] * 4, proc.stdout[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "ok", result.get("error")
    point, sampled = result["points"]
    assert point["sampling"] == "greedy" and sampled["sampling"] == "qwen3"
    assert point["repeats_done"] == 2 and len(point["repeat_p50_ms"]) == 2  # no warm-up
    assert len(point["step_ms"]) == 2 * 8 and all(s > 0 for s in point["step_ms"])
    assert sampled["repeats_done"] == 1 and len(sampled["step_ms"]) == 8


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


def test_fp8_shapes_run_every_mode_on_the_same_flags(tmp_path: Path) -> None:
    """A decode run on `qwen3-8b-fp8-kv8`: every mode loads the block FP8 config with an FP8
    KV cache (its fixed cache sized at a byte a value), the plugin's modes take the unproven
    formats over (MOE_GRAPHS_UNPROVEN), stock's do not."""
    out = _cli("--dry-run", "--models", "qwen3-8b-fp8-kv8", "--modes",
               "stock_full_decode,plugin_graphs", "--batches", "1,64", "--contexts", "512",
               "--interleave", "--log-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    stock, plugin = json.loads(out.stdout)["workers"]
    for w in (stock, plugin):
        assert w["llm_kwargs"]["kv_cache_dtype"] == "fp8"
        cfg = json.loads((Path(w["config_dir"]) / "config.json").read_text())
        assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    assert plugin["env"]["MOE_GRAPHS_UNPROVEN"] == "fp8,fp8_kv"
    assert "MOE_GRAPHS_UNPROVEN" not in stock["env"]
    # 36 layers x 8 kv heads x 128 x 2 (K, V) x 1 byte a value
    need = 36 * 8 * 128 * 2 * 64 * plugin["llm_kwargs"]["max_model_len"] * sweep.KV_HEADROOM
    assert need <= plugin["llm_kwargs"]["kv_cache_memory_bytes"] < need + 256 * 2**20
