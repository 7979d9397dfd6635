"""The serving benchmark's CPU side, its inputs and measurements: workloads and arrivals, the load
statistics, the /metrics step counters and the facts read from vLLM's log."""

from __future__ import annotations

import json
import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from benchmarks.serving import options as serve_options
from benchmarks.serving import report as serve_report
from benchmarks.serving.load import (
    LAG_P99_LIMIT_MS,
    WORKLOADS,
    Record,
    plan_window,
    rate_label,
    summarize,
)
from benchmarks.serving.server import log_facts, step_counters, step_shares


# -- workloads and arrivals ---------------------------------------------------------------------
def test_window_is_seeded_per_workload_and_rate():
    chat = WORKLOADS["chat"]
    a = plan_window(chat, 16, 10, 24, seed=0, vocab_size=151936)
    assert a == plan_window(chat, 16, 10, 24, seed=0, vocab_size=151936)
    assert a != plan_window(chat, 16, 10, 24, seed=1, vocab_size=151936)
    assert a[0].prompt != plan_window(chat, 32, 10, 24, seed=0, vocab_size=151936)[0].prompt
    assert len(a) == 160
    assert len(plan_window(chat, 0.5, 10, 24, seed=0, vocab_size=151936)) == 24  # the floor
    # a mode whose rates are spelled otherwise is offered the same requests
    assert plan_window(chat, 2, 10, 24, seed=0, vocab_size=151936) == plan_window(
        chat, 2.0, 10, 24, seed=0, vocab_size=151936)


def test_window_lengths_ids_and_arrivals():
    long = WORKLOADS["long"]
    reqs = plan_window(long, 4, 50, 1, seed=3, vocab_size=151936)
    assert all(4096 <= len(r.prompt) <= 8192 and r.max_tokens == 128 for r in reqs)
    assert all(1000 <= t < 151936 for r in reqs for t in r.prompt)
    times = [r.at_s for r in reqs]
    assert times == sorted(times) and times[0] > 0
    gaps = [b - a for a, b in zip([0.0] + times, times)]
    assert 0.2 < sum(gaps) / len(gaps) < 0.3  # Poisson at 4 req/s: mean gap 0.25 s
    tiny = plan_window(WORKLOADS["chat"], 1, 1, 2, seed=0, vocab_size=384)
    assert all(96 <= t < 384 for r in tiny for t in r.prompt)


def test_sampled_workload_sends_its_sampling_and_keeps_it_with_other_lengths(tmp_path):
    from benchmarks.serving.load import _body

    sampled = plan_window(WORKLOADS["chat_sampled"], 4, 2, 1, seed=0, vocab_size=151936)
    chat = plan_window(WORKLOADS["chat"], 4, 2, 1, seed=0, vocab_size=151936)
    assert [r.prompt for r in sampled] != [r.prompt for r in chat]  # seeded by workload name
    body = json.loads(_body("m", sampled[0]))
    assert (body["temperature"], body["top_p"], body["top_k"]) == (0.7, 0.8, 20)
    assert body["ignore_eos"] and body["min_tokens"] == body["max_tokens"]  # lengths fixed
    assert json.loads(_body("m", chat[0]))["temperature"] == 0.0
    assert "top_k" not in json.loads(_body("m", chat[0]))
    plan = serve_options.Plan(serve_options.parser().parse_args([
        "--model", "qwen3-0.6b", "--workloads", "chat_sampled", "--lengths",
        "chat_sampled:16-48:4-6", "--log-dir", str(tmp_path)]))
    (w, rates), = plan.workloads
    assert (w.prompt_len, w.output_len, w.sampling) == ((16, 48), (4, 6),
                                                        WORKLOADS["chat_sampled"].sampling)
    assert rates == serve_options.DEFAULT_RATES["qwen3-0.6b"]["chat"]
    section = serve_report.workloads_section(plan.workloads)["chat_sampled"]
    assert section["sampling"] == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}


@pytest.mark.parametrize("bad", [dict(rate=0), dict(duration_s=-1), dict(min_requests=0)])
def test_window_rejects_bad_values(bad):
    kw = dict(rate=1.0, duration_s=1.0, min_requests=1) | bad
    with pytest.raises(ValueError, match="positive"):
        plan_window(WORKLOADS["chat"], seed=0, vocab_size=1000, **kw)


def test_rate_label():
    assert [rate_label(r) for r in (16, 16.0, 0.5, 2.25)] == ["r16", "r16", "r0.5", "r2.25"]


# -- statistics ---------------------------------------------------------------------------------
def _rec(i, scheduled, sent, chunks, tokens, error=None, max_tokens=None):
    return Record(i, 100, scheduled, max_tokens or max(tokens, 1), sent, list(chunks), tokens,
                  error)


