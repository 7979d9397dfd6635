"""Shared fixtures: tiny local checkpoints and the CPU build of vLLM for end-to-end tests."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run under the interpreter on CPU tensors; this must be set before any
    # `@triton.jit` in vllm_moe_graphs.ops runs, whichever test module imports them first.
    # Helpers that start vLLM in subprocesses drop it again (tests/serve_util.cpu_env).
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = pathlib.Path(__file__).resolve().parents[1]
CPU_VLLM = REPO / ".cpu-vllm"


@pytest.fixture(scope="session", autouse=True)
def _triton_interpreter_active() -> None:
    """Without a GPU the kernels must run under the interpreter: fail loudly if something made
    `vllm_moe_graphs.ops` compile for real before TRITON_INTERPRET was set."""
    if torch.cuda.is_available():
        return
    from triton.runtime.interpreter import InterpretedFunction

    from vllm_moe_graphs.ops import paged_decode

    if not isinstance(paged_decode._paged_decode_kernel, InterpretedFunction):
        raise pytest.UsageError(
            "vllm_moe_graphs.ops was imported before TRITON_INTERPRET=1 was set and there is no "
            "GPU: run with TRITON_INTERPRET=1 in the environment"
        )


@pytest.fixture(autouse=True)
def _keep_vllm_logging_stream():
    """`moe-graphs` sends vLLM's logging to stderr by exporting VLLM_LOGGING_STREAM; a test that
    calls the command line in this process must not leave that to the tests after it (their
    subprocesses read vLLM's log on stdout)."""
    name = "VLLM_LOGGING_STREAM"
    before = os.environ.get(name)
    yield
    if before is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = before


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    from tests.tiny_models import build_checkpoint

    return build_checkpoint(str(tmp_path_factory.mktemp("tiny-qwen3")))


@pytest.fixture(scope="session")
def cpu_vllm() -> str:
    """Path of the CPU vLLM overlay (`scripts/setup.sh` installs it). CI must have it: there a
    missing overlay fails the test instead of skipping it."""
    if not (CPU_VLLM / ".overlay-done").is_file():
        msg = f"CPU vLLM overlay missing at {CPU_VLLM}: run scripts/setup.sh"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return str(CPU_VLLM)
