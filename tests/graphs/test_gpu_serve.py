"""GPU tier for the graph runner through a real `vllm serve` (vLLM 0.26.0): the kill file under
concurrent load, mixed traffic under faults, idle capture (every key captured while the server
waits, then served with no capture) and its recapture after a sleep and wake-up.
MOE_GRAPHS_TEST_OUT=/dir gets one JSON summary per test there."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
import json
import os
import random
import re
import time
import urllib.request

import pytest

from tests.gpu_util import require_cuda_and_vllm, serve_memory_args, sleep_or_wake
from tests.graphs.engine_harness import metric, report
from tests.graphs.engine_script import FAIL_FIRST_MIXED_CAPTURE
from tests.serve_util import get, post_json, tail, vllm_serve

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda_and_vllm():
    require_cuda_and_vllm()


def poll_metrics(base: str, what: str, ok: Callable[[str], bool], limit_s: float = 60.0) -> str:
    """The server's /metrics text once `ok` holds for it; fails after `limit_s` seconds."""
    end = time.monotonic() + limit_s
    while not ok(text := get(base + "/metrics")):
        assert time.monotonic() < end, f"no {what} within {limit_s:.0f} s"
        time.sleep(0.05)
    return text


def test_kill_file_under_load_through_vllm_serve(tmp_path):
    """200 concurrent requests through `vllm serve`; the kill file is created once graphs replay
    under that load and removed once /metrics shows the switch, while requests are still in
    flight. Zero failed requests; after removal a second wave replays again."""
    from tests.tiny_models import build_checkpoint

    path = build_checkpoint(str(tmp_path / "tiny-serve"), head_dim=64)
    kill_file = tmp_path / "serve.kill"
    log = str(tmp_path / "serve.log")
    fallbacks = "moe_graphs_eager_fallbacks_total"
    with vllm_serve(path, None, log, args=("--max-num-seqs", "64", *serve_memory_args(0.5)),
                    env_extra={"MOE_GRAPHS_KILL_FILE": str(kill_file)}) as base:
        def one(i: int, max_tokens: int = 200) -> int:
            body = {"model": path, "prompt": f"request {i} about graphs",
                    "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
            return len(post_json(base + "/v1/completions", body, timeout=300)["choices"][0]
                       ["text"])

        # NOTE: the switch is flipped on what /metrics shows, not on a timer: with no Triton
        # compile left to the first requests (start-up warm-up), the load can end within a
        # second, before a timed flip.
        with concurrent.futures.ThreadPoolExecutor(200) as pool:
            futures = [pool.submit(one, i) for i in range(200)]
            before = poll_metrics(base, "replay under load",
                                  lambda t: metric(t, "moe_graphs_replays_total") > 0)
            kill_file.touch()
            mid = poll_metrics(base, "kill-switch fallback",
                               lambda t: metric(t, fallbacks, reason="kill_switch") > 0)
            in_flight = sum(not f.done() for f in futures)
            kill_file.unlink()
            failures = [repr(f.exception()) for f in futures if f.exception() is not None]
            done = sum(f.result() >= 0 for f in futures if f.exception() is None)
        after_load = get(base + "/metrics")
        for i in range(8):  # a second wave, switch off: must replay again
            one(1000 + i, max_tokens=48)
        text = get(base + "/metrics")
    summary = {"failures": failures[:5], "failed": len(failures), "completed": done,
               "in_flight_when_switched": in_flight,
               "replays_before_switch": metric(before, "moe_graphs_replays_total"),
               "replays_after_load": metric(after_load, "moe_graphs_replays_total"),
               "replays": metric(text, "moe_graphs_replays_total"),
               "kill_switch_fallbacks": metric(text, fallbacks, reason="kill_switch"),
               "kill_switch_fallbacks_mid": metric(mid, fallbacks, reason="kill_switch"),
               "mode_graphs": metric(text, "moe_graphs_info", mode="graphs"),
               "log_tail": tail(log, 15)}
    report("serve-kill-switch", summary)
    assert summary["failed"] == 0 and done == 200, summary
    assert summary["mode_graphs"] == 1 and summary["replays_before_switch"] > 0, summary
    assert summary["kill_switch_fallbacks_mid"] > 0 and in_flight > 0, summary
    assert summary["replays"] > summary["replays_after_load"], summary  # switch off: replays


def test_mixed_traffic_faults_through_vllm_serve(tmp_path):
    """mixed_graphs through `vllm serve` (the tiny checkpoint, a 128-token step budget so long
    prompts chunk): 200 requests of 20-400 prompt tokens arriving over ~4 s; the first capture
    of a key with prefill tokens fails (quarantined), a 1 MiB pool budget denies every capture
    after the next one, and the kill file is created and removed twice under load. Zero failed
    requests, each with all its tokens. (Token identity under faults is the in-process test's:
    a server's batches depend on arrival timing, so two runs are not comparable token by
    token.)"""
    from tests.tiny_models import build_checkpoint

    path = build_checkpoint(str(tmp_path / "tiny-serve"), head_dim=64)
    vocab = json.loads((tmp_path / "tiny-serve" / "config.json").read_text())["vocab_size"]
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAIL_FIRST_MIXED_CAPTURE)
    kill_file = tmp_path / "serve.kill"
    log = str(tmp_path / "serve.log")
    fallbacks = "moe_graphs_eager_fallbacks_total"
    # lazy capture only (idle_capture false): the faults must meet the traffic, not the idle
    # engine before it
    cfg = {"moe_graphs": {"mixed_graphs": True, "graph_memory_budget_mib": 1,
                          "idle_capture": False}}
    rng = random.Random(2)
    # the first prompt is prefilled in four 128-token chunks: the first capture of a key with
    # prefill tokens (the one that fails) comes before any decode key's and the budget
    lengths = [400] + [rng.randrange(20, 400) for _ in range(199)]
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(n)] for n in lengths]
    env = {"MOE_GRAPHS_KILL_FILE": str(kill_file), "MOE_GRAPHS_TEST_FAIL_MIXED_CAPTURE": "1",
           "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    args = ("--max-num-seqs", "64", "--max-model-len", "512", "--max-num-batched-tokens",
            "128", "--enable-chunked-prefill", "--enable-prefix-caching",
            "--additional-config", json.dumps(cfg), *serve_memory_args(0.5))
    with vllm_serve(path, None, log, args=args, env_extra=env) as base:
        def one(i: int) -> int:
            time.sleep(i * 0.02)  # arrivals spread over ~4 s
            body = {"model": path, "prompt": prompts[i], "max_tokens": 512 - len(prompts[i]) - 8,
                    "temperature": 0.0, "ignore_eos": True}
            usage = post_json(base + "/v1/completions", body, timeout=300)["usage"]
            return usage["completion_tokens"] == body["max_tokens"]

        flips = []
        with concurrent.futures.ThreadPoolExecutor(200) as pool:
            futures = [pool.submit(one, i) for i in range(200)]
            for n in (1, 2):  # kill file on, seen, off, then replays again: twice
                poll_metrics(base, "replay under load",
                             lambda t: metric(t, "moe_graphs_replays_total") > 0)
                kill_file.touch()
                poll_metrics(base, "kill-switch fallback",
                             lambda t, n=n: metric(t, fallbacks, reason="kill_switch") >= n)
                flips.append(sum(not f.done() for f in futures))
                kill_file.unlink()
                time.sleep(0.5)
            failures = [repr(f.exception()) for f in futures if f.exception() is not None]
            complete = sum(bool(f.result()) for f in futures if f.exception() is None)
        text = get(base + "/metrics")
    summary = {"failures": failures[:5], "failed": len(failures), "complete": complete,
               "in_flight_at_flips": flips,
               "capture_failures": metric(text, "moe_graphs_capture_failures_total"),
               "captures": metric(text, "moe_graphs_captures_total"),
               **{f"replays_{k}": metric(text, "moe_graphs_replays_total", kind=k)
                  for k in ("decode", "mixed", "prefill")},
               **{f"{r}_fallbacks": metric(text, fallbacks, reason=r)
                  for r in ("kill_switch", "capture_failed", "memory_budget", "mixed_batch")},
               "mode_graphs": metric(text, "moe_graphs_info", mode="graphs"),
               "log_tail": tail(log, 15)}
    report("serve-mixed-faults", summary)
    assert summary["failed"] == 0 and complete == 200, summary
    assert summary["mode_graphs"] == 1 and min(flips) > 0, summary
    assert summary["capture_failures"] == 1 and summary["capture_failed_fallbacks"] > 0, summary
    assert summary["memory_budget_fallbacks"] > 0 and summary["kill_switch_fallbacks"] > 0, summary
    assert summary["mixed_batch_fallbacks"] == 0, summary  # every step with prefill planned


