"""GPU tier: real CUDA graph capture and replay of a small torch module through the runner."""

from __future__ import annotations

import gc
from unittest import mock

import pytest
import torch

from vllm_moe_graphs.capability import Reason
from vllm_moe_graphs.config import PluginConfig
from vllm_moe_graphs.graphs import Action, DecodeGraphRunner, GraphKey

pytestmark = pytest.mark.gpu

MAX, D = 16, 256  # B = largest batch bucket, D = hidden


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


class Toy:
    """A small MLP over static input buffers at the largest bucket."""

    def __init__(self, sync_in_forward: bool = False) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(D, 4 * D), torch.nn.GELU(),
                                         torch.nn.Linear(4 * D, D)).cuda().eval()
        self.x = torch.zeros(MAX, D, device="cuda")  # [B, D] static input
        self.sync_in_forward = sync_in_forward

    @torch.inference_mode()
    def forward(self, batch: int) -> torch.Tensor:
        y = self.model(self.x[:batch])  # [batch, D], allocated in the graph pool when capturing
        if self.sync_in_forward:
            # NOTE: a host sync: illegal inside a captured region, so capture must fail
            y = y + y.sum().item() * 0
        return y

    @torch.inference_mode()
    def fill(self, n: int) -> torch.Tensor:
        """Real rows then zero padding; returns the eager reference [n, D]."""
        self.x[:n] = torch.randn(n, D, device="cuda")
        self.x[n:] = 0
        return self.model(self.x[:n]).clone()


def config(**kw) -> PluginConfig:
    base = dict(decode_batch_buckets=(1, 2, 4, 8, 16), context_buckets=(1024,), warmup_steps=1,
                graph_memory_budget_mib=512)
    return PluginConfig(**{**base, **kw})


def test_replay_matches_eager_for_padded_batches():
    toy, hooks = Toy(), mock.Mock()
    runner = DecodeGraphRunner(toy.forward, config(),
                               before_capture=hooks.capture, before_replay=hooks.replay)
    for n in (1, 3, 5, 8, 13, 16):
        actions = []
        for _ in range(4):
            want = toy.fill(n)
            out, d = runner.step(n, 100, True)
            actions.append(d.action)
            assert out.shape == (n, D)
            torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
        assert actions == [Action.EAGER, Action.CAPTURE, Action.REPLAY, Action.REPLAY] or \
            actions == [Action.REPLAY] * 4, f"batch {n}: {actions}"
    assert runner.keys == tuple(GraphKey(b, 1024) for b in (1, 4, 8, 16))
    assert hooks.capture.call_count == 4
    assert runner.pool_bytes > 0
    assert runner.stats.pool_bytes == runner.pool_bytes > 0
    runner.close()


def test_tiny_budget_denies_second_capture():
    toy = Toy()
    runner = DecodeGraphRunner(toy.forward, config(warmup_steps=0, graph_memory_budget_mib=1))
    toy.fill(16)
    assert runner.step(16, 100, True)[1].action is Action.CAPTURE
    assert runner.pool_bytes >= 1 << 20, "a capture allocates at least one pool segment"
    want = toy.fill(2)
    out, d = runner.step(2, 100, True)
    assert d.reason is Reason.MEMORY_BUDGET and d.action is Action.EAGER
    torch.testing.assert_close(out, want)
    runner.close()


def test_failed_capture_quarantines_and_eager_still_works():
    toy = Toy(sync_in_forward=True)
    runner = DecodeGraphRunner(toy.forward, config(warmup_steps=0))
    for _ in range(2):
        # fill() draws from the CUDA RNG: after the failed (invalidated) capture it must work,
        # as vLLM's sampler must (the runner resets the generator's capture state)
        want = toy.fill(4)
        out, d = runner.step(4, 100, True)
        assert d.reason is Reason.CAPTURE_FAILED
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    assert runner.quarantined == {GraphKey(4, 1024)} and runner.keys == ()
    # the allocator stopped recording into the failed capture's pool: another key captures
    # (torch would refuse with "already recording to mempool_id") and replays
    toy.sync_in_forward = False
    for action in (Action.CAPTURE, Action.REPLAY):
        want = toy.fill(8)
        out, d = runner.step(8, 100, True)
        assert d.action is action, d
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    assert runner.keys == (GraphKey(8, 1024),)
    runner.close()


def test_invalidate_frees_pool_memory():
    toy = Toy()
    runner = DecodeGraphRunner(toy.forward, config(warmup_steps=0))

    def cycle() -> None:
        runner.invalidate(Reason.STORAGE_IDENTITY_CHANGED)
        for n in (16, 8, 2):
            want = toy.fill(n)
            out, d = runner.step(n, 100, True)
            assert d.action is Action.CAPTURE
            torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
        torch.cuda.synchronize()

    cycle()
    runner.invalidate(Reason.STORAGE_IDENTITY_CHANGED)
    gc.collect()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_reserved()
    for _ in range(20):
        cycle()
    runner.invalidate(Reason.STORAGE_IDENTITY_CHANGED)
    gc.collect()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() <= baseline
    runner.close()
    runner.close()
    with pytest.raises(RuntimeError, match="after close"):
        runner.precapture()
