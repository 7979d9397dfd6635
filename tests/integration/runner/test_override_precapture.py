"""`capture_model` with precapture and the worker's idle-capture RPC on CPU: every key captured
through vLLM's `_dummy_run` in precapture order, at its context or token bucket, then replayed by
real steps without a new capture."""

from __future__ import annotations

import pytest

gpu_model_runner = pytest.importorskip("vllm.v1.worker.gpu_model_runner")
GPUModelRunner = gpu_model_runner.GPUModelRunner

from tests.integration.runner.bare_runner import (  # noqa: E402
    _mixed_graphs_on,
    _PlanRecorder,
    _step,
    _stepping_runner,
)


def test_precapture_plans_each_key_at_its_context_bucket():
    """capture_model (precapture=true): vLLM's _dummy_run per key, with every row at the key's
    context bucket (the decode kernel's split count is planned from it), largest key first; each
    key captured once, then replayed by real steps without a new capture."""
    import dataclasses
    import types

    import torch

    from vllm_moe_graphs.graphs.buckets import GraphKey, graph_config
    from vllm_moe_graphs.integration.startup.precapture import PrecaptureModel

    r, capture, mode_enum = _stepping_runner(warmup_steps=3)
    r.max_model_len = 4096
    config = graph_config(
        dataclasses.replace(r.moe_graphs.graphs.config, decode_batch_buckets=(2, 4)), 4,
        r.max_model_len)
    assert config.context_buckets == (2048, 4096)
    r.moe_graphs.graphs.config = config
    r.moe_graphs.config = dataclasses.replace(r.moe_graphs.config, precapture=True)
    calls = []

    def dummy_run(num_tokens, **kw):  # what vLLM's _dummy_run does with the model, in short
        if not kw.get("uniform_decode"):  # the kernel warm-up's prefill batches
            return None
        calls.append((num_tokens, kw))
        assert kw["is_graph_capturing"] is False and kw["uniform_decode"] is True
        mode, desc, *_ = r._determine_batch_execution_and_padding(
            num_tokens, num_tokens, None, 1, False)
        assert mode is mode_enum.FULL and desc.num_tokens == num_tokens  # the key's bucket
        ids = torch.arange(1, num_tokens + 1, dtype=torch.int32)
        return r.model(input_ids=ids, positions=ids.long())

    r._dummy_run = dummy_run
    r.max_num_tokens, r.input_batch.block_table = 64, types.SimpleNamespace(
        compute_slot_mapping=lambda *a: None)
    r.capture_model()
    assert [(n, kw["profile_seq_lens"]) for n, kw in calls] == [
        (4, 4096), (4, 2048), (2, 4096), (2, 2048)]
    assert all(kw["cudagraph_runtime_mode"] is mode_enum.FULL for _, kw in calls)
    assert r.moe_graphs.graphs.keys == tuple(sorted(GraphKey(b, c) for b in (2, 4)
                                                    for c in (2048, 4096)))
    assert capture.captures == 4 and not isinstance(r.model, PrecaptureModel)
    mode, desc, out = _step(r, 3, [1, 1, 1])  # contexts 10..12: key (4, 2048), no warm-up
    assert mode is mode_enum.FULL and desc.num_tokens == 4 and capture.captures == 4
    assert out[:, 0].tolist() == [2.0, 4.0, 6.0]


def _mixed_precapture_runner():
    """The stepping runner with token buckets 8 and 16 and decode buckets 2 and 4 at one context
    bucket (2048), vLLM's _dummy_run stood in: each FULL run (a capture) is recorded in `calls`
    as (tokens, uniform, profile_seq_lens), then as the padded step it was planned as (tokens,
    requests, uniform); eager runs (the kernel warm-up) do nothing. Returns (runner, capture,
    CUDAGraphMode, plan recorder, calls)."""
    import dataclasses
    import types

    import torch

    r, capture, mode_enum = _stepping_runner(warmup_steps=3)
    _mixed_graphs_on(r, token_buckets=(8, 16))
    graphs = r.moe_graphs.graphs
    graphs.config = dataclasses.replace(graphs.config, decode_batch_buckets=(2, 4),
                                        context_buckets=(2048,))
    builder = _PlanRecorder()
    r.moe_graphs.metadata_builders = [builder]
    calls = []

    def dummy_run(num_tokens, **kw):
        if kw.get("cudagraph_runtime_mode") is not mode_enum.FULL:
            return None  # the kernel warm-up's eager batches
        calls.append((num_tokens, kw["uniform_decode"], kw["profile_seq_lens"]))
        mode, desc, *_ = r._determine_batch_execution_and_padding(
            num_tokens, num_tokens, None, 1, False)
        assert mode is mode_enum.FULL
        calls.append((desc.num_tokens, desc.num_reqs, desc.uniform))
        ids = torch.arange(1, desc.num_tokens + 1, dtype=torch.int32)
        return r.model(input_ids=ids, positions=ids.long())

    r._dummy_run = dummy_run
    r.max_model_len = 2048
    r.max_num_tokens, r.input_batch.block_table = 16, types.SimpleNamespace(
        compute_slot_mapping=lambda *a: None)
    return r, capture, mode_enum, builder, calls


# key (16, 0, 4) from 4 one-token requests padded to 16 tokens, then (8, 0, 4), then the decode
# keys (4 and 2 rows at the 2048 context bucket)
PRECAPTURE_CALLS = [(4, False, 1), (16, 4, False), (4, False, 1), (8, 4, False),
                    (4, True, 2048), (4, 4, True), (2, True, 2048), (2, 2, True)]


