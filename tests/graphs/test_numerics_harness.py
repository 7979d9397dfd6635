"""The numerics test's harness (tests/graphs/numerics.py) end to end on vLLM's CPU build: two
engines on the tiny checkpoint (both stock here: the CPU build is not CUDA), the weights re-drawn
alike, greedy generation with logprobs, then teacher-forced scoring. On the GPU the first engine
is the plugin's; here the run checks the mechanics the GPU test relies on: the same weights in
both engines, scores aligned with the generated tokens (stock's greedy token is its own top-1
when it scores its own sequence), and `compare` on real outputs."""

from __future__ import annotations

import json

import pytest

from tests.graphs import numerics
from tests.serve_util import cpu_env
from tests.tiny_models import build_checkpoint

pytestmark = pytest.mark.e2e


def test_generate_and_score_align_on_the_cpu_build(cpu_vllm, tmp_path, monkeypatch):
    for key, value in cpu_env(cpu_vllm).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = build_checkpoint(str(tmp_path / "tiny"), head_dim=64)
    vocab = json.loads((tmp_path / "tiny" / "config.json").read_text())["vocab_size"]
    spec = {"llm_kwargs": {"model": model, "skip_tokenizer_init": True, "dtype": "float32",
                           "seed": 0, "max_model_len": 512, "enforce_eager": True},
            "prompts": numerics.prompts(vocab, n=4), "max_tokens": 8, "seed": 0}
    first = numerics.run(tmp_path, "first", spec, plugin=True, timeout_s=600)
    scored = [{"ids": p + t, "generated": len(t)}
              for p, t in zip(spec["prompts"], first["tokens"], strict=True)]
    stock = numerics.run(tmp_path, "stock", {**spec, "score": {"plugin_tokens": scored},
                                             "score_own": "stock_tokens"},
                         plugin=False, timeout_s=600)
    assert first["redrawn_parameters"] == stock["redrawn_parameters"] > 0
    assert first["tokens"] == stock["tokens"]  # same weights, same kernels here
    rows = stock["scores"]["stock_tokens"]
    assert [len(r) for r in rows] == [8] * 4
    own_top1 = [row[2] == tok for seq, r in zip(stock["tokens"], rows) for tok, row in zip(seq, r)]
    assert sum(own_top1) >= len(own_top1) - 1, rows  # greedy tokens are the scorer's top-1
    summary = numerics.compare(first, stock)
    assert summary["tokens"] == 32 and summary["identical_sequences"] == 4
    assert summary["floor_max"] < 0.05 and summary["plugin_max"] < 0.05, summary
    assert summary["mean_top1_logprob"] > numerics.INFORMATIVE_TOP1_LOGPROB, summary
