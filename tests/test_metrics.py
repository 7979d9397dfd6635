"""Metrics objects, label bounds, and the multiprocess transport (real processes, real files)."""

from __future__ import annotations

import multiprocessing
import os
import re

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from vllm_moe_graphs import metrics, metrics_transport
from vllm_moe_graphs.capability import DecodeGraphCapability, Proof, Reason
from vllm_moe_graphs.metrics import METRICS, MetricsRecorder, Mode
from vllm_moe_graphs.metrics_transport import PluginCollector
from vllm_moe_graphs.ops.sampling_plan import SamplingRefusal
from tests.serve_util import metric_sum


def _scrape(directory: str) -> str:
    registry = CollectorRegistry()
    registry.register(PluginCollector(directory))
    return generate_latest(registry).decode()


def _samples(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if re.match(rf"^{name}[{{ ]", line)]


def _worker(directory: str, rank: int, replays: int) -> None:
    os.environ["MOE_GRAPHS_METRICS_DIR"] = directory
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    rec = metrics.recorder(rank)
    rec.set_mode(Mode.GRAPHS)
    rec.set_capability(DecodeGraphCapability.compose([Proof("a", Reason.ELIGIBLE)]))
    rec.replay(replays)
    rec.fallback(Reason.KILL_SWITCH, 2)
    rec.capture(0.2)
    from vllm_moe_graphs.graphs.kinds import StepKind

    rec.set_memory({StepKind.DECODE: 1000 * (rank + 1)}, scratch_bytes=10)


def test_every_metric_exported_with_prefix(tmp_path):
    rec = MetricsRecorder(rank=0, directory=str(tmp_path))
    rec.set_mode(Mode.STOCK)
    text = _scrape(str(tmp_path))
    for name in METRICS:
        assert name.startswith(metrics.PREFIX)
        sample = name + ("_count" if name.endswith("_seconds") else "")
        assert _samples(text, sample), name


def test_publish_sends_what_changed_in_a_runners_stats(tmp_path):
    from vllm_moe_graphs.graphs.kinds import StepKind
    from vllm_moe_graphs.graphs.stats import GraphStats

    rec = MetricsRecorder(rank=0, directory=str(tmp_path))
    stats = GraphStats(scratch_bytes=64)
    stats.capture(StepKind.DECODE, 0.5, 2048)
    stats.capture(StepKind.MIXED, 0.25, 4096, on_step=True)
    for _ in range(3):
        stats.replay()
    stats.fallback(Reason.MIXED_BATCH, StepKind.MIXED)
    stats.padded_step(StepKind.MIXED, 200, 56)
    stats.padded_step(StepKind.DECODE, 3, 1)
    rec.publish(stats)
    assert stats.capture_seconds == [], "observations are handed over once"
    text = _scrape(str(tmp_path))
    assert metric_sum(text, "moe_graphs_pool_bytes", kind="decode") == 2048
    assert metric_sum(text, "moe_graphs_pool_bytes", kind="mixed") == 4096
    assert metric_sum(text, "moe_graphs_captures_total", kind="mixed") == 1
    assert metric_sum(text, "moe_graphs_capture_seconds_sum", kind="mixed") == 0.25
    assert metric_sum(text, "moe_graphs_step_captures_total", kind="mixed") == 1
    assert metric_sum(text, "moe_graphs_step_captures_total", kind="decode") == 0
    rec.publish(stats)  # nothing changed: nothing added
    stats.replay()
    stats.replay(StepKind.PREFILL)
    stats.fallback(Reason.MIXED_BATCH, StepKind.PREFILL)
    stats.fallback(Reason.KILL_SWITCH)
    stats.capture_failure(StepKind.PREFILL)
    stats.padded_step(StepKind.MIXED, 100, 28)
    stats.pool_dropped()
    rec.publish(stats)
    # a second runner in the process: its counters add from zero, its gauges replace
    other = GraphStats(scratch_bytes=32)
    other.replay()
    rec.publish(other)
    text = _scrape(str(tmp_path))
    assert metric_sum(text, "moe_graphs_replays_total", kind="decode", rank="0") == 5
    assert metric_sum(text, "moe_graphs_replays_total", kind="prefill", rank="0") == 1
    assert metric_sum(text, "moe_graphs_replays_total", kind="mixed", rank="0") == 0
    fallbacks = "moe_graphs_eager_fallbacks_total"
    assert metric_sum(text, fallbacks, reason="mixed_batch", kind="mixed", rank="0") == 1
    assert metric_sum(text, fallbacks, reason="mixed_batch", kind="prefill", rank="0") == 1
    assert metric_sum(text, fallbacks, reason="kill_switch", kind="decode", rank="0") == 1
    assert metric_sum(text, "moe_graphs_captures_total", rank="0") == 2
    assert metric_sum(text, "moe_graphs_capture_failures_total", kind="prefill", rank="0") == 1
    assert metric_sum(text, "moe_graphs_capture_seconds_count", rank="0") == 2
    assert metric_sum(text, "moe_graphs_pool_bytes", rank="0") == 0
    assert metric_sum(text, "moe_graphs_scratch_bytes", rank="0") == 32
    rows = "moe_graphs_graph_rows_total"
    assert metric_sum(text, rows, kind="mixed", row="real") == 300
    assert metric_sum(text, rows, kind="mixed", row="padding") == 84
    assert metric_sum(text, rows, kind="decode", row="padding") == 1


