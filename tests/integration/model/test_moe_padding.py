"""Padding rows skip the fused MoE's experts (`integration/model/moe_padding.py`).

CPU tier: the sentinel follows vLLM 0.26's own path choice (`_prepare_expert_assignment`), the
rewrite touches only padding rows and only inside a padded forward, a key that cannot pad (one
request) captures and replays no mask through the lifecycle, the fused routing
(`fuse_moe_padding_mask`) installed on vLLM's own `FusedTopKRouter` sends the padding rows to
the sentinel in its one launch (and refuses other routers by reason), and real vLLM Qwen3-MoE
layers built by vLLM's CPU build are refused with the reason (its experts are monolithic), their
routers untouched. GPU tier: vLLM's Triton experts on Qwen3-30B-A3B's expert shapes give the
real rows bit-identical outputs with the padding rows skipped, on both of vLLM's paths, through
the mask and through the fused routing; the fused routing picks what vLLM's `fused_topk` picks."""

from __future__ import annotations

import pytest
import torch

from tests.gpu_util import require_cuda_and_vllm
from tests.serve_util import run_on_tiny_qwen3_moe
from vllm_moe_graphs.config import PluginConfig
from vllm_moe_graphs.graphs.buckets import GraphKey
from vllm_moe_graphs.integration.model.moe_padding import (
    MoePadding,
    key_scope,
    padded_scope,
    sentinel,
)

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
    with key_scope(padding, None, 3), key_scope(padding, GraphKey(1, 64), 1):
        assert not padding.active  # vLLM's own step, a key that cannot pad
    with key_scope(padding, GraphKey(8, 64), 3):
        assert padding.active  # a key that pads: its real rows
    with key_scope(None, GraphKey(8, 64), 3):
        assert not padding.active  # no rewrite installed


def test_skip_moe_padding_is_on_by_default_and_parsed() -> None:
    assert PluginConfig().skip_moe_padding is True  # on since its GPU tests ran on the H200
    assert PluginConfig.from_dict({"skip_moe_padding": False}).skip_moe_padding is False
    with pytest.raises(ValueError, match="skip_moe_padding='no' must be true or false"):
        PluginConfig.from_dict({"skip_moe_padding": "no"})
    assert PluginConfig().fuse_moe_padding_mask is False  # until measured on the H200
    assert PluginConfig.from_dict({"fuse_moe_padding_mask": True}).fuse_moe_padding_mask
    with pytest.raises(ValueError, match="fuse_moe_padding_mask=1 must be true or false"):
        PluginConfig.from_dict({"fuse_moe_padding_mask": 1})


def _fused_router(padding: MoePadding):
    """vLLM 0.26's own Qwen3-MoE router (top-8 of 128, softmax, renormalized) with the fused
    routing installed, as `install_moe_padding` installs it."""
    from vllm.model_executor.layers.fused_moe.router.fused_topk_router import FusedTopKRouter
    from vllm_moe_graphs.integration.patch import router_compute_routing

    router = FusedTopKRouter(top_k=K, global_num_experts=E, renormalize=True)
    assert router_compute_routing.refusal(router) is None
    router_compute_routing.install(router, padding.route(K, E, router.renormalize))
    return router


def test_fused_routing_sends_padding_rows_to_the_sentinel_in_vllms_router() -> None:
    from vllm_moe_graphs.ops.moe_router import topk_softmax

    # the kernel runs where Triton does: the GPU, else the interpreter on the CPU
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    padding = MoePadding(16, dev)
    router = _fused_router(padding)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, E, generator=g).to(torch.bfloat16).to(dev)  # [T, E]
    hidden = torch.zeros(12, 32, dtype=torch.bfloat16, device=dev)
    want_w, want_i = topk_softmax(logits, K, True)
    weights, ids = router.select_experts(hidden, logits)  # vLLM's own unpadded step
    assert torch.equal(ids, want_i) and torch.equal(weights, want_w)
    probs = torch.softmax(logits.double(), -1)
    torch.testing.assert_close(probs.gather(1, ids.long()).sort(-1, True).values,
                               probs.topk(K, -1).values)  # the K most probable experts
    with padding.padded(9):
        weights, ids = router.select_experts(hidden, logits)
    assert torch.equal(ids[:9], want_i[:9]) and (ids[9:] == E).all()  # aligned path: E
    assert torch.equal(weights, want_w)
    with padding.padded(1):
        _, ids = router.select_experts(hidden[:4], logits[:4])
    assert torch.equal(ids[:1], want_i[:1]) and (ids[1:] == -1).all()  # naive path: -1
    _, ids = router.select_experts(hidden, logits, topk_indices_dtype=torch.int64)
    assert ids.dtype == torch.int64 and torch.equal(ids, want_i.long())
    _, ids = router.select_experts(hidden, logits.float()[:, :E])
    assert torch.equal(ids, topk_softmax(logits.float(), K, True)[1])


def test_fused_routing_launches_no_mask() -> None:
    """With every eligible layer on the fused routing, a padded forward's `begin` writes no
    mask (no launch); a layer on the mask makes it write one."""
    padding = MoePadding(8, "cpu")
    _fused_router(padding)
    with padding.padded(3):
        padding.begin(8)
    assert not padding._pad.any()  # untouched: no mask launch
    padding.rewrite(K, E)  # one layer on the mask
    with padding.padded(3):
        padding.begin(8)
    assert padding._pad.tolist() == [False] * 3 + [True] * 5


