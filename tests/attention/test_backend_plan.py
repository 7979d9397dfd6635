"""CPU tier for the attention backend's plan: the metadata builder builds decode and mixed batches
into persistent buffers or reads vLLM's in place, plans the context bucket, the prefill path
and the split count, and serves cudagraph capture (Triton kernels under TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Must precede the first import of vllm_moe_graphs.ops (i.e. of @triton.jit).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("vllm")

# Raised inside triton's interpreter (scalar `__index__` on a 1-element array), not by us.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning")

from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

from vllm_moe_graphs.integration.attention.metadata import (  # noqa: E402
    INTERPRETER_NUM_SMS,
    MoeGraphsMetadataBuilder,
)
from vllm_moe_graphs.ops import choose_num_splits  # noqa: E402

from tests.attention.backend_env import (  # noqa: E402
    BLOCK_SIZE,
    HEAD_SIZE,
    LAYER,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    NULL_BLOCK,
    NUM_HEADS,
    NUM_KV_HEADS,
    Batch,
    Env,
    _assert_kv_written,
    _assert_matches_reference,
    _batch,
    _run_layer,
    _vllm_config,
)


def test_build_decode_batch(env):
    # FULL-graph style: 3 real decode rows padded to 4 (q_len 0, seq_len 0, null block).
    batch = _batch(env, [1, 1, 1], [17, 1, 40], pad_reqs=1, pad_tokens=1)
    md = env.builder.build(0, batch.cm)
    assert md.decode and md.num_reqs == 4 and md.num_actual_tokens == 4
    assert md.context_bucket == MAX_MODEL_LEN  # default buckets are all >= max_model_len
    num_sms = env.builder.num_sms
    assert md.num_splits == choose_num_splits(4, NUM_KV_HEADS, MAX_MODEL_LEN, num_sms)
    if md.num_splits > 1:
        assert tuple(md.workspace.shape) == (4, NUM_HEADS, md.num_splits, HEAD_SIZE + 2)
    else:
        assert md.workspace is None
    torch.testing.assert_close(md.seq_lens, batch.cm.seq_lens, atol=0, rtol=0)
    torch.testing.assert_close(md.query_start_loc, batch.cm.query_start_loc, atol=0, rtol=0)
    cols = -(-40 // BLOCK_SIZE)
    torch.testing.assert_close(md.block_table[:, :cols], batch.cm.block_table_tensor[:, :cols],
                               atol=0, rtol=0)
    assert md.seq_lens.tolist()[3] == 0 and md.block_table[3, 0].item() == NULL_BLOCK


def test_build_uses_persistent_buffers(env):
    """Same addresses for every step (what a captured graph reads), data refreshed each build."""
    first = env.builder.build(0, _batch(env, [1, 1], [30, 5], seed=1).cm)
    ptrs = (first.query_start_loc.data_ptr(), first.seq_lens.data_ptr(),
            first.block_table.data_ptr())
    second_batch = _batch(env, [1, 1], [3, 70], seed=2)
    second = env.builder.build(0, second_batch.cm)
    assert (second.query_start_loc.data_ptr(), second.seq_lens.data_ptr(),
            second.block_table.data_ptr()) == ptrs
    assert second.seq_lens.tolist() == [3, 70]
    if first.workspace is not None and second.workspace is not None:
        assert first.workspace.data_ptr() == second.workspace.data_ptr()
    assert second.block_table.stride(0) == env.builder.max_blocks  # one stride for every step


def _in_place(env: Env, batch: Batch, extra_cols: int = 3):
    """vLLM-style persistent buffers at the largest batch (a wider block table than ours, to
    show the row stride is read), filled with `batch`; the batch's metadata re-pointed at
    views of them, as V1's _build_attention_metadata hands them over."""
    dev, n = env.device, batch.cm.num_reqs
    qsl = torch.full((MAX_NUM_SEQS + 1,), -7, dtype=torch.int32, device=dev)
    seq = torch.full((MAX_NUM_SEQS,), -7, dtype=torch.int32, device=dev)
    table = torch.full((MAX_NUM_SEQS, env.builder.max_blocks + extra_cols), -7,
                       dtype=torch.int32, device=dev)
    qsl[: n + 1] = batch.cm.query_start_loc
    seq[:n] = batch.cm.seq_lens
    table[:n, : env.builder.max_blocks] = batch.cm.block_table_tensor
    cm = batch.cm.replace(query_start_loc=qsl[: n + 1], seq_lens=seq[:n],
                          block_table_tensor=table[:n])
    return (qsl, seq, table), dataclasses.replace(batch, cm=cm)