IDLE_SERVE_ARGS = ("--max-num-seqs", "16", "--max-model-len", "512", "--max-num-batched-tokens",
                   "128", "--enable-chunked-prefill", "--no-enable-prefix-caching")


def tiny_prompts(tmp_path, name: str, seed: int, count: int,
                 max_len: int) -> tuple[str, list[list[int]]]:
    """A tiny real checkpoint under `tmp_path / name` and `count` prompts of 20..`max_len`
    random token ids."""
    from tests.tiny_models import build_checkpoint

    path = build_checkpoint(str(tmp_path / name), head_dim=64)
    vocab = json.loads((tmp_path / name / "config.json").read_text())["vocab_size"]
    rng = random.Random(seed)
    return path, [[rng.randrange(10, vocab - 10) for _ in range(rng.randrange(20, max_len))]
                  for _ in range(count)]


def logged_keys(log: str) -> tuple[int, int]:
    """(decode keys, token buckets) a server will capture, from its start-up lines."""
    lines = [ln for ln in open(log) if "moe_graphs: graphs on:" in ln
             or "graphed too (mixed_graphs)" in ln]
    return (int(re.search(r"\((\d+) decode keys", lines[0]).group(1)),
            len(re.search(r"token buckets \[([^\]]*)\]", lines[1]).group(1).split(",")))


