"""DecodeGraphRunner on CPU: every decision path with real tensors and a real forward.

Graph capture is emulated by `Emulated`, a real capture function whose "graph" re-runs the
forward on the static buffers (what a CUDA graph replay does); it can fail or report pool bytes.
On CPU the default CUDA capture is refused with NO_CUDA.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

from vllm_moe_graphs.capability import Reason
from vllm_moe_graphs.config import CaptureFailurePolicy, PluginConfig
from vllm_moe_graphs.graphs import Action, CapturedGraph, Decision, DecodeGraphRunner, GraphKey
from vllm_moe_graphs.graphs.kinds import StepKind
from vllm_moe_graphs.killswitch import KillSwitch
from vllm_moe_graphs.kv.storage import PagedKVStorage

MIB = 1 << 20
MAX, D = 8, 4  # B = padded batch (max bucket), D = hidden


def config(**kw) -> PluginConfig:
    base = dict(decode_batch_buckets=(1, 2, 4, 8), context_buckets=(16, 64), warmup_steps=2,
                graph_memory_budget_mib=4)
    return PluginConfig(**{**base, **kw})


class Toy:
    """Static buffers at the largest bucket and a forward over their leading rows."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.w = torch.randn(D, D, generator=g)  # [D, D]
        self.x = torch.zeros(MAX, D)  # [B, D] static input
        self.out = torch.zeros(MAX, D)  # [B, D] static output
        self.calls: list[int] = []
        self.rows: torch.Tensor | None = None

    def forward(self, batch: int) -> torch.Tensor:
        self.calls.append(batch)
        torch.matmul(self.x[:batch], self.w, out=self.out[:batch])
        return self.out

    def fill(self, n: int) -> torch.Tensor:
        """New real rows, padding zeroed; returns the expected output [n, D]."""
        self.rows = torch.randn(n, D)
        self.x[:n] = self.rows
        self.x[n:] = 0
        self.out.fill_(float("nan"))  # stale output must never leak
        return self.rows @ self.w


class Emulated:
    """A capture function: warm-up (when asked), `before_capture`, then a "graph" that re-runs
    `fn`."""

    def __init__(self, pool_bytes: int = MIB, fail: Exception | None = None) -> None:
        self.pool_bytes, self.fail = pool_bytes, fail
        self.captures = self.replays = self.releases = 0
        self.pools: list[object] = []
        self.warm_ups: list[bool] = []

    def __call__(self, fn, pool, before_capture, *, warm_up: bool = True) -> CapturedGraph:
        self.captures += 1
        self.pools.append(pool)
        self.warm_ups.append(warm_up)
        if warm_up:
            fn()
        if before_capture is not None:
            before_capture()
        if self.fail is not None:
            raise self.fail
        output = fn()

        def replay():
            self.replays += 1
            return fn()

        def release():
            self.releases += 1

        return CapturedGraph(replay, output, self.pool_bytes, release)


def make(cfg=None, **kw):
    toy, cap = Toy(), kw.pop("capture_fn", None) or Emulated()
    runner = DecodeGraphRunner(toy.forward, cfg or config(), capture_fn=cap, **kw)
    return runner, toy, cap, runner.stats


def step(runner, toy, n, ctx=10, pure=True):
    want = toy.fill(n)
    out, d = runner.step(n, ctx, pure)
    assert out.shape == (n, D), "only the real rows come back"
    torch.testing.assert_close(out, want)
    return d


def warm_and_capture(runner, toy, n=3, ctx=10):
    for _ in range(runner.config.warmup_steps):
        assert step(runner, toy, n, ctx).warming_up
    assert step(runner, toy, n, ctx).action is Action.CAPTURE


# -- decision table --------------------------------------------------------------------------
def test_decision_table_per_batch_reasons(tmp_path):
    kill = tmp_path / "kill"
    runner, *_ = make(kill_switch=KillSwitch(str(kill), interval_s=0))
    assert runner.decide(3, 10, False) == Decision(Action.EAGER, None, Reason.MIXED_BATCH, 3)
    assert runner.decide(9, 10, True).reason is Reason.BATCH_TOO_LARGE
    assert runner.decide(3, 65, True).reason is Reason.CONTEXT_TOO_LONG
    d = runner.decide(3, 10, True)
    assert d == Decision(Action.EAGER, GraphKey(4, 16), Reason.ELIGIBLE, 3) and d.warming_up
    assert d.batch_size == 4
    kill.touch()
    d = runner.decide(3, 10, True)
    assert d == Decision(Action.EAGER, GraphKey(4, 16), Reason.KILL_SWITCH, 3)
    assert d.batch_size == 4, "the kill switch keeps the key's shape: what its graph computes"
    d = runner.decide(9, 10, True)  # no key: unpadded, still counted under the kill switch
    assert d == Decision(Action.EAGER, None, Reason.KILL_SWITCH, 9) and d.batch_size == 9


