"""GPU tier: configurations the plugin refuses start and serve with stock vLLM.

Before the plugin refused them, a sliding-window Qwen3 crashed at start-up (vLLM rejects the
CUSTOM backend), a pooling runner ran every step eager, and -O3 or a user's cudagraph_mode were
dropped; quantized weights were taken over unproven. Each engine here (the tiny real checkpoint,
the plugin installed and loaded through its entry point, as for an operator) must start, serve,
report the refusal's reason on the plugin's metrics, and keep vLLM's own worker and compilation.
Data parallelism with an MoE model needs two GPUs: its refusal is checked at config time only
(tests/integration/test_config_refusals.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.gpu_util import (
    REPO,
    engine_env,
    engine_memory_kwargs,
    engine_timeout_s,
    require_cuda_and_vllm,
)
from tests.graphs.engine_harness import metric, report

pytestmark = pytest.mark.gpu

_ENGINE = r"""
import json, sys
spec = json.load(open(sys.argv[1]))
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from tests.gpu_util import engine_starting
from vllm_moe_graphs.metrics_transport import collect_text

with engine_starting():
    llm = LLM(**spec["llm_kwargs"])
prompts = [TokensPrompt(prompt_token_ids=[11 + i, 12, 13, 14 + i]) for i in range(4)]
if spec["llm_kwargs"].get("runner") == "pooling":
    served = [len(o.outputs.embedding) for o in llm.embed(prompts, use_tqdm=False)]
else:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False)
    served = [len(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                 use_tqdm=False)]
cfg = llm.llm_engine.vllm_config
json.dump({"served": served, "metrics": collect_text(),
           "worker_cls": cfg.parallel_config.worker_cls,
           "compilation_mode": cfg.compilation_config.mode.name,
           "cudagraph_mode": cfg.compilation_config.cudagraph_mode.name},
          open(spec["out"], "w"))
"""

CASES = {
    "sliding_window": ({"use_sliding_window": True, "sliding_window": 64}, {},
                       "sliding_window"),
    "pooling": ({}, {"runner": "pooling"}, "pooling_runner"),
    "O3": ({}, {"optimization_level": 3}, "user_compilation"),
    "user_cudagraph_mode": ({}, {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}},
                            "user_compilation"),
    "online_fp8": ({}, {"quantization": "fp8"}, "unsupported_quantization"),
}


@pytest.fixture(autouse=True)
def _needs_cuda_and_vllm():
    require_cuda_and_vllm()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    from tests.tiny_models import build_checkpoint

    return build_checkpoint(str(tmp_path_factory.mktemp("tiny") / "qwen3"), head_dim=64)


@pytest.mark.parametrize("case", list(CASES))
def test_refused_configuration_serves_with_stock_vllm(case, tiny_dir, tmp_path):
    hf_edit, llm_extra, reason = CASES[case]
    model = tmp_path / "model"
    subprocess.run(["cp", "-r", tiny_dir, str(model)], check=True)
    hf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**hf, **hf_edit}))
    out = tmp_path / "out.json"
    spec = {"out": str(out), "llm_kwargs": {
        "model": str(model), "dtype": "bfloat16", "seed": 0, "max_model_len": 256,
        "max_num_seqs": 16, **engine_memory_kwargs(0.1), **llm_extra}}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-c", _ENGINE, str(tmp_path / "spec.json")],
                          cwd=REPO, env=engine_env(), capture_output=True, text=True,
                          timeout=engine_timeout_s(300))
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(out.read_text())
    text = result.pop("metrics")
    result["reasons"] = sorted(r for r in ("sliding_window", "pooling_runner", "data_parallel",
                                           "user_compilation", "unsupported_quantization",
                                           "eligible")
                               if metric(text, "moe_graphs_capability", reason=r) == 1)
    result["mode_stock"] = metric(text, "moe_graphs_info", mode="stock")
    report(f"refusal-{case}", result)
    assert result["served"] and all(n > 0 for n in result["served"]), result
    assert result["reasons"] == [reason], result
    assert result["mode_stock"] == 1, result
    assert "MoeGraphsWorker" not in result["worker_cls"], result
    if case in ("O3", "user_cudagraph_mode"):  # what the user asked for, kept
        assert result["compilation_mode"] == "VLLM_COMPILE", result
    if case == "user_cudagraph_mode":
        assert result["cudagraph_mode"] == "FULL_DECODE_ONLY", result