@pytest.mark.parametrize("q_lens,seq_lens,pad", [
    ([1, 1], [70, 129], 0),  # split-K on CPU
    ([1, 1, 1], [17, 1, 40], 1),  # a padded FULL-graph row
    ([1, 7, 20], [33, 40, 20], 1),  # mixed: the prefill kernel
])
def test_build_in_place_reads_vllm_buffers(env, q_lens, seq_lens, pad):
    builder = env.builder
    batch = _batch(env, q_lens, seq_lens, pad_reqs=pad, pad_tokens=pad)
    (qsl, seq, table), batch = _in_place(env, batch)
    own = (builder._query_start_loc.clone(), builder._seq_lens.clone(),
           builder._block_table.clone())
    builder.read_in_place(qsl, seq, table)
    try:
        md = builder.build(0, batch.cm)
        assert (md.query_start_loc.data_ptr(), md.seq_lens.data_ptr(),
                md.block_table.data_ptr()) == (qsl.data_ptr(), seq.data_ptr(), table.data_ptr())
        assert md.block_table.stride(0) == builder.max_blocks + 3
        for before, after in zip(own, (builder._query_start_loc, builder._seq_lens,
                                       builder._block_table)):
            assert torch.equal(before, after), "in place, the builder's buffers stay untouched"
        out = _run_layer(env, batch, md)
        _assert_kv_written(env, batch)
        _assert_matches_reference(env, batch, out)
        # a step whose metadata views other tensors gets the copies, as without read_in_place
        other = builder.build(0, _batch(env, q_lens, seq_lens, pad_reqs=pad, pad_tokens=pad).cm)
        assert other.seq_lens.data_ptr() == builder._seq_lens.data_ptr()
    finally:
        builder._in_place = None


def test_read_in_place_refuses_what_is_not_a_vllm_buffer(env):
    dev = env.device
    good = torch.zeros(MAX_NUM_SEQS, dtype=torch.int32, device=dev)
    table = torch.zeros(MAX_NUM_SEQS, 4, dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match="seq_lens must be a 1-D int32 tensor"):
        env.builder.read_in_place(good, good.long(), table)
    with pytest.raises(ValueError, match="block_table must be a 2-D int32"):
        env.builder.read_in_place(good, good, table.t())
    assert env.builder._in_place is None


def test_build_mixed_batch(env):
    # decode row + chunked prefill (cached prefix) + fresh prefill, one padded request
    batch = _batch(env, [1, 7, 20], [33, 40, 20], pad_reqs=1, pad_tokens=4)
    md = env.builder.build(0, batch.cm)
    assert not md.decode and md.num_splits == 1 and md.workspace is None
    assert (md.num_reqs, md.num_actual_tokens, md.max_query_len) == (4, 32, 20)
    assert md.query_start_loc.tolist() == [0, 1, 8, 28, 28]
    assert md.seq_lens.tolist() == [33, 40, 20, 0]


def test_context_bucket_from_plugin_config(tmp_path):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = _vllm_config(tmp_path, device, moe_graphs={"context_buckets": [64, 128, 4096]})
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                             head_size=HEAD_SIZE, dtype=torch.float32)
    builder = MoeGraphsMetadataBuilder(spec, [LAYER], cfg, device)
    assert builder.context_buckets == (64, 128, MAX_MODEL_LEN)
    for max_seq_len, bucket in [(1, 64), (64, 64), (65, 128), (129, 256), (256, 256)]:
        cm = CommonAttentionMetadata(
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device),
            query_start_loc_cpu=torch.tensor([0, 1], dtype=torch.int32),
            seq_lens=torch.tensor([max_seq_len], dtype=torch.int32, device=device),
            num_reqs=1, num_actual_tokens=1, max_query_len=1, max_seq_len=max_seq_len,
            block_table_tensor=torch.zeros(1, builder.max_blocks, dtype=torch.int32,
                                           device=device),
            slot_mapping=torch.zeros(1, dtype=torch.int64, device=device),
        )
        md = builder.build(0, cm)
        assert md.context_bucket == bucket
        assert md.num_splits == choose_num_splits(1, NUM_KV_HEADS, bucket, builder.num_sms)
        # a step planned for a graph key plans the key's bucket, whatever its longest context
        builder.plan_for(MAX_MODEL_LEN)
        md = builder.build(0, cm)
        assert md.context_bucket == MAX_MODEL_LEN
        assert md.num_splits == choose_num_splits(1, NUM_KV_HEADS, MAX_MODEL_LEN,
                                                  builder.num_sms)
        builder.plan_for(None)