def test_idle_capture_captures_while_idle_then_serves_without_capture(tmp_path):
    """idle_capture through `vllm serve` (the tiny checkpoint, 16 sequences, a 128-token step
    budget, no prefix cache): ready as with lazy capture; then, with no request, the engine core
    captures every key (the token buckets, then the decode keys) one at a time; then 64
    requests arriving over ~2 s all complete, every step replayed, with no capture while
    serving; then 8 requests one at a time (the same steps each time) give the same greedy text
    from the idle-captured graphs as with the kill file present."""
    path, prompts = tiny_prompts(tmp_path, "tiny-idle", seed=3, count=64, max_len=300)
    log = str(tmp_path / "serve.log")
    kill_file = tmp_path / "serve.kill"
    args = (*IDLE_SERVE_ARGS,
            "--additional-config", json.dumps({"moe_graphs": {"idle_capture": True}}),
            *serve_memory_args(0.5))
    with vllm_serve(path, None, log, args=args,
                    env_extra={"MOE_GRAPHS_KILL_FILE": str(kill_file)}) as base:
        decode, tokens = logged_keys(log)
        t0 = time.monotonic()
        idle = poll_metrics(base, "every key captured while idle",
                            lambda t: metric(t, "moe_graphs_captures_total") >= decode + tokens)
        idle_s = time.monotonic() - t0

        def one(i: int) -> bool:
            time.sleep(i * 0.03)
            body = {"model": path, "prompt": prompts[i], "max_tokens": 64, "temperature": 0.0,
                    "ignore_eos": True}
            return post_json(base + "/v1/completions", body, timeout=300)["usage"][
                "completion_tokens"] == 64

        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            done = list(pool.map(one, range(64)))
        text = get(base + "/metrics")

        def sequential() -> list[str]:
            return [post_json(base + "/v1/completions",
                              {"model": path, "prompt": prompts[i], "max_tokens": 32,
                               "temperature": 0.0, "ignore_eos": True},
                              timeout=300)["choices"][0]["text"] for i in range(8)]

        graphed = sequential()
        kill_file.touch()
        time.sleep(0.5)  # the switch is re-read at most every 100 ms
        killed = sequential()
        kill_file.unlink()
        after = get(base + "/metrics")
    summary = {"keys": decode + tokens, "decode_keys": decode, "token_keys": tokens,
               "captured_while_idle": metric(idle, "moe_graphs_captures_total"),
               "idle_capture_s": round(idle_s, 1),
               "captures_after_traffic": metric(text, "moe_graphs_captures_total"),
               "complete": sum(done), "fallbacks": metric(text, "moe_graphs_eager_fallbacks_total"),
               **{f"replays_{k}": metric(text, "moe_graphs_replays_total", kind=k)
                  for k in ("decode", "mixed", "prefill")},
               "idle_capture_off": any("idle_capture off" in ln for ln in open(log)),
               "done_logged": sum("idle capture done: no key left" in ln for ln in open(log)),
               "sequential_identical": sum(a == b for a, b in zip(graphed, killed, strict=True)),
               "captures_at_end": metric(after, "moe_graphs_captures_total"),
               "step_captures_at_end": metric(after, "moe_graphs_step_captures_total"),
               "kill_switch_fallbacks": metric(after, "moe_graphs_eager_fallbacks_total",
                                               reason="kill_switch"),
               "log_tail": tail(log, 15)}
    report("serve-idle-capture", summary)
    assert summary["captured_while_idle"] == summary["keys"], summary
    assert summary["complete"] == 64 and not summary["idle_capture_off"], summary
    assert summary["done_logged"] == 1, summary  # the line the serving benchmark waits for
    assert summary["captures_after_traffic"] == summary["keys"], summary  # none while serving
    assert summary["fallbacks"] == 0 and summary["replays_decode"] > 0, summary
    assert summary["replays_mixed"] + summary["replays_prefill"] > 0, summary
    # the idle-captured graphs compute what eager steps of the same keys compute
    assert summary["sequential_identical"] == 8 and summary["kill_switch_fallbacks"] > 0, summary
    assert summary["captures_at_end"] == summary["keys"], summary
    assert summary["step_captures_at_end"] == 0, summary  # no step ever waited for a capture