def test_summarize_timings():
    recs = [
        _rec(0, 0.0, 0.001, [0.051, 0.061, 0.071], 3),  # ttft 50 ms, tpot 10 ms
        _rec(1, 0.5, 0.502, [0.602, 0.622, 0.652], 4),  # ttft 100 ms, a chunk of 2 tokens
        _rec(2, 1.0, 1.003, [], 0, error="HTTP 500: boom"),
    ]
    s = summarize(recs, rate=2.0)
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["errors"] == {"HTTP 500: boom": 1}
    assert s["ttft_ms"]["p50"] == pytest.approx(75.0)
    assert s["ttft_ms"]["p99"] == pytest.approx(99.5)
    assert s["tpot_ms"]["p50"] == pytest.approx((10.0 + 50 / 3) / 2, abs=1e-3)
    assert s["itl_ms"]["p50"] == pytest.approx(15.0)  # gaps 10, 10, 20, 30 ms
    assert s["e2e_ms"]["p50"] == pytest.approx((70.0 + 150.0) / 2)
    assert s["send_lag_ms"]["max"] == pytest.approx(3.0)
    assert not s["client_lagging"]
    assert s["tokens_in_merged_chunks"] == 1
    assert s["output_tokens"] == 7
    assert s["span_s"] == pytest.approx(0.652)
    assert s["output_tokens_per_s"] == pytest.approx(7 / 0.652, abs=0.1)


def test_summarize_flags_a_lagging_client_and_empty_windows():
    late = (LAG_P99_LIMIT_MS + 5) / 1e3
    s = summarize([_rec(i, 0.1 * i, 0.1 * i + late, [0.1 * i + 0.2], 1) for i in range(10)], 1.0)
    assert s["client_lagging"]
    empty = summarize([_rec(0, 0.0, math.nan, [], 0, error="not sent")], 1.0)
    assert empty["completed"] == 0 and empty["ttft_ms"]["p50"] is None
    assert empty["output_tokens_per_s"] is None and not empty["client_lagging"]


# -- /metrics and the server log ----------------------------------------------------------------
def _exposition(replays, fallbacks, steps, plugin=True, mixed_replays=None):
    reg = CollectorRegistry()
    if plugin and mixed_replays is not None:  # the plugin's series with their `kind` label
        r = Counter("moe_graphs_replays", "r", ["kind", "rank"], registry=reg)
        r.labels("decode", "0").inc(replays - mixed_replays)
        r.labels("mixed", "0").inc(mixed_replays)
        rows = Counter("moe_graphs_graph_rows", "g", ["kind", "row", "rank"], registry=reg)
        rows.labels("mixed", "real", "0").inc(300 * mixed_replays)
        rows.labels("mixed", "padding", "0").inc(100 * mixed_replays)
        rows.labels("decode", "real", "0").inc(replays - mixed_replays)
        seconds = Histogram("moe_graphs_capture_seconds", "s", ["kind", "rank"], registry=reg)
        seconds.labels("mixed", "0").observe(0.125 * mixed_replays)
        Gauge("moe_graphs_pool_bytes", "p", ["kind", "rank"], registry=reg).labels(
            "mixed", "0").set(2**20 * mixed_replays)
    elif plugin:
        Counter("moe_graphs_replays", "r", ["rank"], registry=reg).labels("0").inc(replays)
    if plugin:
        fb = Counter("moe_graphs_eager_fallbacks", "f", ["reason", "rank"], registry=reg)
        for reason, n in fallbacks.items():
            fb.labels(reason, "0").inc(n)
        Counter("moe_graphs_captures", "c", ["rank"], registry=reg).labels("0").inc(2)
    h = Histogram("vllm:iteration_tokens_total", "t", registry=reg, buckets=(1, 8, 64))
    for _ in range(steps):
        h.observe(3)
    return generate_latest(reg).decode()


