"""CPU tests of the decode benchmark's worker pieces (benchmarks/harness/): vLLM's capture log
record, timing decode-only steps on a stand-in engine, the engine arguments and the plugin's
counters, rounds of modes and their merge."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.decode import bench as decode
from benchmarks.decode import report
from benchmarks.harness import decode_points
from benchmarks.harness import sweep, vllm_facts
from benchmarks.harness.modes import MODES, Family
from benchmarks.harness.protocol import PointResult, WorkerResult, WorkerSpec
from tests.benchmarks.harness_util import _cli, _Engine, _shape


REPO = Path(__file__).resolve().parents[2]


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
        make_params=lambda n, s, i: SimpleNamespace(max_tokens=n, sampling=s, index=i),
        make_prompt=lambda ids: {"prompt_token_ids": ids},
        sampling="qwen3",
    )
    # every request its own parameters: the preset asked for, its index (a seeded preset's seed)
    assert {rid: (p.sampling, p.index) for rid, p in engine.params.items()} == {
        f"t-{i}": ("qwen3", i) for i in range(4)}
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
            make_params=lambda n, s, i: SimpleNamespace(max_tokens=n),
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
