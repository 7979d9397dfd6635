"""Bucket picking: exact edges, one past an edge, past the last bucket."""

from __future__ import annotations

import pytest

from vllm_moe_graphs.capability import Reason
from vllm_moe_graphs.config import MIXED_REQUESTS, PluginConfig
from vllm_moe_graphs.graphs.buckets import (
    GraphKey,
    all_keys,
    context_coverage,
    graph_config,
    pick_bucket,
    pick_key,
    pick_mixed_key,
    shared_context_buckets,
)
from vllm_moe_graphs.ops import choose_num_splits

BATCH = (1, 2, 4, 8)
CONTEXT = (16, 64)


@pytest.mark.parametrize("n, want", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, None)])
def test_pick_bucket_edges(n, want):
    assert pick_bucket(n, BATCH) == want


@pytest.mark.parametrize("num_reqs, ctx, want", [
    (1, 0, GraphKey(1, 16)),
    (1, 16, GraphKey(1, 16)),
    (3, 17, GraphKey(4, 64)),
    (8, 64, GraphKey(8, 64)),
    (9, 1, Reason.BATCH_TOO_LARGE),
    (8, 65, Reason.CONTEXT_TOO_LONG),
    (9, 65, Reason.BATCH_TOO_LARGE),  # batch is checked first
])
def test_pick_key(num_reqs, ctx, want):
    assert pick_key(num_reqs, ctx, BATCH, CONTEXT) == want


def test_pick_key_rejects_bad_input():
    with pytest.raises(ValueError, match="num_reqs"):
        pick_key(0, 1, BATCH, CONTEXT)
    with pytest.raises(ValueError, match="max_context"):
        pick_key(1, -1, BATCH, CONTEXT)


def test_graph_key_is_hashable_and_frozen():
    assert {GraphKey(1, 16): "a"}[GraphKey(1, 16)] == "a"
    with pytest.raises(AttributeError):
        GraphKey(1, 16).batch_bucket = 2  # type: ignore[misc]


def test_all_keys_largest_batch_first():
    keys = all_keys(BATCH, CONTEXT)
    assert len(keys) == 8 and keys[0] == GraphKey(8, 64) and keys[-1] == GraphKey(1, 16)
    assert [k.batch_bucket for k in keys] == sorted((k.batch_bucket for k in keys), reverse=True)


def test_attention_plans_every_graph_context_bucket():
    """The attention plan's contexts are the graph's fitted context buckets (so a key's bucket is
    always one of them), plus max_model_len for the longer contexts that run eager."""
    from vllm_moe_graphs.graphs.buckets import attention_context_buckets, context_bucket

    config = PluginConfig(context_buckets=(2048, 8192, 32768, 131072))
    graph = graph_config(config, 256, 40960).context_buckets
    attn = attention_context_buckets(config.context_buckets, 40960)
    assert attn == graph == (2048, 8192, 32768, 40960)
    short = attention_context_buckets((2048, 8192), 40960)
    assert short == (2048, 8192, 40960)
    assert set(graph_config(PluginConfig(context_buckets=(2048, 8192)), 256,
                            40960).context_buckets) <= set(short)
    assert [context_bucket(short, n) for n in (0, 2048, 2049, 9000, 50000)] == [
        2048, 2048, 8192, 40960, 40960]


def test_keys_with_one_attention_plan_share_the_smallest_context_bucket():
    plans = {(1, 16): "a", (1, 64): "b", (8, 16): "c", (8, 64): "c"}
    shared = shared_context_buckets((1, 8), (16, 64), lambda b, c: plans[(b, c)])
    assert shared == {(1, 16): 16, (1, 64): 64, (8, 16): 16, (8, 64): 16}