def test_step_shares_from_real_exposition():
    before = step_counters(_exposition(10, {"mixed_batch": 5}, 15))
    after = step_counters(_exposition(40, {"mixed_batch": 15, "kill_switch": 0}, 55))
    s = step_shares(before, after)
    assert s["engine_steps"] == 40 and s["replays"] == 30
    assert s["eager"] == {"mixed_batch": 10}
    assert s["replayed_share"] == 0.75 and s["eager_share"] == {"mixed_batch": 0.25}
    stock = step_shares(step_counters(_exposition(0, {}, 3, plugin=False)),
                        step_counters(_exposition(0, {}, 9, plugin=False)))
    assert stock == {"engine_steps": 6, "preemptions": 0}
    by_kind = step_shares(step_counters(_exposition(10, {}, 15, mixed_replays=2)),
                          step_counters(_exposition(40, {}, 55, mixed_replays=12)))
    assert by_kind["replays"] == 30 and by_kind["replays_by_kind"] == {"decode": 20, "mixed": 10}
    assert by_kind["padding_share"] == {"decode": 0.0, "mixed": 0.25}
    assert by_kind["capture_s_by_kind"] == {"mixed": 1.25}
    assert by_kind["pool_mib_by_kind"] == {"mixed": 12.0}  # the gauge at the window's end


def test_step_shares_from_the_plugins_own_metrics(tmp_path):
    """The plugin's real recorder and /metrics collector, read by the benchmark: captures by
    kind, those inside steps, replays, fallbacks, padding."""
    from vllm_moe_graphs.graphs.kinds import StepKind
    from vllm_moe_graphs.graphs.stats import GraphStats
    from vllm_moe_graphs.metrics import MetricsRecorder
    from vllm_moe_graphs.metrics_transport import PluginCollector
    from vllm_moe_graphs.capability import Reason

    def scrape() -> dict:
        reg = CollectorRegistry()
        reg.register(PluginCollector(str(tmp_path)))
        return step_counters(generate_latest(reg).decode())

    rec, stats = MetricsRecorder(rank=0, directory=str(tmp_path)), GraphStats()
    stats.capture(StepKind.MIXED, 0.25, 2**20)  # while idle: no step waited
    rec.publish(stats)
    before = scrape()
    stats.capture(StepKind.DECODE, 0.5, 2**20, on_step=True)
    stats.capture(StepKind.MIXED, 0.125, 2**20)
    for kind in (StepKind.DECODE, StepKind.DECODE, StepKind.MIXED):
        stats.replay(kind)
    stats.fallback(Reason.KILL_SWITCH, StepKind.MIXED)
    stats.padded_step(StepKind.MIXED, 90, 10)
    rec.publish(stats)
    s = step_shares(before, scrape())
    assert s["captures"] == 2 and s["step_captures"] == 1
    assert s["captures_by_kind"] == {"decode": 1, "mixed": 1}
    assert s["capture_s_by_kind"] == {"decode": 0.5, "mixed": 0.125}
    assert s["replays_by_kind"] == {"decode": 2, "mixed": 1} and s["eager"] == {"kill_switch": 1}
    assert s["padding_share"] == {"mixed": 0.1} and s["pool_mib_by_kind"] == {
        "decode": 1.0, "mixed": 2.0}


def test_log_facts_reads_what_vllm_logs():
    log = "\n".join([
        "INFO ... Initializing a V1 LLM engine (v0.26.0) with config: model='m', "
        "compilation_config={'mode': <CompilationMode.VLLM_COMPILE: 3>, 'cudagraph_mode': "
        "<CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>}",
        "INFO ... Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN'].",
        "(EngineCore pid=12) INFO 12-04 [kv_cache_utils.py:2177] GPU KV cache size: 1,234,567 "
        "tokens",
    ])
    assert log_facts(log) == {"attention_backend": "FLASH_ATTN",
                              "cudagraph_mode": "FULL_AND_PIECEWISE",
                              "compilation_mode": "VLLM_COMPILE", "plugin": None,
                              "kv_cache_tokens": 1234567, "graph_pool_set_aside_mib": None}
    chosen = "INFO moe_graphs 0.1.0: registered in process X\nUsing AttentionBackendEnum.CUSTOM " \
             "backend."
    facts = log_facts(chosen)
    assert facts["attention_backend"] == "CUSTOM" and facts["plugin"]


def test_summarize_keeps_each_requests_values_by_index():
    recs = [
        _rec(0, 0.0, 0.001, [0.051, 0.061, 0.071], 3),  # ttft 50 ms, tpot 10 ms, e2e 70 ms
        _rec(1, 0.5, 0.502, [], 0, error="HTTP 500: boom"),
        _rec(2, 1.0, 1.000, [1.020], 1),  # one token: no TPOT
    ]
    samples = summarize(recs, rate=2.0)["samples"]
    assert samples["ttft_ms"] == [pytest.approx(50.0), None, pytest.approx(20.0)]
    assert samples["tpot_ms"] == [pytest.approx(10.0), None, None]
    assert samples["e2e_ms"] == [pytest.approx(70.0), None, pytest.approx(20.0)]
    # by request index, not by position: a window's records may come in any order
    assert summarize(recs[::-1], rate=2.0)["samples"] == samples
