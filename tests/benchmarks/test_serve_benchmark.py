"""The serving benchmark's CPU side: workloads and arrivals, the load statistics, the /metrics
step counters and log facts, ratio keys, saturation, the result schema and the CLI; and one run
end to end through real `vllm serve` (the CPU build) with a tiny checkpoint."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from benchmarks.harness.machine import gpu_problem
from benchmarks.serving import bench as serve
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
from benchmarks.harness.stats import percentile
from benchmarks.serving.server import DEFAULT_MODES, IDLE_CAPTURE_DONE, IDLE_CAPTURE_ON, \
    OFFLOAD_READY_EXTRA_S, SERVE_MODES, Server, log_facts, step_counters, step_shares
from tests.serve_util import cpu_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


# -- ratios, saturation, schema -----------------------------------------------------------------
def _row(mode, rate, ttft, tpot, otps, workload="chat"):
    d = lambda v: {"p50": v, "p90": v, "p99": 2 * v, "mean": v}  # noqa: E731
    return {"model": "m", "mode": mode, "workload": workload, "rate": rate, "requests": 10,
            "completed": 10, "failed": 0, "ttft_ms": d(ttft), "tpot_ms": d(tpot),
            "itl_ms": d(tpot), "e2e_ms": d(ttft + 100 * tpot), "send_lag_ms": d(0.5),
            "output_tokens_per_s": otps, "requests_per_s": 1.0, "steps": {}}


def _stand_in_server() -> subprocess.Popen:
    """A process group standing in for `vllm serve`, which `Server.stop` ends with SIGINT as it
    does vLLM's: SIGINT set back to its default action, since a shell that starts the tests in
    the background hands them SIGINT ignored (Python then installs no handler for it)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, "
         "signal.SIG_DFL); print('ready', flush=True); time.sleep(60)"],
        start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"  # SIGINT ends it from here on
    return proc


def test_wait_for_log_sees_the_settled_line_times_out_and_notices_an_exit(tmp_path):
    """A server with idle capture settles on the plugin's "idle capture done" line: the wait
    returns once the line is in the log, None when it is not within the timeout, and raises
    when the server exits meanwhile."""
    line = IDLE_CAPTURE_DONE
    # the plugin's own line (integration/startup/precapture.py: idle_capture_one)
    src = open(os.path.join(REPO, "vllm_moe_graphs", "integration", "startup",
                            "precapture.py")).read()
    assert '"moe_graphs: idle capture done: no key left' in src
    assert f'", {IDLE_CAPTURE_ON}"' in src  # the start-up line of a server that will settle
    log = tmp_path / "serve.log"
    log.write_text("INFO: Application startup complete.\n")
    server = Server(tmp_path, [], {}, log)
    server._proc = _stand_in_server()
    try:
        assert server.wait_for_log(line, 0.6) is None
        threading.Timer(0.5, lambda: log.write_text(
            log.read_text() + "INFO moe_graphs: idle capture done: no key left to capture "
            "(57 graphs, 0 quarantined, 0 denied now, pool 700 MiB)\n")).start()
        assert 0.3 < server.wait_for_log(line, 20) < 15
    finally:
        server.stop()
    server._proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    server._proc.wait()
    with pytest.raises(RuntimeError, match="exited while waiting"):
        server.wait_for_log("never logged", 20)


def test_settle_waits_only_for_a_server_that_captures_while_idle(tmp_path):
    log = tmp_path / "serve.log"
    log.write_text("moe_graphs: graphs are captured lazily, on first use of each key after 1 "
                   "warm-up steps\n")  # no idle_capture: no line to wait for
    server = Server(tmp_path, [], {}, log)
    args = serve_options.parser().parse_args(["--settle-timeout-s", "30"])
    info, said = {}, []
    serve._settle(server, args, info, said.append)
    assert info == {"settle_s": None} and "nothing to settle" in said[0]
    log.write_text(f"moe_graphs: graphs are captured lazily, ..., {IDLE_CAPTURE_ON}\n"
                   f"{IDLE_CAPTURE_DONE}: no key left to capture (3 graphs, 0 quarantined, "
                   "pool 1 MiB)\n")
    server._proc = _stand_in_server()
    try:
        serve._settle(server, args, info, said.append)
    finally:
        server.stop()
    assert info["settle_s"] is not None and info["settle_s"] < 5 and "settled" in said[1]