def test_decode_split_plans_leave_few_keys_on_the_h200():
    """The Qwen3-30B-A3B shape (4 KV heads) on the H200's 132 SMs, default buckets fitted to
    `vllm serve`'s max_num_seqs (1024) and max_model_len (40960) there: the split count
    differs by context bucket only for batches up to 4, so 21 batch buckets x 4 context
    buckets hold 24 distinct graphs, not 84."""
    cfg = graph_config(PluginConfig(), 1024, 40960)
    assert cfg.decode_batch_buckets[-1] == 1024 and len(cfg.decode_batch_buckets) == 21
    shared = shared_context_buckets(cfg.decode_batch_buckets, cfg.context_buckets,
                                    lambda b, c: choose_num_splits(b, 4, c, 132))
    assert len(shared) == 84 and len(set(shared.items())) == 84
    keys = {(b, c) for (b, _), c in shared.items()}
    assert len(keys) == 24, sorted(keys)
    assert {c for (b, c) in keys if b >= 8} == {2048}
    assert shared[(1, 40960)] == 8192 and shared[(4, 32768)] == 8192
    assert shared[(1024, 40960)] == 2048


def test_default_decode_buckets_pad_wide_batches_by_at_most_a_fifth():
    buckets = PluginConfig().decode_batch_buckets
    for batch in range(257, 1025):
        bucket = pick_bucket(batch, buckets)
        assert (bucket - batch) / bucket < 0.2, (batch, bucket)


def test_pick_mixed_key():
    tokens = (16, 64, 256)
    # one key per token bucket: requests padded to min(bucket, MIXED_REQUESTS, max_requests),
    # whatever the mix
    assert pick_mixed_key(6, 2, tokens, 8) == pick_mixed_key(16, 8, tokens, 8) \
        == GraphKey(16, 0, 8)
    assert pick_mixed_key(6, 2, tokens, 32) == pick_mixed_key(16, 16, tokens, 32) \
        == GraphKey(16, 0, 16)  # never more requests than tokens
    assert pick_mixed_key(64, 5, tokens, 8) == pick_mixed_key(40, 1, tokens, 8) \
        == GraphKey(64, 0, 8)
    assert pick_mixed_key(257, 2, tokens, 8) is Reason.STEP_TOO_LARGE
    assert pick_mixed_key(200, 9, tokens, 8) is Reason.BATCH_TOO_LARGE
    key = pick_mixed_key(6, 2, tokens, 8)
    assert not key.decode and GraphKey(16, 2048).decode and key != GraphKey(16, 0)
    with pytest.raises(ValueError, match="num_tokens >= num_reqs"):
        pick_mixed_key(1, 2, tokens, 8)


def test_a_mixed_step_past_mixed_requests_pads_to_a_power_of_two():
    """A saturated server's step: a decode batch wider than MIXED_REQUESTS next to a prefill
    chunk takes a key whose requests are the next power of two (at most the token bucket and
    the largest decode bucket): two more keys per token bucket at most; up to MIXED_REQUESTS
    requests every step of a token bucket shares one key."""
    tokens = (256, 512, 768, 1024, 8192)
    assert MIXED_REQUESTS == 256
    assert pick_mixed_key(8000, 256, tokens, 1024) == GraphKey(8192, 0, 256)
    assert pick_mixed_key(8000, 257, tokens, 1024) == GraphKey(8192, 0, 512)
    assert pick_mixed_key(8000, 700, tokens, 1024) == GraphKey(8192, 0, 1024)
    assert pick_mixed_key(500, 300, tokens, 1024) == GraphKey(512, 0, 512)
    assert pick_mixed_key(700, 600, tokens, 1024) == GraphKey(768, 0, 768)  # <= its tokens
    assert pick_mixed_key(1000, 1000, tokens, 1024) == GraphKey(1024, 0, 1024)
    assert pick_mixed_key(8000, 1025, tokens, 1024) is Reason.BATCH_TOO_LARGE
    # fitted to a smaller max_num_seqs, the largest decode bucket caps every key
    assert pick_mixed_key(8000, 600, tokens, 640) == GraphKey(8192, 0, 640)
    assert pick_mixed_key(8000, 48, tokens, 48) == GraphKey(8192, 0, 48)
    assert pick_mixed_key(8000, 49, tokens, 48) is Reason.BATCH_TOO_LARGE
    for reqs in range(1, 1025):  # every request count fits its key, at most twice over
        key = pick_mixed_key(8192, reqs, tokens, 1024)
        assert reqs <= key.request_bucket <= max(256, 2 * reqs), (reqs, key)