@pytest.mark.parametrize("choice,level", [("flash_attn", "WARNING"), ("auto", "INFO")])
def test_flash_attn_prefill_falls_back_to_ours_where_fa3_is_absent(tmp_path, caplog, choice,
                                                                   level):
    """prefill_attention flash_attn, or the default auto, where vLLM's FA3 cannot run (here:
    no GPU): the builder says why once (a warning when FA3 was asked for by name) and plans
    steps with prefill tokens for the plugin's kernel."""
    import logging

    from vllm_moe_graphs.integration.attention.flash_attn import flash_attn_problem

    assert flash_attn_problem()  # no FA3 on a CPU machine
    device = torch.device("cpu")
    cfg = _vllm_config(tmp_path, device, moe_graphs={"prefill_attention": choice})
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                             head_size=HEAD_SIZE, dtype=torch.float32)
    with caplog.at_level(logging.INFO, logger="vllm.moe_graphs"):
        builder = MoeGraphsMetadataBuilder(spec, [LAYER], cfg, device)
    assert builder.flash_attn is None
    said = [r for r in caplog.records if f"prefill_attention {choice}: FlashAttention 3 is "
            "not available (" in r.getMessage() and "use the plugin's kernel" in r.getMessage()]
    assert [r.levelname for r in said] == [level], caplog.records
    assert "fa3_schedule" not in builder.persistent_buffers()


def test_build_for_cudagraph_capture(env):
    batch = _batch(env, [1, 1, 1], [17, 1, 40], pad_reqs=1, pad_tokens=1)
    md = env.builder.build_for_cudagraph_capture(batch.cm)
    assert md.seq_lens.tolist() == [1, 1, 1, 0]  # seq_len = q_len: smallest valid context
    mixed = _batch(env, [1, 7, 20], [33, 40, 20], pad_reqs=1, pad_tokens=4)
    assert env.builder.build_for_cudagraph_capture(mixed.cm).seq_lens.tolist() == [1, 7, 20, 0]


def test_workspace_covers_every_batch(env):
    builder = env.builder
    assert builder.num_sms == (INTERPRETER_NUM_SMS if env.device.type == "cpu"
                               else torch.cuda.get_device_properties(env.device)
                               .multi_processor_count)
    for batch in range(1, MAX_NUM_SEQS + 1):
        splits = builder.num_splits(batch, MAX_MODEL_LEN)
        if splits > 1:
            assert builder._workspace_view(batch, splits).shape[0] == batch


def test_decode_keys_share_a_graph_where_the_builder_plans_one_launch(env):
    """`runner/buffers.decode_split_plan` hands the graph runner our builder's split counts: a
    decode step picks the key of the smallest context bucket the builder plans the same split
    count for, and keys with different counts stay apart."""
    from types import SimpleNamespace

    from vllm_moe_graphs.config import PluginConfig
    from vllm_moe_graphs.graphs import DecodeGraphRunner
    from vllm_moe_graphs.integration.runner.buffers import decode_split_plan

    builder = env.builder
    group = SimpleNamespace(get_metadata_builder=lambda: builder)
    assert decode_split_plan(SimpleNamespace(attn_groups=[])) is None
    plan = decode_split_plan(SimpleNamespace(attn_groups=[[group]]))
    cfg = PluginConfig(decode_batch_buckets=(1, 2, 4, 8), context_buckets=(64, 128, 256))
    graphs = DecodeGraphRunner(None, cfg, capture_fn=lambda *a, **k: None, new_pool=object,
                               decode_plan=plan)
    seen = set()
    for batch in cfg.decode_batch_buckets:
        for context in cfg.context_buckets:
            key = graphs.decide(batch, context, True).key
            splits = builder.num_splits(batch, context)
            assert builder.num_splits(batch, key.context_bucket) == splits
            assert key.context_bucket == min(c for c in cfg.context_buckets
                                             if builder.num_splits(batch, c) == splits)
            seen.add((batch, splits))
    assert len(graphs.all_keys()) == len(seen), graphs.all_keys()
    if env.device.type == "cpu":  # 4 stand-in SMs: batches 4 and 8 plan fewer splits
        assert len(seen) == 9, seen
