"""The per-step path on CPU: vLLM's own `_determine_batch_execution_and_padding` body runs under
the plugin's override, stepping a toy model through warm-up, capture and replay (decode and
mixed keys, the kill switch, eager fallbacks, the LM head inside the forward, attention plans)."""

from __future__ import annotations

import pytest

gpu_model_runner = pytest.importorskip("vllm.v1.worker.gpu_model_runner")
GPUModelRunner = gpu_model_runner.GPUModelRunner

from vllm_moe_graphs.integration.runner import buffers  # noqa: E402
from tests.integration.runner.bare_runner import (  # noqa: E402
    _in_step,
    _kv,
    _mixed_graphs_on,
    _PlanRecorder,
    _step,
    _stepping_runner,
)


class _ToyLM:
    """What GraphLogits reads of a vLLM causal LM: the LM head weight [padded vocab, hidden],
    the logits processor's vocabulary, and compute_logits (here counting its calls)."""

    def __init__(self, hidden: int = 1, vocab: int = 5, padded: int = 8) -> None:
        import types

        import torch

        self.lm_head = types.SimpleNamespace(
            weight=torch.arange(padded * hidden, dtype=torch.float32).reshape(padded, hidden))
        self.logits_processor = types.SimpleNamespace(org_vocab_size=vocab)
        self.stock_calls = 0

    def compute_logits(self, hidden):
        self.stock_calls += 1
        return (hidden @ self.lm_head.weight.t())[:, :self.logits_processor.org_vocab_size]


def test_decode_graph_paths_compute_the_logits_inside_the_forward():
    import torch

    from vllm_moe_graphs.integration.model.graph_logits import GraphLogits

    r, capture, mode_enum = _stepping_runner(warmup_steps=1)
    lm = _ToyLM()
    r.moe_graphs.logits = GraphLogits(lm, max_rows=4)
    for expected in ("warm-up", "capture", "replay", "replay"):
        with _in_step(r, 3, [1, 1, 1]) as (mode, desc, out):
            # execute_model: hidden_states[logits_indices] with DecodeInputs' slice(0, n)
            logits = lm.compute_logits(out[slice(0, 3)])
        assert torch.equal(logits, (out @ lm.lm_head.weight.t())[:, :5]), expected
        assert logits.data_ptr() == r.moe_graphs.logits.buffer.data_ptr(), expected  # the buffer
        assert lm.stock_calls == 0, expected
    assert capture.captures == 1 and r.moe_graphs.logits.handed_over == 4
    # the hand-over is taken once, for the exact view: anything else is vLLM's own path
    lm.compute_logits(out[slice(0, 3)])
    assert lm.stock_calls == 1
    with _in_step(r, 3, [1, 1, 1]) as (_, _, out):
        lm.compute_logits(out.clone())  # e.g. vLLM's index kernel's copy of the rows
    assert lm.stock_calls == 2
    with _in_step(r, 3, [1, 1, 1]) as (_, _, out):
        pass  # a step whose logits vLLM never asks for: the hand-over ends with the step
    lm.compute_logits(out[slice(0, 3)])
    assert lm.stock_calls == 3
    # a mixed batch's forward has no LM head (all its tokens' rows): vLLM computes
    with _in_step(r, 2, [5, 1]) as (_, _, out):
        lm.compute_logits(out[slice(0, 2)])
    assert lm.stock_calls == 4 and r.moe_graphs.logits.handed_over == 4
    r.moe_graphs.logits.uninstall()
    assert "compute_logits" not in vars(lm)


def test_logits_stay_with_vllm_past_the_buffer_and_on_unpadded_fallbacks(tmp_path):
    from vllm_moe_graphs.integration.model.graph_logits import GraphLogits
    from vllm_moe_graphs.killswitch import KillSwitch

    r, capture, mode_enum = _stepping_runner(warmup_steps=0)
    lm = _ToyLM()
    r.moe_graphs.logits = GraphLogits(lm, max_rows=2)
    with _in_step(r, 3, [1, 1, 1]) as (_, _, out):  # bucket 4 > 2 rows: no LM head in it
        lm.compute_logits(out[slice(0, 3)])
    assert capture.captures == 1
    assert lm.stock_calls == 1 and r.moe_graphs.logits.handed_over == 0
    with _in_step(r, 2, [1, 1]) as (_, _, out):  # bucket 2: it has
        lm.compute_logits(out[slice(0, 2)])
    assert lm.stock_calls == 1 and r.moe_graphs.logits.handed_over == 1
    kill = tmp_path / "kill"
    kill.touch()
    r.moe_graphs.graphs._kill = KillSwitch(str(kill), interval_s=0)
    with _in_step(r, 2, [1, 1]) as (mode, _, out):  # the kill switch: eager at the key's
        lm.compute_logits(out[slice(0, 2)])          # shape, the LM head still in the forward
    assert mode is mode_enum.FULL
    assert lm.stock_calls == 1 and r.moe_graphs.logits.handed_over == 2
    with _in_step(r, 2, [5, 1]) as (mode, _, out):  # a mixed batch: eager unpadded, vLLM's
        lm.compute_logits(out[slice(0, 6)])          # LM head
    assert mode is mode_enum.NONE
    assert lm.stock_calls == 2 and r.moe_graphs.logits.handed_over == 2