def test_warmup_capture_replay_sequence():
    before = mock.Mock()
    runner, toy, cap, stats = make(before_capture=before.capture,
                                   before_replay=before.replay)
    for _ in range(2):
        d = step(runner, toy, 3)
        assert d.warming_up and toy.calls[-1] == 4, "warm-up runs the padded bucket"
    assert cap.captures == 0
    assert step(runner, toy, 3).action is Action.CAPTURE
    assert cap.captures == 1 and runner.keys == (GraphKey(4, 16),)
    assert before.capture.call_count == 1
    for n in (3, 4):  # both pad into bucket 4
        assert step(runner, toy, n, ctx=16).action is Action.REPLAY
    assert cap.captures == 1 and cap.replays == 3  # one replay serves the capture step
    assert before.replay.call_count == 3
    assert stats.replays == 3 and stats.captures == 1 and len(stats.capture_seconds) == 1
    assert stats.step_captures_by_kind == {StepKind.DECODE: 1}, "the step waited for it"
    assert stats.fallbacks == {}  # warm-up is not a fallback
    assert (stats.pool_bytes, stats.scratch_bytes) == (MIB, 0)
    assert runner.pool_bytes == MIB


def test_zero_warmup_captures_on_first_step():
    runner, toy, cap, _ = make(config(warmup_steps=0))
    assert step(runner, toy, 1).action is Action.CAPTURE and cap.captures == 1
    assert cap.warm_ups == [True], "a key that never ran at its size warms up inside the capture"


@pytest.mark.parametrize("warmup_steps", [1, 2])
def test_a_warmed_key_is_captured_without_another_warm_up_run(warmup_steps):
    runner, toy, cap, _ = make(config(warmup_steps=warmup_steps))
    warm_and_capture(runner, toy, n=3)
    assert cap.warm_ups == [False]
    assert toy.calls == [4] * (warmup_steps + 2), "warm-ups, the capture, its replay"
    runner.invalidate(Reason.STORAGE_IDENTITY_CHANGED)  # warm-up counts restart with the pool
    runner.precapture([GraphKey(8, 16)])
    warm_and_capture(runner, toy, n=3)
    assert cap.warm_ups == [False, True, False], "precapture's key had no eager step before"


def test_real_row_slicing_hides_padding():
    runner, toy, _, _ = make(config(warmup_steps=0))
    step(runner, toy, 5)  # capture bucket 8
    toy.fill(5)
    toy.x[5:] = 100.0  # garbage in the padding rows is computed but never returned
    out, d = runner.step(5, 10, True)
    assert d.action is Action.REPLAY and out.shape == (5, D)
    torch.testing.assert_close(out, toy.rows @ toy.w)


def test_decode_keys_with_one_attention_plan_share_a_graph():
    """With a decode plan (the split count per bucket pair), contexts 16 and 64 of batch
    buckets 4 and 8 plan alike: one graph serves both; batch 1 and 2 keep one per context."""
    plan = lambda b, c: (b, c if b < 4 else 0)  # noqa: E731
    runner, toy, cap, _ = make(config(warmup_steps=0), decode_plan=plan)
    assert runner.all_keys() == (GraphKey(8, 16), GraphKey(4, 16), GraphKey(2, 64),
                                 GraphKey(2, 16), GraphKey(1, 64), GraphKey(1, 16))
    assert step(runner, toy, 3, ctx=10).action is Action.CAPTURE
    d = step(runner, toy, 3, ctx=40)
    assert (d.action, d.key) == (Action.REPLAY, GraphKey(4, 16)), "the longer context replays"
    assert step(runner, toy, 1, ctx=10).action is Action.CAPTURE
    assert step(runner, toy, 1, ctx=40).action is Action.CAPTURE, "batch 1 plans per context"
    assert runner.decide(3, 65, True).reason is Reason.CONTEXT_TOO_LONG
    assert cap.captures == 3 and runner.keys == (GraphKey(1, 16), GraphKey(1, 64),
                                                 GraphKey(4, 16))