def test_idle_capture_recaptures_after_wake_up_through_vllm_serve(tmp_path):
    """idle_capture across sleep mode through `vllm serve` (the tiny checkpoint; vLLM's dev API
    /sleep and /wake_up): every key captured while idle after start-up; a level-1 sleep and the
    wake-up drop the graphs; the wake-up, a client call the engine core handles while idle,
    resumes idle capture, which captures every key again and says it is done a second time, all
    before any request; then 4 requests one at a time give the same greedy text as before the
    sleep, every step replayed, with no capture while serving."""
    path, prompts = tiny_prompts(tmp_path, "tiny-wake", seed=4, count=4, max_len=200)
    log = str(tmp_path / "serve.log")
    args = (*IDLE_SERVE_ARGS, "--enable-sleep-mode",
            "--additional-config", json.dumps({"moe_graphs": {"idle_capture": True}}),
            *serve_memory_args(0.5))

    def sequential(base: str) -> list[str]:
        return [post_json(base + "/v1/completions",
                          {"model": path, "prompt": p, "max_tokens": 32, "temperature": 0.0,
                           "ignore_eos": True}, timeout=300)["choices"][0]["text"]
                for p in prompts]

    def post(url: str) -> None:
        urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"),
                               timeout=120).read()

    def done_lines() -> int:
        return sum("idle capture done: no key left" in ln for ln in open(log))

    with vllm_serve(path, None, log, args=args, env_extra={"VLLM_SERVER_DEV_MODE": "1"}) as base:
        keys = sum(logged_keys(log))
        poll_metrics(base, "every key captured while idle",
                     lambda t: metric(t, "moe_graphs_captures_total") >= keys)
        before = sequential(base)
        captured = metric(get(base + "/metrics"), "moe_graphs_captures_total")
        with sleep_or_wake():
            post(base + "/sleep?level=1")
            asleep = json.loads(get(base + "/is_sleeping"))["is_sleeping"]
            post(base + "/wake_up")
        t0 = time.monotonic()
        woken = poll_metrics(base, "every key captured again after the wake-up",
                             lambda t: metric(t, "moe_graphs_captures_total") >= captured + keys)
        recapture_s = time.monotonic() - t0
        deadline = time.monotonic() + 10  # the done line follows the last capture's metrics
        while done_lines() < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        after = sequential(base)
        text = get(base + "/metrics")
    summary = {"keys": keys, "captured_before_sleep": captured, "asleep": asleep,
               "captures_after_wake": metric(woken, "moe_graphs_captures_total") - captured,
               "recapture_s": round(recapture_s, 1),
               "invalidations": metric(text, "moe_graphs_invalidations_total"),
               "done_logged": done_lines(),
               "identical_after_wake": sum(a == b for a, b in zip(before, after, strict=True)),
               "captures_while_serving": metric(text, "moe_graphs_captures_total")
               - metric(woken, "moe_graphs_captures_total"),
               "step_captures": metric(text, "moe_graphs_step_captures_total"),
               "fallbacks": metric(text, "moe_graphs_eager_fallbacks_total"),
               "replays_decode": metric(text, "moe_graphs_replays_total", kind="decode"),
               "log_tail": tail(log, 15)}
    report("serve-idle-capture-wake-up", summary)
    assert summary["asleep"] is True and summary["invalidations"] > 0, summary
    assert summary["captured_before_sleep"] == keys, summary  # every key, none while serving
    assert summary["captures_after_wake"] == keys and summary["done_logged"] == 2, summary
    assert summary["identical_after_wake"] == 4, summary
    assert summary["captures_while_serving"] == 0 and summary["fallbacks"] == 0, summary
    assert summary["replays_decode"] > 0 and summary["step_captures"] == 0, summary