def test_replayed_fast_steps_build_no_attention_metadata(monkeypatch, tmp_path):
    from vllm_moe_graphs.killswitch import KillSwitch

    r, capture, mode_enum = _stepping_runner(warmup_steps=1)
    monkeypatch.setattr(GPUModelRunner, "_build_attention_metadata",
                        lambda self, *a, **kw: ("built", None))
    r.moe_graphs.lean_replay = True
    built = []
    for _ in range(4):  # warm-up, capture (both run the model), replay, replay
        _step(r, 3, [1, 1, 1], built, fast_inputs=True)
    assert built == ["built", "built", {}, {}] and capture.replays == 3
    _step(r, 2, [5, 1], built, fast_inputs=True)  # a mixed batch
    _step(r, 3, [1, 1, 1], built)  # inputs prepared by vLLM's path
    r.moe_graphs.lean_replay = False  # a builder that is not ours
    _step(r, 3, [1, 1, 1], built, fast_inputs=True)
    r.moe_graphs.lean_replay = True
    kill = tmp_path / "kill"
    kill.touch()
    r.moe_graphs.graphs._kill = KillSwitch(str(kill), interval_s=0)
    _step(r, 3, [1, 1, 1], built, fast_inputs=True)  # eager fallback
    assert built[4:] == ["built"] * 4


def test_plan_builders_hands_every_builder_its_keys_launch():
    """A decode key plans its context bucket, a key with prefill tokens its token bucket (the
    varlen kernel's tile), no key the step's own; every builder alike."""
    from vllm_moe_graphs.graphs.buckets import GraphKey

    builders = [_PlanRecorder(), _PlanRecorder()]
    buffers.plan_builders(builders, GraphKey(4, 256))
    buffers.plan_builders(builders, GraphKey(16, 0, 8))
    buffers.plan_builders(builders, None)
    assert [b.planned for b in builders] == [[(256, None), (None, 16), (None, None)]] * 2


def test_graph_steps_plan_attention_for_their_keys_context_bucket():
    """The step plan hands its graph key's context bucket to our metadata builders (the split
    count a key's graph is captured with), none to an eager step, and clears it after the step."""
    r, capture, mode_enum = _stepping_runner(warmup_steps=1)
    builder = _PlanRecorder()
    r.moe_graphs.metadata_builders = [builder]
    key = r.moe_graphs.graphs.decide(3, 12, True).key  # contexts 10..12
    for _ in range(3):  # warm-up, capture, replay
        _step(r, 3, [1, 1, 1])
    _step(r, 2, [5, 1])  # mixed: eager, the builder picks its own bucket
    assert builder.planned == [(key.context_bucket, None), (None, None)] * 3 + [
        (None, None)] * 2, builder.planned


def test_mixed_steps_replay_from_token_buckets_with_mixed_graphs():
    """mixed_graphs: a step with prefill tokens pads to its token bucket's key (requests padded
    to min(bucket, largest decode bucket)) as a non-uniform FULL batch, warms up, is captured and replayed like a decode key, hands
    vLLM all its real tokens' rows, and plans the varlen kernel's tile from the key."""
    from vllm_moe_graphs.capability import Reason
    from vllm_moe_graphs.graphs.buckets import GraphKey
    from vllm_moe_graphs.graphs.kinds import StepKind

    r, capture, mode_enum = _stepping_runner(warmup_steps=1)
    _mixed_graphs_on(r)
    builder = _PlanRecorder()
    r.moe_graphs.metadata_builders = [builder]
    for expected in ("warm-up", "capture", "replay"):
        mode, desc, out = _step(r, 2, [5, 1])  # 6 query tokens of 2 requests: key (8, 0, 8)
        assert mode is mode_enum.FULL, expected
        assert (desc.num_tokens, desc.num_reqs, desc.uniform) == (8, 8, False), expected
        assert out[:, 0].tolist() == [2.0, 4.0, 6.0, 8.0, 10.0, 12.0], expected
    assert capture.captures == 1 and capture.replays == 2
    assert r.moe_graphs.graphs.keys == (GraphKey(8, 0, 8),)
    assert builder.planned == [(None, 8), (None, None)] * 3  # the key's tile, then cleared
    mode, desc, out = _step(r, 5, [3, 2, 1, 1, 1])  # another mix, same bucket: same graph
    assert mode is mode_enum.FULL and (desc.num_tokens, desc.num_reqs) == (8, 8)
    assert out[:, 0].tolist() == [2.0 * i for i in range(1, 9)] and capture.replays == 3
    mode, desc, out = _step(r, 1, [12])  # a prompt alone: its own key (16, 0, 16), warm-up
    assert mode is mode_enum.FULL and (desc.num_tokens, desc.num_reqs) == (16, 16)
    assert out.shape == (12, 1)
    # past the last token bucket: eager, unpadded, counted as step_too_large
    mode, desc, out = _step(r, 2, [10, 9])
    assert mode is mode_enum.NONE and desc.num_tokens == 19 and out.shape == (19, 1)
    stats = r.moe_graphs.graphs.stats
    assert stats.fallbacks == {Reason.STEP_TOO_LARGE: 1}
    # counted under the step's kind (the metrics' `kind` label)
    assert stats.replays_by_kind == {StepKind.MIXED: 3}  # the capture's replay and two more
    assert stats.fallbacks_by_kind == {(Reason.STEP_TOO_LARGE, StepKind.PREFILL): 1}
    # decode steps keep their own keys next to the mixed ones
    mode, desc, out = _step(r, 3, [1, 1, 1])
    assert mode is mode_enum.FULL and (desc.num_tokens, desc.uniform) == (4, True)