def test_publish_sends_the_sampling_counters(tmp_path):
    from vllm_moe_graphs.graphs.kinds import StepKind
    from vllm_moe_graphs.graphs.stats import GraphStats

    rec = MetricsRecorder(rank=0, directory=str(tmp_path))
    stats = GraphStats()
    stats.sampled_in_graph(StepKind.DECODE, inexact_rows=1)
    stats.sampled_in_graph(StepKind.MIXED, inexact_rows=3)
    stats.sampler_fallback(SamplingRefusal.PENALTIES, StepKind.DECODE)
    rec.publish(stats)
    stats.sampled_in_graph(StepKind.DECODE, inexact_rows=3)
    stats.sampler_fallback(SamplingRefusal.PENALTIES, StepKind.DECODE)
    stats.sampler_fallback(SamplingRefusal.ALL_GREEDY, StepKind.MIXED)
    rec.publish(stats)
    text = _scrape(str(tmp_path))
    assert metric_sum(text, "moe_graphs_sampled_in_graph_total", kind="decode") == 2
    assert metric_sum(text, "moe_graphs_sampled_in_graph_total", kind="mixed") == 1
    fallbacks = "moe_graphs_sampler_fallbacks_total"
    assert metric_sum(text, fallbacks, reason="penalties", kind="decode") == 2
    assert metric_sum(text, fallbacks, reason="all_greedy", kind="mixed") == 1
    assert metric_sum(text, fallbacks, reason="all_greedy", kind="decode") == 0
    assert metric_sum(text, "moe_graphs_sampling_inexact_rows_total") == 3


def test_recorded_values_reach_the_files(tmp_path):
    rec = MetricsRecorder(rank=3, directory=str(tmp_path))
    rec.set_mode(Mode.STOCK)
    rec.set_capability(DecodeGraphCapability.compose(
        [Proof("platform", Reason.NO_CUDA), Proof("lora", Reason.LORA)]))
    rec.replay(5)
    rec.fallback(Reason.MIXED_BATCH)
    rec.capture_failure()
    rec.record_invalidation(Reason.STORAGE_IDENTITY_CHANGED)
    text = _scrape(str(tmp_path))
    assert metric_sum(text, "moe_graphs_info", version=metrics.__version__, mode="stock") == 1
    assert metric_sum(text, "moe_graphs_info", version=metrics.__version__, mode="graphs") == 0
    assert metric_sum(text, "moe_graphs_capability", reason="no_cuda") == 1
    assert metric_sum(text, "moe_graphs_capability", reason="lora") == 1
    assert metric_sum(text, "moe_graphs_capability", reason="eligible") == 0
    assert metric_sum(text, "moe_graphs_replays_total", rank="3") == 5
    assert metric_sum(text, "moe_graphs_eager_fallbacks_total", reason="mixed_batch", rank="3") == 1
    assert metric_sum(text, "moe_graphs_capture_failures_total", rank="3") == 1
    assert metric_sum(text, "moe_graphs_invalidations_total", reason="storage_identity_changed",
                  rank="3") == 1