def test_settle_stops_waiting_once_idle_capture_stalls(tmp_path):
    """A server that says it captures while idle but never logs the done line: the wait goes on
    while /metrics shows captures growing, and ends --settle-stall-s after the last one (not at
    --settle-timeout-s); the benchmark measures anyway."""
    import http.server

    served = []

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            served.append(self.path)
            count = min(len(served), 4)  # 4 captures, one per scrape, then none
            body = (f'moe_graphs_captures_total{{kind="decode"}} {count}\n').encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    log = tmp_path / "serve.log"
    log.write_text(f"moe_graphs: graphs are captured lazily, ..., {IDLE_CAPTURE_ON}\n")
    server = Server(tmp_path, [], {}, log)
    server.base_url = f"http://127.0.0.1:{httpd.server_address[1]}"
    server._proc = _stand_in_server()
    args = serve_options.parser().parse_args(["--settle-timeout-s", "60", "--settle-stall-s", "1"])
    info, said = {}, []
    t0 = time.monotonic()
    try:
        serve._settle(server, args, info, said.append)
        waited = time.monotonic() - t0
    finally:
        server.stop()
        httpd.shutdown()
    assert info == {"settle_s": None}, info
    assert "no capture in the last 1 s" in said[0] and "measuring anyway" in said[0], said
    assert len(served) >= 6 and 2.0 < waited < 20, (served, waited)  # past the 4 captures
    with pytest.raises(SystemExit):
        serve_options.parser().parse_args(["--settle-stall-s", "x"])
    with pytest.raises(ValueError, match="--settle-stall-s must be > 0, got 0.0"):
        serve_options.Plan(serve_options.parser().parse_args(["--settle-stall-s", "0"]))


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


def test_fine_token_mode_halves_the_bucket_spacing_from_2048_tokens():
    from vllm_moe_graphs.config import TOKEN_BUCKETS, PluginConfig

    mode = SERVE_MODES["plugin_fine_tokens"]
    assert "plugin_fine_tokens" not in DEFAULT_MODES
    fine = PluginConfig.from_dict(mode.settings).token_buckets
    assert set(TOKEN_BUCKETS) <= set(fine) and fine[-1] == TOKEN_BUCKETS[-1] == 8192
    assert len(fine) == len(TOKEN_BUCKETS) + 16  # 16 new buckets between the default ones

    def gaps(buckets, lo, hi):
        return {b - a for a, b in zip(buckets, buckets[1:]) if lo <= a < hi}

    assert gaps(TOKEN_BUCKETS, 2048, 4096) == {256} and gaps(fine, 2048, 4096) == {128}
    assert gaps(TOKEN_BUCKETS, 4096, 8192) == {512} and gaps(fine, 4096, 8192) == {256}
    assert [b for b in fine if b < 2048] == [b for b in TOKEN_BUCKETS if b < 2048]


def test_eager_long_steps_mode_stops_the_token_buckets_at_4096():
    from vllm_moe_graphs.config import TOKEN_BUCKETS, PluginConfig
    from vllm_moe_graphs.graphs.buckets import graph_config

    mode = SERVE_MODES["plugin_eager_long_steps"]
    assert "plugin_eager_long_steps" not in DEFAULT_MODES
    short = PluginConfig.from_dict(mode.settings)
    assert short.token_buckets == tuple(b for b in TOKEN_BUCKETS if b <= 4096)
    assert short.token_buckets[-1] == 4096
    # fitted to vllm serve's 8192-token step budget, the ceiling stays: past it, eager
    assert graph_config(short, 1024, 40960, 8192).token_buckets[-1] == 4096


def test_wide_mixed_keys_mode_pads_mixed_requests_to_the_largest_decode_bucket():
    from vllm_moe_graphs.config import PluginConfig

    mode = SERVE_MODES["plugin_wide_mixed_keys"]
    assert "plugin_wide_mixed_keys" not in DEFAULT_MODES
    cfg = PluginConfig.from_dict(mode.settings)
    assert cfg.mixed_requests == cfg.decode_batch_buckets[-1] == 1024
    assert PluginConfig().mixed_requests == 256


def test_every_plugin_mode_passes_a_valid_plugin_config():
    from vllm_moe_graphs.config import PluginConfig

    for name, mode in SERVE_MODES.items():
        assert mode.plugin == name.startswith("plugin"), name
        if not mode.settings:
            continue
        cfg = PluginConfig.from_dict(mode.settings)
        assert name.startswith("plugin_") and cfg.enabled, name
        assert cfg != PluginConfig(), f"{name} sets nothing the defaults do not"


