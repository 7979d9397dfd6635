"""The decode-attention kernel benchmark's CPU side: it refuses to run without CUDA, and says why
vLLM's FlashAttention 3 baseline cannot be measured where it cannot (the GPU run measures it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from benchmarks.kernels import attn_case

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-side checks")


@pytest.mark.parametrize("module", ["benchmarks.kernels.attn", "benchmarks.kernels.prefill",
                                    "benchmarks.kernels.router"])
def test_without_cuda_exits_2_naming_the_gpu(module, tmp_path):
    out = tmp_path / "attn.json"
    proc = subprocess.run([sys.executable, "-m", module, "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr
    assert not out.exists()


def test_router_benchmark_names_a_bad_value(capsys):
    from benchmarks.kernels import router as router_kernels

    with pytest.raises(SystemExit):
        router_kernels.parse_args(["--out", "x.json", "--rows", "1,0"])
    assert "--rows [1, 0]" in capsys.readouterr().err
    assert router_kernels.parse_args(["--out", "x.json"]).rows[-1] == 8192


def test_flash_attn_baseline_absence_has_a_reason():
    reason = attn_case.flash_attn_problem()
    assert isinstance(reason, str) and reason


# -- the prefill-attention benchmark (benchmarks/kernels/prefill.py) ---------------------------
def test_prefill_cases_parse_into_steps():
    from benchmarks.kernels.prefill import parse_case, token_bucket

    assert parse_case("prefill:512").requests == ((512, 0),)
    assert parse_case("chunk:2048@4096").requests == ((2048, 4096),)
    mixed = parse_case("mixed:3@1024+100")
    assert mixed.requests == ((1, 1023),) * 3 + ((100, 0),)
    assert (mixed.tokens, mixed.max_query_len, mixed.max_seq_len) == (103, 100, 1024)
    assert [token_bucket(n) for n in (1, 16, 17, 103, 300, 4096, 5000, 9000)] == [
        16, 16, 32, 128, 320, 4096, 5120, 9000]
    # causal FLOPs: one 2-token prompt sees 1 + 2 keys; 4 * keys * heads * head size
    assert parse_case("prefill:2").flops(1, 1) == 12.0


@pytest.mark.parametrize("spec", ["prefill:", "chunk:5", "mixed:3+100", "decode:4", "prefill:0"])
def test_bad_prefill_case_names_the_value_and_the_forms(spec, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.kernels.prefill", "--out",
                           str(tmp_path / "x.json"), "--cases", spec],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and repr(spec) in proc.stderr and "mixed:D@C+L" in proc.stderr
