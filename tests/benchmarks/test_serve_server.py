"""The serving benchmark's CPU side, its servers: waiting for a server's log line, settling a server
that captures while idle, and the plugin modes' configurations reaching each server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from benchmarks.serving import bench as serve
from benchmarks.serving import options as serve_options
from benchmarks.serving.server import DEFAULT_MODES, IDLE_CAPTURE_DONE, IDLE_CAPTURE_ON, \
    SERVE_MODES, Server


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