def test_plugin_config_reaches_every_plugin_server_under_the_modes_own(tmp_path):
    """--plugin-config: every plugin mode's server gets it (a mode's own settings win), no
    stock server does; idle_capture in it makes the plugin's servers settle after ready."""
    args = serve_options.parser().parse_args([
        "--model", "qwen3-0.6b", "--log-dir", str(tmp_path), "--plugin-config",
        '{"skip_moe_padding": true, "idle_capture": true, "mixed_graphs": true}'])
    plan = serve_options.Plan(args)

    def settings(mode):
        a = plan.server_args(SERVE_MODES[mode], "default", [], 29)
        if "--additional-config" not in a:
            return None
        return json.loads(a[a.index("--additional-config") + 1])["moe_graphs"]

    assert settings("plugin") == {"skip_moe_padding": True, "idle_capture": True,
                                  "mixed_graphs": True}
    assert settings("plugin_decode_only") == {"skip_moe_padding": True, "idle_capture": True,
                                              "mixed_graphs": False}
    assert settings("stock") is None and settings("stock_triton") is None
    assert plan.settles(SERVE_MODES["plugin"])
    assert not plan.settles(SERVE_MODES["stock"])
    plain = serve_options.Plan(serve_options.parser().parse_args(
        ["--model", "qwen3-0.6b", "--log-dir", str(tmp_path)]))
    assert plain.server_args(SERVE_MODES["plugin"], "default", [], 29)[-1] == "qwen3-0.6b"
    assert plain.settles(SERVE_MODES["plugin"])  # idle_capture is on by default
    assert not plain.settles(SERVE_MODES["plugin_lazy_capture"])
    assert not plain.settles(SERVE_MODES["stock"])
    # settling counts in the time budget's estimate
    assert serve_options.mode_cost_s(plain, SERVE_MODES["plugin"], args) == pytest.approx(
        serve_options.mode_cost_s(plain, SERVE_MODES["plugin_lazy_capture"], args) + 30.0)


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


