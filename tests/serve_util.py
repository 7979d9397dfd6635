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

from benchmarks.serving.server import free_port, stop_process_group
from benchmarks.serving.server import http_get as get
from tests.gpu_util import engine_starting


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


# `build(head_dim, dtype, port=None)`: a tiny Qwen3 (2 layers, hidden 128) built in-process by
# vLLM 0.26's own model class on its CPU build; the first build of a process passes a free port
# (vLLM's distributed state). Prefix of a `run_result_script` script.
QWEN3_BUILD = r"""
import json, sys, tempfile
import torch
from transformers import Qwen3Config
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

def build(head_dim, dtype, port=None):
    path = tempfile.mkdtemp()
    Qwen3Config(architectures=["Qwen3ForCausalLM"], vocab_size=128, hidden_size=128,
                intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=head_dim,
                max_position_embeddings=256).save_pretrained(path)
    vc = VllmConfig(model_config=ModelConfig(model=path, skip_tokenizer_init=True, dtype=dtype))
    with set_current_vllm_config(vc):
        if port:
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{port}")
            initialize_model_parallel(1, 1)
        old = torch.get_default_dtype()
        torch.set_default_dtype(getattr(torch, dtype))  # what vLLM's loader does
        try:
            return Qwen3ForCausalLM(vllm_config=vc, prefix="")
        finally:
            torch.set_default_dtype(old)

"""

# A tiny Qwen3-MoE (2 layers, Qwen3-30B-A3B's 128 experts and top-8), built in-process by vLLM
# 0.26's own model class on its CPU build (`run_on_tiny_qwen3_moe`).
TINY_QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=128, hidden_size=64,
                      intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=128,
                      num_experts_per_tok=8, max_position_embeddings=256)

_QWEN3_MOE_BUILD = r"""
import json, sys, tempfile
import torch
from transformers import Qwen3MoeConfig
from vllm.config import CompilationConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.config.compilation import CompilationMode
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

path = tempfile.mkdtemp()
Qwen3MoeConfig(**json.loads(sys.argv[2])).save_pretrained(path)
compilation = {} if sys.argv[3] == "default" else {
    "compilation_config": CompilationConfig(mode=CompilationMode[sys.argv[3]])}
vc = VllmConfig(model_config=ModelConfig(model=path, skip_tokenizer_init=True, dtype="bfloat16"),
                **compilation)
with set_current_vllm_config(vc):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{sys.argv[1]}")
    initialize_model_parallel(1, 1)
    torch.set_default_dtype(torch.bfloat16)
    model = Qwen3MoeForCausalLM(vllm_config=vc, prefix="")
"""


def run_on_tiny_qwen3_moe(body: str, cpu_vllm: str, compilation_mode: str = "default",
                          env: dict[str, str] | None = None, **config: object) -> dict:
    """Build `TINY_QWEN3_MOE` (updated with `config`) with vLLM's `Qwen3MoeForCausalLM` on the
    CPU build (`compilation_mode`: a `CompilationMode` name, or vLLM's default), then run
    `body` (names `model`, `vc`, `torch`, `json` defined; it prints `RESULT {...}`) with `env`
    added to the environment; return its result."""
    return run_result_script(_QWEN3_MOE_BUILD + body, cpu_vllm,
                             argv=(json.dumps({**TINY_QWEN3_MOE, **config}), compilation_mode),
                             **(env or {}))


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
    base = f"http://127.0.0.1:{port}"
    proc = None
    try:
        # on the GPU, the start until ready is an engine start for the GPU tier's lanes
        with engine_starting() if cpu_vllm is None else contextlib.nullcontext():
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
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
        if proc is not None:
            stop_process_group(proc)
        log.close()


def tail(path: str, n: int = 60) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])
