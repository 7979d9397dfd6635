"""Padding rows skip the fused MoE's experts (`integration/moe_padding.py`).

CPU tier: the sentinel follows vLLM 0.26's own path choice (`_prepare_expert_assignment`), the
rewrite touches only padding rows and only inside a padded forward, a key that cannot pad (one
request) captures and replays no mask through the lifecycle, and real vLLM Qwen3-MoE
layers built by vLLM's CPU build are refused with the reason (its experts are monolithic), their
routers untouched. GPU tier: vLLM's Triton experts on Qwen3-30B-A3B's expert shapes give the
real rows bit-identical outputs with the padding rows skipped, on both of vLLM's paths."""

from __future__ import annotations

import pytest
import torch

from tests.gpu_util import require_cuda_and_vllm
from tests.serve_util import run_result_script
from vllm_moe_graphs.config import PluginConfig
from vllm_moe_graphs.integration.moe_padding import MoePadding, padded_scope, sentinel

E, K = 128, 8  # Qwen3-30B-A3B: 128 experts, top-8


def _vllm_naive(rows: int) -> bool:
    """Whether vLLM 0.26's Triton experts take the naive block assignment for `rows` rows: it
    returns no sorted ids; the aligned path calls `moe_align_block_size` (a CUDA op, absent
    from a CPU-only process)."""
    from vllm.model_executor.layers.fused_moe.fused_moe import _prepare_expert_assignment

    ids = torch.zeros(rows, K, dtype=torch.int32)
    try:
        sorted_ids = _prepare_expert_assignment(ids, {"BLOCK_SIZE_M": 16}, rows, K, E, None)[0]
    except (AttributeError, RuntimeError) as exc:
        assert "moe_align_block_size" in str(exc), exc
        return False
    return sorted_ids is None


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16, 512, 8192])
def test_sentinel_follows_vllms_path(rows: int) -> None:
    naive = _vllm_naive(rows)
    assert naive == (rows <= 4)  # rows * top_k * 4 <= experts
    assert sentinel(rows, K, E) == (-1 if naive else E)


def test_only_padding_rows_are_rewritten_and_only_while_padded() -> None:
    padding = MoePadding(16, "cpu")
    apply = padding.rewrite(K, E)
    ids = torch.randint(0, E, (12, K), dtype=torch.int32)
    before = ids.clone()
    padding.begin(12)
    apply(ids)  # outside a padded forward: vLLM's own step, untouched
    assert torch.equal(ids, before)
    with padding.padded(9):
        padding.begin(12)
        apply(ids)
        assert padding.active
    assert not padding.active
    assert torch.equal(ids[:9], before[:9])
    assert (ids[9:] == E).all()  # 12 rows: the aligned path's sentinel
    small = torch.randint(0, E, (4, K), dtype=torch.int32)
    first = small[0].clone()
    with padding.padded(1):
        padding.begin(4)
        apply(small)
    assert torch.equal(small[0], first) and (small[1:] == -1).all()  # naive path: -1
    with pytest.raises(ValueError, match="real_rows=17 outside 0..16"):
        with padding.padded(17):
            pass
    with padded_scope(None, 3), padded_scope(padding, None):
        assert not padding.active  # no rewrite installed, or vLLM's own unpadded step


def test_skip_moe_padding_is_on_by_default_and_parsed() -> None:
    assert PluginConfig().skip_moe_padding is True  # on since its GPU tests ran on the H200
    assert PluginConfig.from_dict({"skip_moe_padding": False}).skip_moe_padding is False
    with pytest.raises(ValueError, match="skip_moe_padding='no' must be true or false"):
        PluginConfig.from_dict({"skip_moe_padding": "no"})


class _RoutedModel:
    """A model whose one MoE layer's router output goes through `padding`'s rewrite: records,
    per call, how many of its rows were sent to the sentinel, None when the rewrite did not run
    (no mask launch: the forward is not padded)."""

    def __init__(self, padding: MoePadding) -> None:
        self.padding, self.rewrite = padding, padding.rewrite(K, E)
        self.masked: list[int | None] = []

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = torch.zeros(input_ids.shape[0], K, dtype=torch.int32)  # [T, K] router output
        self.rewrite(ids)
        self.masked.append(int((ids[:, 0] != 0).sum()) if self.padding.active else None)
        return torch.zeros(input_ids.shape[0], 4)