def test_fused_routing_refuses_routers_it_does_not_reproduce() -> None:
    from vllm.model_executor.layers.fused_moe.router.fused_topk_router import FusedTopKRouter
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import (
        GroupedTopKRouter,
    )
    from vllm_moe_graphs.integration.patch import router_compute_routing

    sigmoid = FusedTopKRouter(top_k=K, global_num_experts=E, scoring_func="sigmoid")
    assert router_compute_routing.refusal(sigmoid) == "scoring function 'sigmoid' (only softmax)"
    grouped = GroupedTopKRouter.__new__(GroupedTopKRouter)
    assert router_compute_routing.refusal(grouped) == (
        "router GroupedTopKRouter (only vLLM's FusedTopKRouter)")


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
    from vllm_moe_graphs.integration.runner.lifecycle import GraphLifecycle
    from vllm_moe_graphs.integration.model.moe_padding import key_pads

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


_INSTALL = r"""
from types import SimpleNamespace
from vllm_moe_graphs.integration.model import moe_padding

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
    built = run_on_tiny_qwen3_moe(_INSTALL, cpu_vllm)
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
    rewrite = padding.rewrite(K, E)  # a layer on the mask, as install registers it
    masked = ids.clone()
    with padding.padded(real):
        padding.begin(rows)
        rewrite(masked)
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
            rewrite(replay_ids)
            out = fused_experts(x, w1, w2, weights, replay_ids)
    with padding.padded(real):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replay_ids[:real], ids[:real])
    assert (replay_ids[real:] == sentinel(rows, K, E)).all()
    assert torch.equal(out[:real], plain[:real])


@pytest.mark.gpu
@pytest.mark.parametrize("rows,real", [(4, 1), (24, 17), (512, 300), (4096, 2500)])
def test_fused_routing_skips_the_padding_rows_in_a_replayed_graph(rows: int, real: int) -> None:
    """The fused routing feeding vLLM's Triton experts (Qwen3-30B-A3B's expert shapes) inside a
    captured graph replayed with fewer real rows: the real rows' ids and outputs bit-identical
    to an unpadded run of the same routing, the padding rows on the sentinel."""
    require_cuda_and_vllm()
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

    dev, dt, hidden, inter = torch.device("cuda"), torch.bfloat16, 2048, 768
    gen = torch.Generator(device=dev).manual_seed(rows)
    w1 = torch.randn(E, 2 * inter, hidden, generator=gen, device=dev, dtype=dt) * 0.02
    w2 = torch.randn(E, hidden, inter, generator=gen, device=dev, dtype=dt) * 0.02
    x = torch.randn(rows, hidden, generator=gen, device=dev, dtype=dt)
    logits = torch.randn(rows, E, generator=gen, device=dev, dtype=dt)
    padding = MoePadding(rows, dev)
    route = padding.route(K, E, True)
    with set_current_vllm_config(VllmConfig()):
        weights, ids = route(logits, None)  # vLLM's own unpadded step: every row real
        plain = fused_experts(x, w1, w2, weights, ids)
        graph = torch.cuda.CUDAGraph()
        with padding.padded(rows):
            fused_experts(x, w1, w2, *route(logits, None))  # warm-up, outside the graph
            with torch.cuda.graph(graph):
                g_weights, g_ids = route(logits, None)
                out = fused_experts(x, w1, w2, g_weights, g_ids)
        with padding.padded(real):
            graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_ids[:real], ids[:real]) and torch.equal(g_weights, weights)
    assert (g_ids[real:] == sentinel(rows, K, E)).all()
    assert torch.equal(out[:real], plain[:real])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_routing_picks_what_vllms_fused_topk_picks(dtype: torch.dtype) -> None:
    """Against vLLM's own CUDA `topk_softmax` (via `fused_topk`) on the router logits of 4096
    rows: the same experts (compared by their probabilities, so that a tie or a near-tie that
    the two kernels' float32 exp rounds apart may go either way) and the same weights to
    float32 rounding."""
    require_cuda_and_vllm()
    from vllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk

    gen = torch.Generator(device="cuda").manual_seed(7)
    logits = (torch.randn(4096, E, generator=gen, device="cuda") * 2).to(dtype)
    hidden = torch.empty(4096, 8, device="cuda", dtype=torch.bfloat16)
    want_w, want_i, _ = fused_topk(hidden, logits, K, True)
    weights, ids = MoePadding(4096, "cuda").route(K, E, True)(logits, None)
    probs = torch.softmax(logits.double(), -1)
    # in order: the same expert at each rank, or one of the same probability to 1e-6
    torch.testing.assert_close(probs.gather(1, ids.long()), probs.gather(1, want_i.long()),
                               atol=1e-6, rtol=0)
    assert (ids == want_i.to(ids.dtype)).float().mean() > 0.99  # ties and near-ties aside
    torch.testing.assert_close(weights, want_w, atol=2e-6, rtol=1e-5)