def test_label_values_bounded_by_enums(tmp_path):
    rec = MetricsRecorder(rank=0, directory=str(tmp_path))
    with pytest.raises(TypeError, match="capability.Reason"):
        rec.fallback("made_up_reason")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="capability.Reason"):
        rec.record_invalidation("storage_identity_changed")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        rec.set_mode("turbo")  # type: ignore[arg-type]
    text = _scrape(str(tmp_path))
    sampler = "moe_graphs_sampler_fallbacks"
    lines = text.splitlines()
    reasons = {m for line in lines if not line.startswith(sampler)
               for m in re.findall(r'reason="([^"]*)"', line)}
    assert reasons == {r.value for r in Reason}
    sampler_reasons = {m for line in lines if line.startswith(sampler)
                       for m in re.findall(r'reason="([^"]*)"', line)}
    assert sampler_reasons == {r.value for r in SamplingRefusal} - {"servable"}
    modes = {m for m in re.findall(r'mode="([^"]*)"', text)}
    assert modes == {m.value for m in Mode}
    with pytest.raises(ValueError, match="rank"):
        MetricsRecorder(rank=-1)


def test_two_worker_processes_no_double_counting(tmp_path):
    """Two ranks (as with TP=2) write into one directory; the API-side collector shows each
    rank's counters once and one info/capability series."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), rank, 10 + rank))
             for rank in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    text = _scrape(str(tmp_path))
    assert metric_sum(text, "moe_graphs_replays_total", rank="0") == 10
    assert metric_sum(text, "moe_graphs_replays_total", rank="1") == 11
    assert len(_samples(text, "moe_graphs_replays_total")) == 2 * 3  # ranks x step kinds
    assert metric_sum(text, "moe_graphs_eager_fallbacks_total", reason="kill_switch", rank="1") == 2
    assert metric_sum(text, "moe_graphs_pool_bytes", rank="1") == 2000
    info = [s for s in _samples(text, "moe_graphs_info") if s.endswith(" 1.0")]
    assert info == [f'moe_graphs_info{{mode="graphs",version="{metrics.__version__}"}} 1.0']
    assert metric_sum(text, "moe_graphs_capability", reason="eligible") == 1
    assert metric_sum(text, "moe_graphs_capture_seconds_count", rank="0") == 1
    assert "pid" not in text


def test_no_directory_keeps_values_in_memory():
    rec = MetricsRecorder(rank=0, directory=None)
    rec.replay(2)  # no files anywhere; nothing raises


def test_setup_root_publishes_only_plugin_series(tmp_path, monkeypatch):
    registry = CollectorRegistry()
    monkeypatch.delenv("MOE_GRAPHS_METRICS_DIR", raising=False)
    directory = metrics_transport.setup_root(registry)
    assert os.environ["MOE_GRAPHS_METRICS_DIR"] == directory
    assert metrics_transport.setup_root(registry) == directory  # idempotent
    # a foreign series in the same files (e.g. vLLM's, written by another process) is not shown
    from prometheus_client import Counter, values

    saved = values.ValueClass
    values.ValueClass = values.MultiProcessValue(lambda: 424242)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", directory)
    try:
        Counter("vllm:foreign", "not ours", registry=None).inc()
    finally:
        values.ValueClass = saved
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
    MetricsRecorder(rank=0, directory=directory).replay(7)
    text = generate_latest(registry).decode()
    assert "vllm:foreign" not in text
    assert metric_sum(text, "moe_graphs_replays_total", rank="0") == 7
    assert metrics_transport.collect_text(registry).count("moe_graphs_replays_total") >= 1


def test_root_process_records_nothing_at_setup(monkeypatch):
    registry = CollectorRegistry()
    before = dict(metrics._recorder_by_pid)
    metrics_transport.setup_root(registry)
    assert metrics._recorder_by_pid == before


def test_metrics_directory_prefers_vllm_multiproc_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_GRAPHS_METRICS_DIR", str(tmp_path / "ours"))
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    assert metrics.metrics_directory() == str(tmp_path / "ours")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "vllms"))
    assert metrics.metrics_directory() == str(tmp_path / "vllms")


def test_is_root_process():
    assert metrics_transport.is_root_process()
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_report_root, args=(q,))
    p.start()
    assert q.get(timeout=60) is False
    p.join(30)


def _report_root(q) -> None:
    q.put(metrics_transport.is_root_process())