def test_describe_says_what_will_be_graphed():
    plan = lambda b, c: (b, c if b < 4 else 0)  # noqa: E731
    runner, *_ = make(config(mixed_graphs=True, token_buckets=(16, 32)), decode_plan=plan)
    first, second = runner.describe()
    assert "decode batch buckets [1, 2, 4, 8], context buckets [16, 64] (6 decode keys" in first
    assert "warm-up 2 steps, pool budget 4 MiB" in first
    assert "token buckets [16, 32], requests padded to min(token bucket, 8)" in second
    runner, *_ = make(config(mixed_graphs=False))
    assert len(runner.describe()) == 1 and "(8 decode keys" in runner.describe()[0]


# -- failures --------------------------------------------------------------------------------
def test_capture_failure_quarantines_key_and_runs_eager():
    cap = Emulated(fail=RuntimeError("operation not permitted when stream is capturing"))
    runner, toy, _, stats = make(capture_fn=cap)
    for _ in range(2):
        step(runner, toy, 3)
    d = step(runner, toy, 3)  # the failing step still returns the correct output
    assert d == Decision(Action.EAGER, GraphKey(4, 16), Reason.CAPTURE_FAILED, 3)
    assert runner.quarantined == {GraphKey(4, 16)} and runner.keys == ()
    for _ in range(3):
        assert step(runner, toy, 4).reason is Reason.CAPTURE_FAILED
    assert cap.captures == 1, "a quarantined key is never captured again"
    assert stats.capture_failures == 1
    assert stats.fallbacks == {Reason.CAPTURE_FAILED: 4}
    runner.invalidate(Reason.STORAGE_IDENTITY_CHANGED)
    assert runner.decide(3, 10, True).reason is Reason.CAPTURE_FAILED, "for the runner's life"
    # other keys still capture
    cap.fail = None
    warm_and_capture(runner, toy, n=1)
    assert runner.keys == (GraphKey(1, 16),)


def test_raise_policy_wraps_error_with_remedy():
    err = ValueError("boom")
    runner, toy, _, _ = make(config(warmup_steps=0,
                                    capture_failure_policy=CaptureFailurePolicy.RAISE),
                             capture_fn=Emulated(fail=err))
    toy.fill(2)
    with pytest.raises(RuntimeError, match="quarantine") as info:
        runner.step(2, 10, True)
    assert info.value.__cause__ is err
    assert runner.quarantined == {GraphKey(2, 16)}


def test_memory_budget_denies_further_captures():
    runner, toy, cap, stats = make(config(warmup_steps=0, graph_memory_budget_mib=2),
                                     capture_fn=Emulated(pool_bytes=2 * MIB))
    assert step(runner, toy, 1).action is Action.CAPTURE  # this one reaches the budget
    d = step(runner, toy, 2)
    assert d == Decision(Action.EAGER, GraphKey(2, 16), Reason.MEMORY_BUDGET, 2)
    assert step(runner, toy, 1).action is Action.REPLAY, "captured graphs keep replaying"
    assert stats.fallbacks == {Reason.MEMORY_BUDGET: 1}
    assert cap.captures == 1
    runner.invalidate(Reason.STORAGE_IDENTITY_CHANGED)  # a new pool: budget available again
    assert runner.pool_bytes == 0 and step(runner, toy, 2).action is Action.CAPTURE


def test_zero_budget_means_no_graphs():
    runner, toy, cap, _ = make(config(warmup_steps=0, graph_memory_budget_mib=0))
    assert step(runner, toy, 1).reason is Reason.MEMORY_BUDGET and cap.captures == 0
    result = runner.precapture()
    assert len(result) == 8 and set(result.values()) == {Reason.MEMORY_BUDGET}


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_no_cuda_runs_everything_eager(tmp_path):
    toy = Toy()
    kill = tmp_path / "kill"
    runner = DecodeGraphRunner(toy.forward, config(warmup_steps=0),
                               kill_switch=KillSwitch(str(kill), interval_s=0))
    for _ in range(3):
        d = step(runner, toy, 3)
        assert d == Decision(Action.EAGER, GraphKey(4, 16), Reason.NO_CUDA, 3)
    kill.touch()  # no graph is possible: unpadded whatever the switch says
    assert step(runner, toy, 3).reason is Reason.NO_CUDA
    assert toy.calls == [3, 3, 3, 3]
    assert set(runner.precapture().values()) == {Reason.NO_CUDA}
    assert runner.keys == ()


