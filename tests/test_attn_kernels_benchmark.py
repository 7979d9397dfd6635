"""The decode-attention kernel benchmark's CPU side: it refuses to run without CUDA, and says why
vLLM's FlashAttention 3 baseline cannot be measured where it cannot (the GPU run measures it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from benchmarks import attn_kernels

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-side checks")


def test_without_cuda_exits_2_naming_the_gpu(tmp_path):
    out = tmp_path / "attn.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.attn_kernels", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr
    assert not out.exists()


def test_flash_attn_baseline_absence_has_a_reason():
    reason = attn_kernels.flash_attn_problem()
    assert isinstance(reason, str) and reason