def test_precapture_captures_every_token_bucket_with_mixed_graphs():
    """precapture with mixed_graphs: before the decode keys, one key per token bucket, largest
    first, each from vLLM's _dummy_run of one-token requests (as many as the key's padded
    requests) that the plan pads to the key's tokens as a non-uniform FULL batch, the varlen
    kernel's tile planned from the bucket; a real mixed step then replays without capture."""
    import dataclasses

    from vllm_moe_graphs.graphs.buckets import GraphKey
    from vllm_moe_graphs.graphs.kinds import StepKind

    r, capture, mode_enum, builder, calls = _mixed_precapture_runner()
    graphs = r.moe_graphs.graphs
    r.moe_graphs.config = dataclasses.replace(r.moe_graphs.config, precapture=True)
    r.capture_model()
    assert calls == PRECAPTURE_CALLS
    assert (None, 16) in builder.planned and (None, 8) in builder.planned
    assert set(graphs.keys) == {GraphKey(16, 0, 4), GraphKey(8, 0, 4), GraphKey(4, 2048),
                                GraphKey(2, 2048)}
    assert graphs.stats.captures_by_kind == {StepKind.MIXED: 2, StepKind.DECODE: 2}
    mode, desc, out = _step(r, 2, [5, 1])  # 6 tokens of 2 requests: key (8, 0, 4), replayed
    assert mode is mode_enum.FULL and (desc.num_tokens, desc.num_reqs) == (8, 4)
    assert capture.captures == 4 and capture.replays >= 1
    assert out[:, 0].tolist() == [2.0, 4.0, 6.0, 8.0, 10.0, 12.0]


def test_idle_capture_takes_one_key_per_call_in_precapture_order(caplog):
    """idle_capture: each call of the worker's RPC (the engine core's idle hook) makes the next
    dummy run precapture would and captures that key, and says whether a key is left; the
    call that captures the last key logs that idle capture is done, once; the keys then
    replay real steps; a key with a graph is not captured again."""
    import dataclasses
    import logging
    import types

    from vllm_moe_graphs.integration.worker import MoeGraphsWorker

    r, capture, mode_enum, _, calls = _mixed_precapture_runner()
    worker = types.SimpleNamespace(model_runner=r)
    r.moe_graphs.config = dataclasses.replace(r.moe_graphs.config, idle_capture=False)
    assert not MoeGraphsWorker.moe_graphs_idle_capture(worker), "idle_capture off: nothing"
    assert capture.captures == 0
    r.moe_graphs.config = dataclasses.replace(r.moe_graphs.config, idle_capture=True)
    with caplog.at_level(logging.INFO, logger="vllm.moe_graphs"):
        answers = [MoeGraphsWorker.moe_graphs_idle_capture(worker) for _ in range(5)]
    assert answers == [True, True, True, False, False], answers
    done = [m.getMessage() for m in caplog.records if "idle capture done" in m.getMessage()]
    assert done == ["moe_graphs: idle capture done: no key left to capture (4 graphs, 0 "
                    "quarantined, 0 denied now, pool 4 MiB)"], done
    assert calls == PRECAPTURE_CALLS and capture.captures == 4
    mode, desc, out = _step(r, 3, [1, 1, 1])  # a decode step of 3: key (4, 2048), no capture
    assert mode is mode_enum.FULL and desc.num_tokens == 4 and capture.captures == 4
    assert out[:, 0].tolist() == [2.0, 4.0, 6.0]


def test_idle_capture_says_it_is_done_when_every_key_is_denied(caplog, tmp_path):
    """With the kill file present from the start no key may be captured: the first idle call
    says idle capture is done (every key denied), once; with the file removed the next calls
    capture every key and say so again (what a benchmark waiting for the line needs)."""
    import dataclasses
    import logging
    import types

    from vllm_moe_graphs.graphs.runner import DecodeGraphRunner
    from vllm_moe_graphs.integration.worker import MoeGraphsWorker
    from vllm_moe_graphs.killswitch import KillSwitch

    r, capture, _, _, _ = _mixed_precapture_runner()
    kill = tmp_path / "kill"
    kill.touch()
    r.moe_graphs.graphs = DecodeGraphRunner(
        None, r.moe_graphs.graphs.config, storage=r.moe_graphs.storage, capture_fn=capture,
        new_pool=object, kill_switch=KillSwitch(str(kill), interval_s=0))
    r.moe_graphs.config = dataclasses.replace(r.moe_graphs.config, idle_capture=True)
    worker = types.SimpleNamespace(model_runner=r)

    def done_lines() -> list[str]:
        return [m.getMessage().split("(")[1] for m in caplog.records
                if "idle capture done" in m.getMessage()]

    with caplog.at_level(logging.INFO, logger="vllm.moe_graphs"):
        answers = [MoeGraphsWorker.moe_graphs_idle_capture(worker) for _ in range(3)]
        assert answers == [False] * 3 and capture.captures == 0
        assert done_lines() == ["0 graphs, 0 quarantined, 4 denied now, pool 0 MiB)"]
        kill.unlink()
        answers = [MoeGraphsWorker.moe_graphs_idle_capture(worker) for _ in range(5)]
    assert answers == [True, True, True, False, False] and capture.captures == 4
    assert done_lines()[1:] == ["4 graphs, 0 quarantined, 0 denied now, pool 4 MiB)"]
