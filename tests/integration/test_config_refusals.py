"""Config time, on vLLM's own config code (CPU build): what the plugin refuses stays stock vLLM.

Each configuration below is built by `EngineArgs.create_engine_config`, as `vllm serve` builds
it, with the plugin's hooks in place and the platform check answering as on a CUDA host (the
CPU build is not CUDA, which would deny everything with `no_cuda`). A refused configuration keeps
vLLM's worker and the user's compilation settings; the reasons are the same after the config is
pickled to the engine processes. The default configuration is taken over (the control).
"""

from __future__ import annotations

import pytest

from tests.serve_util import run_result_script

pytestmark = pytest.mark.e2e

_BUILD = r"""
import json, os, pickle, sys, tempfile
from vllm_moe_graphs.integration import config_facts, hooks
config_facts._is_cuda = lambda: True  # decide as on a GPU host
from vllm.engine.arg_utils import EngineArgs


def shape(name, **edit):
    hf = json.load(open(f"vllm_moe_graphs/model_configs/{name}/config.json"))
    hf.update(num_hidden_layers=2, **edit)
    path = tempfile.mkdtemp()
    json.dump(hf, open(os.path.join(path, "config.json"), "w"))
    return path


dense, moe = shape("qwen3-0.6b"), shape("qwen3-30b-a3b")
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
block_fp8 = shape("qwen3-30b-a3b", quantization_config={**FP8, "weight_block_size": [128, 128]})
per_tensor_fp8 = shape("qwen3-30b-a3b", quantization_config=FP8)
cases = {
    "default": dict(model=dense),
    "explicit_route": dict(model=moe, compilation_config={"mode": "NONE",
                                                          "cudagraph_mode": "NONE"}),
    "dense_dp2": dict(model=dense, data_parallel_size=2),
    "sliding_window": dict(model=shape("qwen3-0.6b", use_sliding_window=True,
                                       sliding_window=1024)),
    "sliding_window_off": dict(model=shape("qwen3-0.6b", use_sliding_window=True,
                                           sliding_window=1024), disable_sliding_window=True),
    "pooling": dict(model=dense, runner="pooling"),
    "convert_embed": dict(model=dense, convert="embed"),
    "O3": dict(model=dense, optimization_level=3),
    "user_cudagraph_mode": dict(model=moe, compilation_config={
        "cudagraph_mode": "FULL_DECODE_ONLY"}),
    "user_compile": dict(model=dense, compilation_config={"mode": "VLLM_COMPILE"}),
    "online_fp8": dict(model=dense, quantization="fp8"),
    "block_fp8": dict(model=block_fp8),
    "fp8_per_block": dict(model=moe, quantization="fp8_per_block"),
    "online_fp8_moe": dict(model=moe, quantization="fp8"),
    "fp8_per_tensor_moe": dict(model=moe, quantization="fp8_per_tensor"),
    "per_tensor_fp8_checkpoint": dict(model=per_tensor_fp8),
    "moe_dp2": dict(model=moe, data_parallel_size=2),
    "fp8_kv": dict(model=dense, kv_cache_dtype="fp8"),
    "fp8_kv_calculated_scales": dict(model=dense, kv_cache_dtype="fp8", calculate_kv_scales=True),
}
# MOE_GRAPHS_UNPROVEN=fp8 (GPU proof runs): block FP8 taken over, per-tensor FP8 on MoE never
unproven_fp8 = {"block_fp8+unproven": dict(model=block_fp8),
                "fp8_per_block+unproven": dict(model=moe, quantization="fp8_per_block"),
                "online_fp8_moe+unproven": dict(model=moe, quantization="fp8")}
out = {}
for name, kwargs in [*cases.items(), *unproven_fp8.items()]:
    os.environ.pop("MOE_GRAPHS_UNPROVEN", None)
    if name in unproven_fp8:
        os.environ["MOE_GRAPHS_UNPROVEN"] = "fp8"
    vc = EngineArgs(skip_tokenizer_init=True, max_model_len=512, **kwargs).create_engine_config()
    cc = vc.compilation_config
    out[name] = {"worker_cls": vc.parallel_config.worker_cls, "mode": cc.mode.name,
                 "cudagraph_mode": cc.cudagraph_mode.name,
                 "reasons": [r.value for r in hooks.engine_capability(vc)[1].reasons],
                 "reasons_pickled": [r.value for r in hooks.engine_capability(
                     pickle.loads(pickle.dumps(vc)))[1].reasons]}
print("RESULT " + json.dumps(out))
"""

REFUSED = {
    "sliding_window": "sliding_window",
    "pooling": "pooling_runner",
    "convert_embed": "pooling_runner",
    "O3": "user_compilation",
    "user_cudagraph_mode": "user_compilation",
    "user_compile": "user_compilation",
    "online_fp8": "unsupported_quantization",
    "block_fp8": "unsupported_quantization",
    "fp8_per_block": "unsupported_quantization",
    "online_fp8_moe": "fp8_per_tensor_moe",
    "fp8_per_tensor_moe": "fp8_per_tensor_moe",
    "per_tensor_fp8_checkpoint": "fp8_per_tensor_moe",
    "online_fp8_moe+unproven": "fp8_per_tensor_moe",
    "moe_dp2": "data_parallel",
    "fp8_kv": "unsupported_dtype",
    "fp8_kv_calculated_scales": "unsupported_dtype",
}
TAKEN_OVER = ("default", "explicit_route", "dense_dp2", "sliding_window_off",
              "block_fp8+unproven", "fp8_per_block+unproven")


@pytest.fixture(scope="module")
def configs(cpu_vllm) -> dict:
    return run_result_script(_BUILD, cpu_vllm, timeout=600)


@pytest.mark.parametrize("case", TAKEN_OVER)
def test_taken_over(configs, case):
    c = configs[case]
    assert c["reasons"] == c["reasons_pickled"] == ["eligible"], c
    assert c["worker_cls"] == "vllm_moe_graphs.integration.worker.MoeGraphsWorker", c
    assert (c["mode"], c["cudagraph_mode"]) == ("NONE", "NONE"), c


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_left_to_stock_vllm(configs, case):
    c = configs[case]
    assert c["reasons"] == c["reasons_pickled"] == [REFUSED[case]], c
    assert c["worker_cls"] != "vllm_moe_graphs.integration.worker.MoeGraphsWorker", c
    # vLLM settled the compilation itself: torch.compile as it chose (the CPU platform's
    # variant here), nothing the plugin set
    assert c["mode"] != "NONE", c