def test_mixed_graphs_off_and_cascade_attention_run_eager():
    import numpy as np
    import torch

    from vllm_moe_graphs.capability import Reason

    r, capture, mode_enum = _stepping_runner(warmup_steps=0)
    mode, desc, out = _step(r, 2, [5, 1])  # mixed_graphs off: mixed steps eager, mixed_batch
    assert mode is mode_enum.NONE and out.shape == (6, 1)
    _mixed_graphs_on(r)
    with r.moe_graphs.step():  # vLLM chose cascade attention: eager whatever the kind
        mode, desc, *_ = r._determine_batch_execution_and_padding(
            6, 2, np.array([5, 1], dtype=np.int32), 5, True)
        ids = torch.arange(1, 7, dtype=torch.int32)
        r._model_forward(input_ids=ids, positions=ids.long())
    assert mode is mode_enum.NONE
    assert r.moe_graphs.graphs.stats.fallbacks == {Reason.MIXED_BATCH: 1,
                                                   Reason.CASCADE_ATTENTION: 1}
    assert capture.captures == 0


def test_decode_steps_pad_to_the_bucket_warm_up_capture_replay_and_slice():
    r, capture, mode_enum = _stepping_runner(warmup_steps=1)
    # 3 decode rows -> bucket 4: padded FULL descriptor; the model sees 4 rows, vLLM gets 3
    for expected in ("warm-up", "capture", "replay", "replay"):
        mode, desc, out = _step(r, 3, [1, 1, 1])
        assert mode is mode_enum.FULL and (desc.num_tokens, desc.num_reqs) == (4, 4), expected
        assert out.shape == (3, 1) and out[:, 0].tolist() == [2.0, 4.0, 6.0], expected
    assert capture.captures == 1 and capture.replays == 3  # one replay right after capture


def test_mixed_batch_runs_eager_unpadded_and_keeps_every_token():
    r, capture, mode_enum = _stepping_runner()
    mode, desc, out = _step(r, 2, [5, 1])  # a prefill chunk next to a decode row
    assert mode is mode_enum.NONE and desc.num_tokens == 6
    assert out.shape == (6, 1) and capture.captures == 0


def test_kill_switch_runs_decode_eager_at_the_keys_shape(tmp_path):
    """Under the kill switch a step that has a key runs eager at the key's padded size: the
    same kernels on the same rows as its graph, so flipping the switch changes no output."""
    from vllm_moe_graphs.killswitch import KillSwitch

    r, capture, mode_enum = _stepping_runner(warmup_steps=0)
    _step(r, 3, [1, 1, 1])  # captured
    kill = tmp_path / "kill"
    kill.touch()
    r.moe_graphs.graphs._kill = KillSwitch(str(kill), interval_s=0)
    mode, desc, out = _step(r, 3, [1, 1, 1])
    assert mode is mode_enum.FULL and (desc.num_tokens, desc.num_reqs) == (4, 4)
    assert out.shape == (3, 1) and out[:, 0].tolist() == [2.0, 4.0, 6.0]
    assert capture.replays == 1 and r.moe_graphs.graphs.keys  # graphs kept, none replayed


def test_swapped_kv_tensor_drops_graphs_before_the_next_replay():
    r, capture, mode_enum = _stepping_runner(warmup_steps=0)
    _step(r, 3, [1, 1, 1])
    assert r.moe_graphs.graphs.keys
    r.compilation_config.static_forward_context["model.layers.0.self_attn.attn"].kv_cache = _kv()
    mode, desc, out = _step(r, 3, [1, 1, 1])
    # caught in the per-step check: graphs dropped; the bare runner has no layer registry, so
    # no fresh bind happens and the step runs eager with the storage's reason
    assert not r.moe_graphs.graphs.keys and capture.replays == 1
    assert mode is mode_enum.NONE and out.shape == (3, 1)
    assert r.moe_graphs.storage.proof().reason.value == "storage_identity_changed"


def test_dummy_runs_outside_execute_model_are_left_to_vllm():
    r, capture, mode_enum = _stepping_runner(warmup_steps=0)
    mode, desc, out = _step(r, 3, [1, 1, 1], executing=False)
    assert mode is mode_enum.NONE and desc.num_tokens == 3 and capture.captures == 0