@pytest.mark.parametrize("max_num_seqs", [48, 256, 300, 640, 1024])
def test_mixed_keys_never_pad_requests_past_max_num_seqs(max_num_seqs):
    """vLLM's request-indexed buffers (and ours) hold max_num_seqs rows: whatever the step, a
    key's padded requests stay within them, hold the step's requests and fit its tokens."""
    cfg = graph_config(PluginConfig(), max_num_seqs, 40960, 8192)
    limit = cfg.decode_batch_buckets[-1]
    assert limit == min(max_num_seqs, 1024)
    for num_tokens in (1, 17, 255, 256, 257, 300, 511, 640, 1000, 4097, 8192):
        for num_reqs in sorted({1, 2, 255, 256, 257, 300, 511, 513, 640, 1000, 1024}):
            if num_reqs > num_tokens:
                continue
            key = pick_mixed_key(num_tokens, num_reqs, cfg.token_buckets, limit)
            if num_reqs > limit:
                assert key is Reason.BATCH_TOO_LARGE
                continue
            assert num_reqs <= key.request_bucket <= min(limit, key.batch_bucket), (
                num_tokens, num_reqs, key)


def test_mixed_requests_at_the_largest_decode_bucket_leaves_one_key_per_token_bucket():
    """`mixed_requests` at the largest decode batch bucket: every step of a token bucket, up to
    that many requests, pads to the one key the idle capture takes (the runner's `mixed_keys`),
    so a saturated server's wide steps meet no key of their own; below it, the default."""
    from vllm_moe_graphs.graphs.runner import DecodeGraphRunner

    wide = graph_config(PluginConfig(mixed_requests=1024), 1024, 40960, 8192)
    runner = DecodeGraphRunner(lambda rows: rows, wide)
    idle = set(runner.mixed_keys())
    assert len(idle) == len(wide.token_buckets)
    for num_tokens in (16, 300, 511, 640, 1000, 4097, 8192):
        for num_reqs in (1, 200, 256, 257, 513, 1000, 1024):
            if num_reqs <= num_tokens:
                key = pick_mixed_key(num_tokens, num_reqs, wide.token_buckets, 1024, 1024)
                assert key in idle, (num_tokens, num_reqs, key)
                assert key.request_bucket == min(key.batch_bucket, 1024)
    default = graph_config(PluginConfig(), 1024, 40960, 8192)
    assert default.mixed_requests == MIXED_REQUESTS == 256
    narrow = set(DecodeGraphRunner(lambda rows: rows, default).mixed_keys())
    assert pick_mixed_key(8000, 257, default.token_buckets, 1024) not in narrow  # a wider key
    assert pick_mixed_key(8000, 257, wide.token_buckets, 1024, 1024) in idle


def test_graph_config_fits_token_buckets_to_the_token_budget():
    cfg = PluginConfig(token_buckets=(16, 256, 4096, 8192))
    assert graph_config(cfg, 64, 4096, 2048).token_buckets == (16, 256, 2048)
    assert graph_config(cfg, 64, 4096, 8192).token_buckets == (16, 256, 4096, 8192)
    assert graph_config(cfg, 64, 4096).token_buckets == cfg.token_buckets


def test_context_coverage_names_the_uncovered_contexts_and_the_setting():
    buckets = PluginConfig().context_buckets
    assert context_coverage(buckets, 40960) is None  # Qwen3's 40960 positions: covered
    assert context_coverage(buckets, buckets[-1]) is None
    line = context_coverage(buckets, 262144)  # the 256k models
    assert line.startswith("decode steps whose context is past 131072 tokens (up to "
                           "max_model_len 262144) run eager (context_too_long)")
    assert '"context_buckets": [..., 262144]' in line
    # every such step would pick no key: the line says what pick_key does
    assert pick_key(1, 131073, (1,), buckets) is Reason.CONTEXT_TOO_LONG