# -- CLI ----------------------------------------------------------------------------------------
def _cli(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "benchmarks.serving", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_help_documents_every_option():
    out = _cli("--help").stdout
    for action in serve_options.parser()._actions:
        for flag in action.option_strings:
            assert flag in out
    for name in ("plugin", "stock_triton", "moe_offload", "qwen3-30b-a3b", "merge", "targets"):
        assert name in out
    for mode in SERVE_MODES.values():  # a long name sits on its own line, not run on
        assert f"  {mode.name} " in out or f"  {mode.name}\n" in out, mode.name


def test_dry_run_prints_the_plan_and_whether_it_fits_the_budget(tmp_path):
    common = ("--model", "qwen3-30b-a3b", "--modes", "plugin,stock", "--workloads",
              "chat,moe_offload", "--rates", "chat:4,16", "--rates", "moe_offload:0.5",
              "--duration-s", "8", "--plugin-config", '{"idle_capture": true}',
              "--results-dir", str(tmp_path), "--dry-run")
    small = _cli(*common, "--time-budget-s", "200")
    assert small.returncode == 0, small.stderr
    out = small.stdout
    args = serve_options.parser().parse_args(list(common))
    plan = serve_options.Plan(args)
    costs = {m.name: serve_options.mode_cost_s(plan, m, args) for m in plan.modes}
    for name, cost in costs.items():
        assert f"{name}: ~{cost:.0f} s" in out
    assert f"total ~{sum(costs.values()):.0f} s" in out and "does NOT fit" in out
    assert "server moe_offload" in out and "--cpu-offload-gb 29" in out
    assert "r4 32 requests, r16 128 requests" in out  # max(--min-requests, rate x duration)
    assert out.count("settling its idle capture") == 2  # plugin's two servers, not stock's
    assert not list(tmp_path.iterdir())  # nothing written, no server started
    temp = tmp_path / "tmp"
    temp.mkdir()
    big = _cli(*common, "--time-budget-s", "5000", env={**os.environ, "TMPDIR": str(temp)})
    assert big.returncode == 0 and big.stdout.splitlines()[-1].endswith(": fits")
    assert "logs in a new temporary folder" in big.stdout
    assert not list(temp.iterdir())  # the shape's config folder it planned with is gone


@pytest.mark.skipif(gpu_problem() is None, reason="this machine has a GPU")
def test_without_gpu_fails_fast_with_the_reason(tmp_path):
    proc = _cli("--results-dir", str(tmp_path))
    assert proc.returncode == serve.EXIT_NO_GPU
    assert "needs an NVIDIA GPU" in proc.stderr and "--allow-cpu" in proc.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("args,msg", [
    (["--rates", "chat:0"], "positive rates"),
    (["--modes", "stock,turbo"], "unknown mode(s) turbo"),
    (["--workloads", "moe_offload"], "needs a MoE model"),
    (["--model", "/nonexistent"], "neither a shipped shape"),
    (["--rates", "long:1", "--workloads", "chat"], "'long', which is not run"),
    (["--lengths", "chat:10-5:1-2"], "PMIN-PMAX"),
    (["--plugin-config", '{"warmup_steps": -1}'], "warmup_steps"),
    (["--plugin-config", "skip_moe_padding"], "JSON object of moe_graphs settings"),
])
def test_bad_options_name_the_value(args, msg):
    proc = _cli(*args)
    assert proc.returncode == serve.EXIT_USAGE and msg in proc.stderr, proc.stderr


# -- end to end ---------------------------------------------------------------------------------
@pytest.mark.e2e
def test_serve_benchmark_end_to_end_on_cpu_vllm(tiny_qwen3, cpu_vllm, tmp_path):
    """Two modes through real `vllm serve` (CPU build, eager): every request completes, the
    plugin's server registered the plugin and the stock one did not, ratios and saturation are
    computed, and the same requests went to both modes."""
    proc = _cli("--model", tiny_qwen3, "--modes", "plugin,stock", "--workloads",
                "chat,chat_sampled", "--rates", "chat:1,2", "--rates", "chat_sampled:2",
                "--lengths", "chat:16-48:4-6", "--lengths", "chat_sampled:16-48:4-6",
                "--duration-s", "2",
                "--min-requests", "3", "--warmup-s", "1", "--clients", "2", "--allow-cpu",
                "--server-arg=--enforce-eager", "--name", "e2e", "--results-dir",
                str(tmp_path), "--log-dir", str(tmp_path / "logs"), "--no-plot",
                env=cpu_env(cpu_vllm), timeout=300)  # two CPU servers start: 40-60 s each
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "e2e.json").read_text())
    serve_report.check_schema(doc)
    assert len(doc["rows"]) == 6 and not doc["skipped"]
    for row in doc["rows"]:
        assert row["failed"] == 0 and row["completed"] == row["requests"] >= 3, row
        assert 0 < row["ttft_ms"]["p50"] <= row["e2e_ms"]["p50"]
        assert row["output_tokens"] >= 4 * row["completed"]
        assert row["steps"]["engine_steps"] > 0
    by_mode = {(r["mode"], r["rate"]): r for r in doc["rows"] if r["workload"] == "chat"}
    assert by_mode[("plugin", 2)]["output_tokens"] == by_mode[("stock", 2)]["output_tokens"]
    assert "replays" in by_mode[("plugin", 1)]["steps"]
    assert "replays" not in by_mode[("stock", 1)]["steps"]
    assert doc["modes"]["plugin"]["servers"]["default"]["plugin"]
    for mode in ("plugin", "stock"):  # the same warm-up in every mode, at every measured rate
        warmups = doc["modes"][mode]["servers"]["default"]["warmup"]["chat"]
        assert [w["rate"] for w in warmups] == [1, 2] and not any(w["failed"] for w in warmups)
    assert doc["modes"]["stock"]["servers"]["default"]["plugin"] is None
    assert "ttft_p50_stock_over_plugin/tiny/chat/r2" in doc["ratios"] or any(
        k.startswith("ttft_p50_stock_over_plugin/") for k in doc["ratios"])
    assert set(doc["saturation"]) == {"plugin/chat", "stock/chat", "plugin/chat_sampled",
                                      "stock/chat_sampled"}
    assert doc["workloads"]["chat_sampled"]["sampling"]["top_k"] == 20
    assert "ratios (stock time / plugin time" in proc.stdout


def test_time_budget_weights_modes_by_their_cost(tmp_path):
    args = serve_options.parser().parse_args(["--model", "qwen3-30b-a3b", "--rates", "chat:4,8",
                                      "--rates", "long:1", "--rates", "moe_offload:2",
                                      "--log-dir", str(tmp_path)])
    plan = serve_options.Plan(args)
    plugin, stock = (serve_options.mode_cost_s(plan, SERVE_MODES[m], args)
                     for m in ("plugin", "stock"))
    # warm-ups at every measured rate by default: chat at 4 and 8, long at 1, moe_offload at 2
    windows = 4 * (args.warmup_s + 8) + sum(serve_options.window_s(args, r) for r in (4, 8, 1, 2))
    # two plugin servers, each settling its idle capture after ready (30 s by estimate)
    assert plugin == pytest.approx(2 * (60 + 30) + OFFLOAD_READY_EXTRA_S + windows)
    assert stock - plugin == pytest.approx(2 * 10)
    args.warmup_rates = "max"  # one warm-up per workload, at its highest rate
    assert serve_options.mode_cost_s(plan, SERVE_MODES["plugin"], args) == pytest.approx(
        plugin - (args.warmup_s + 8))
    assert serve_options.warmup_rates(args, [8, 2, 4]) == [8]
    args.warmup_rates = "all"
    assert serve_options.warmup_rates(args, [8, 2, 4, 2]) == [2, 4, 8]