# -- kill switch, storage, lifecycle ---------------------------------------------------------
def test_kill_switch_keeps_graphs(tmp_path):
    kill = tmp_path / "kill"
    runner, toy, cap, stats = make(config(warmup_steps=0),
                                     kill_switch=KillSwitch(str(kill), interval_s=0))
    step(runner, toy, 2)
    kill.write_text("")
    assert step(runner, toy, 2).reason is Reason.KILL_SWITCH
    assert runner.keys == (GraphKey(2, 16),)
    assert stats.fallbacks == {Reason.KILL_SWITCH: 1}
    os.remove(kill)
    assert step(runner, toy, 2).action is Action.REPLAY and cap.captures == 1


def _kv(n_blocks: int = 4) -> dict[str, torch.Tensor]:
    return {"model.layers.0.self_attn.attn": torch.zeros(n_blocks, 1, 16, 2 * D)}


def _bind(storage: PagedKVStorage, layers) -> None:
    storage.bind(layers, phase="serving")
    storage.check_devices("cpu", "cpu")


def test_storage_rebind_drops_graphs_and_recaptures_after_warmup():
    storage = PagedKVStorage()
    runner, toy, cap, _ = make(storage=storage)
    assert step(runner, toy, 3).reason is Reason.STORAGE_UNBOUND  # never bound: no warm-up
    _bind(storage, _kv())
    warm_and_capture(runner, toy)
    assert step(runner, toy, 3).action is Action.REPLAY
    storage.bind(_kv(n_blocks=8), phase="serving")  # the cache moved: listener invalidates
    assert runner.keys == () and cap.releases == 1
    assert step(runner, toy, 3).reason is Reason.DEVICE_MISMATCH  # devices not re-proven
    storage.check_devices("cpu", "cpu")
    warm_and_capture(runner, toy)  # warm-up counts restarted
    assert cap.pools[0] is not cap.pools[-1], "a new pool after invalidate"
    assert step(runner, toy, 3).action is Action.REPLAY


def test_replay_gate_denies_stale_generation():
    storage = PagedKVStorage()
    layers = _kv()
    _bind(storage, layers)
    runner, toy, cap, stats = make(config(warmup_steps=0), storage=storage)
    step(runner, toy, 3)
    _bind(storage, layers)  # same identity: no listener call, but the generation moves
    assert runner.keys == (GraphKey(4, 16),)
    d = step(runner, toy, 3)
    assert d == Decision(Action.EAGER, GraphKey(4, 16), Reason.STORAGE_IDENTITY_CHANGED, 3)
    assert runner.keys == () and cap.replays == 1
    assert stats.fallbacks == {Reason.STORAGE_IDENTITY_CHANGED: 1}
    assert step(runner, toy, 3).action is Action.CAPTURE


def test_close_is_idempotent_and_final():
    storage = PagedKVStorage()
    _bind(storage, _kv())
    runner, toy, cap, _ = make(config(warmup_steps=0), storage=storage)
    step(runner, toy, 3)
    runner.close()
    runner.close()
    assert runner.closed and runner.keys == () and runner.pool_bytes == 0 and cap.releases == 1
    for call in (lambda: runner.step(3, 10, True), runner.precapture,
                 lambda: runner.decide(3, 10, True)):
        with pytest.raises(RuntimeError, match="after close"):
            call()
    with mock.patch.object(runner, "invalidate", wraps=runner.invalidate) as spy:
        storage.bind(_kv(n_blocks=8), phase="serving")  # identity change after close
    spy.assert_not_called()  # close() unsubscribed from the storage
    runner.invalidate(Reason.STORAGE_IDENTITY_CHANGED)  # no-op after close


def test_precapture_largest_first_with_prepare():
    runner, toy, cap, stats = make(config(context_buckets=(16,)))
    prepared = []
    result = runner.precapture(prepare=prepared.append)
    assert [k.batch_bucket for k in prepared] == [8, 4, 2, 1]
    assert set(result.values()) == {Reason.ELIGIBLE} and len(runner.keys) == 4
    assert runner.precapture([GraphKey(2, 16)]) == {GraphKey(2, 16): Reason.ELIGIBLE}
    assert cap.captures == 4
    assert stats.captures == 4 and stats.step_captures == 0, "no serving step waited for them"
    assert step(runner, toy, 2).action is Action.REPLAY, "precaptured keys skip warm-up"


def test_scratch_bytes_reported():
    runner, _, _, stats = make()
    runner.set_scratch_bytes(1234)
    assert (stats.pool_bytes, stats.scratch_bytes) == (0, 1234)
    with pytest.raises(ValueError):
        runner.set_scratch_bytes(-1)
