"""GPU tier for the foundation: the plugin on a CUDA machine with real vLLM 0.26.0."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

from tests.gpu_util import engine_starting, require_cuda_and_vllm, serve_memory_args

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda():
    require_cuda_and_vllm()


def _run(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                          timeout=timeout)


def test_register_does_not_initialise_cuda():
    proc = _run("-c", textwrap.dedent("""
        import torch
        from vllm_moe_graphs.plugin import register
        register()
        from vllm.platforms import current_platform
        print("CUDA_INIT", torch.cuda.is_initialized(), current_platform.is_cuda())
    """))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CUDA_INIT False True" in proc.stdout


@pytest.mark.parametrize("argv", [
    ("qwen3-0.6b",),
    ("qwen3-30b-a3b", "--cpu-offload-gb", "8", "--cpu-offload-params", "experts"),
])
def test_doctor_eligible_on_cuda(argv):
    proc = _run("-m", "vllm_moe_graphs.cli.main", "doctor", *argv)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "eligible:" in proc.stdout


def test_doctor_denies_llama_on_cuda(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')
    proc = _run("-m", "vllm_moe_graphs.cli.main", "doctor", str(tmp_path))
    assert proc.returncode == 1
    assert "unsupported_architecture" in proc.stdout and "no_cuda" not in proc.stdout


def test_demo_runs_and_reports():
    # in the tier's lanes the demo's engine takes a fixed KV cache, as the other lanes' engines
    # do (a share of the device fails vLLM's free-memory check beside them), and holds the
    # lanes lock shared for its whole run: its start is inside the subprocess
    with engine_starting():
        proc = _run("-m", "vllm_moe_graphs.cli.main", "demo", "--num-layers", "2", "--batch", "4",
                    "--max-tokens", "16", *serve_memory_args(0.5), timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tokens/s" in proc.stdout
    # recorded in the engine process, collected through the metrics transport
    assert "capability: " in proc.stdout and "not recorded" not in proc.stdout
    # the plugin took decode graphs over: eligible, and decode steps replayed
    assert "capability: eligible" in proc.stdout, proc.stdout[-3000:]
    replays = re.search(r"graph replays: (\d+)", proc.stdout)
    assert replays and int(replays.group(1)) > 0, proc.stdout[-3000:]