@pytest.mark.parametrize("bucket, real, masked", [(1, 1, None), (2, 1, 1), (8, 5, 3)])
def test_graph_of_a_key_that_cannot_pad_has_no_mask(bucket: int, real: int,
                                                    masked: int | None) -> None:
    """The lifecycle's capture and replay of a decode key through the real graph runner (its
    capture emulated): a one-request key's graph runs no mask (it cannot hold padding rows),
    every wider key's graph masks the rows past the real ones at each replay."""
    from types import SimpleNamespace

    from tests.graphs.test_runner import Emulated
    from vllm_moe_graphs.capability import Reason
    from vllm_moe_graphs.graphs import Action, Decision, DecodeGraphRunner, GraphKey
    from vllm_moe_graphs.integration.lifecycle import GraphLifecycle
    from vllm_moe_graphs.integration.moe_padding import key_pads

    assert key_pads(bucket) is (bucket > 1)
    cfg = PluginConfig(decode_batch_buckets=(1, 2, 8), context_buckets=(64,), warmup_steps=0)
    padding = MoePadding(8, "cpu")
    model = _RoutedModel(padding)
    lifecycle = GraphLifecycle(SimpleNamespace(model=model), cfg)
    lifecycle.moe_padding = padding
    lifecycle.graphs = DecodeGraphRunner(None, cfg, capture_fn=Emulated())
    key, args = GraphKey(bucket, 64), {"input_ids": torch.zeros(bucket, dtype=torch.int32)}
    lifecycle.capture(key, args)  # warm-up run and capture, at the key's rows
    # captured as a full key (no row past the real ones), with the mask where the key can pad
    assert model.masked == ([0, 0] if bucket > 1 else [None, None])
    plan = SimpleNamespace(decision=Decision(Action.REPLAY, key, Reason.ELIGIBLE, real),
                           with_logits=False, kind=None)
    lifecycle._step = SimpleNamespace(plan=plan)
    lifecycle.forward(args)
    assert model.masked[-1] == masked


_BUILD = r"""
import json, sys, tempfile
from types import SimpleNamespace
import torch
from transformers import Qwen3MoeConfig
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM
from vllm_moe_graphs.integration import moe_padding

path = tempfile.mkdtemp()
Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], vocab_size=128, hidden_size=64,
               intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=128,
               num_experts_per_tok=8, max_position_embeddings=256).save_pretrained(path)
vc = VllmConfig(model_config=ModelConfig(model=path, skip_tokenizer_init=True, dtype="bfloat16"))
with set_current_vllm_config(vc):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{sys.argv[1]}")
    initialize_model_parallel(1, 1)
    torch.set_default_dtype(torch.bfloat16)
    model = Qwen3MoeForCausalLM(vllm_config=vc, prefix="")
runner = SimpleNamespace(input_ids=SimpleNamespace(gpu=torch.zeros(64, dtype=torch.int32)),
                         device=torch.device("cpu"))
padding = moe_padding.install_moe_padding(model, runner)
routers = [m.router for n, m in model.named_modules() if n.endswith("mlp.experts")]
out = {
    "layers": padding.layers,
    "max_rows": padding.max_rows,
    "routers_untouched": all("select_experts" not in r.__dict__ for r in routers),
    "dense": moe_padding.install_moe_padding(torch.nn.Linear(2, 2), runner),
}
print("RESULT " + json.dumps(out))
"""


def test_vllms_cpu_experts_are_refused_with_the_reason(cpu_vllm) -> None:
    built = run_result_script(_BUILD, cpu_vllm)
    assert built["layers"] == {
        f"model.layers.{i}.mlp.experts": "monolithic experts kernel (UnquantizedFusedMoEMethod)"
        for i in range(2)}, built
    assert built["routers_untouched"] and built["max_rows"] == 64 and built["dense"] is None


@pytest.mark.gpu
@pytest.mark.parametrize("rows,real", [(4, 1), (4, 3), (24, 17), (512, 300), (4096, 2500)])
def test_vllms_triton_experts_skip_the_padding_rows(rows: int, real: int) -> None:
    """vLLM's fused experts (the Triton path `TritonExperts` runs) on Qwen3-30B-A3B's expert
    shapes: with the padding rows' ids rewritten, the real rows' outputs are bit-identical to
    vLLM's unrewritten run (naive path at 4 rows, aligned above)."""
    require_cuda_and_vllm()
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        _check_triton_experts(rows, real)


def _check_triton_experts(rows: int, real: int) -> None:
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

    dev, dt, hidden, inter = torch.device("cuda"), torch.bfloat16, 2048, 768
    gen = torch.Generator(device=dev).manual_seed(rows)
    w1 = torch.randn(E, 2 * inter, hidden, generator=gen, device=dev, dtype=dt) * 0.02
    w2 = torch.randn(E, hidden, inter, generator=gen, device=dev, dtype=dt) * 0.02
    x = torch.randn(rows, hidden, generator=gen, device=dev, dtype=dt)
    logits = torch.randn(rows, E, generator=gen, device=dev, dtype=torch.float32)
    weights, ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    ids = ids.to(torch.int32)
    plain = fused_experts(x, w1, w2, weights, ids)
    padding = MoePadding(rows, dev)
    masked = ids.clone()
    with padding.padded(real):
        padding.begin(rows)
        padding.rewrite(K, E)(masked)
    assert (masked[real:] == sentinel(rows, K, E)).all() and torch.equal(masked[:real], ids[:real])
    skipped = fused_experts(x, w1, w2, weights, masked)
    torch.cuda.synchronize()
    assert torch.equal(skipped[:real], plain[:real])
    # and the rewrite is what a captured graph replays: the count is read on the device
    graph, out = torch.cuda.CUDAGraph(), None
    replay_ids = ids.clone()
    with padding.padded(rows):
        with torch.cuda.graph(graph):
            replay_ids.copy_(ids)
            padding.begin(rows)
            padding.rewrite(K, E)(replay_ids)
            out = fused_experts(x, w1, w2, weights, replay_ids)
    with padding.padded(real):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replay_ids[:real], ids[:real])
    assert (replay_ids[real:] == sentinel(rows, K, E)).all()
    assert torch.equal(out[:real], plain[:real])
