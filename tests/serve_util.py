"""Start and stop a real `vllm serve` (CPU build, or the GPU host's vLLM) for end-to-end tests."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence

from benchmarks.serve_server import free_port, stop_process_group
from benchmarks.serve_server import http_get as get


def metric_sum(text: str, name: str, **labels: str) -> float | None:
    """Sum of the samples of `name` whose labels include `labels`, in Prometheus exposition
    text (None: no such sample)."""
    total = None
    for line in text.splitlines():
        m = re.match(rf"^{name}(?:\{{(.*)\}})? (\S+)$", line)
        if not m:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total = (total or 0.0) + float(m.group(2))
    return total


def post_json(url: str, body: dict, timeout: float = 60) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode())


def cpu_env(cpu_vllm: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("MOE_GRAPHS_DISABLE", None)
    env.pop("MOE_GRAPHS_METRICS_DIR", None)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.pop("TRITON_INTERPRET", None)  # set by the kernel tests; vLLM runs stock here
    env.update(PYTHONPATH=cpu_vllm, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def run_result_script(code: str, cpu_vllm: str, timeout: float = 600,
                      argv: Sequence[str] = (), **env: str) -> dict:
    """Run `code` (given a free port as argv[1], then `argv`) in a subprocess on the CPU build of
    vLLM from the repository root; return the JSON of its last `RESULT {...}` line."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code, str(free_port()), *argv], cwd=repo,
                          env=cpu_env(cpu_vllm, **env), capture_output=True, text=True,
                          timeout=timeout)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@contextlib.contextmanager
def vllm_serve(model: str, cpu_vllm: str | None, log_path: str, args: tuple[str, ...] = (),
               env_extra: dict[str, str] | None = None,
               start_timeout: float = 420) -> Iterator[str]:
    """Yield the base URL of a running server; its output goes to `log_path`. With `cpu_vllm`
    (the CPU build's path) the server runs eager on the CPU; with None it runs on this host's
    vLLM and GPU, graphs allowed."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--port",
           str(port), "--host", "127.0.0.1", "--max-model-len", "256", "--dtype", "bfloat16",
           *(("--enforce-eager",) if cpu_vllm else ()), *args]
    if cpu_vllm:
        env = cpu_env(cpu_vllm, **(env_extra or {}))
    else:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_GRAPHS_")}
        env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", PYTHONUNBUFFERED="1",
                   **(env_extra or {}))
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n"
                                   f"{tail(log_path)}")
            with contextlib.suppress(OSError):
                if get(base + "/health", timeout=2) is not None:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve not ready after {start_timeout} s:\n"
                                   f"{tail(log_path)}")
            time.sleep(1)
        yield base
    finally:
        stop_process_group(proc)
        log.close()


def tail(path: str, n: int = 60) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])
