"""The vLLM objects of the attention backend's CPU tests, all real and built on CPU: a `VllmConfig`
from a shrunken shipped Qwen3 shape, vLLM's own `Attention` layer carrying our backend, the
layer's KV cache allocated as vLLM's runners do (`make_env`; the `env` fixture of conftest.py),
`CommonAttentionMetadata` batches on CPU tensors (`_batch`), one layer's forward through vLLM's
`unified_kv_cache_update` / `unified_attention_with_output` (`_run_layer`) and its check against
the float64 references of `vllm_moe_graphs/ops/reference.py`. Float32 maths, tiny shapes."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Must precede the first import of vllm_moe_graphs.ops (i.e. of @triton.jit).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import json  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("vllm")

from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.layers.attention import Attention  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402

from vllm_moe_graphs.integration.attention.backend import MoeGraphsAttentionBackend  # noqa: E402
from vllm_moe_graphs.integration.attention.metadata import (  # noqa: E402
    MoeGraphsAttentionMetadata,
    MoeGraphsMetadataBuilder,
)
from vllm_moe_graphs.model_configs import shape_dir  # noqa: E402
from vllm_moe_graphs.ops import split_kv_cache  # noqa: E402
from vllm_moe_graphs.ops.reference import (  # noqa: E402
    reference_paged_decode,
    reference_paged_prefill,
)


Backend = MoeGraphsAttentionBackend
ATOL = RTOL = 2e-5  # float32 kernels vs float64 reference (as in tests/ops)
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 4, 2, 64  # GQA group 2
BLOCK_SIZE, NUM_BLOCKS, MAX_MODEL_LEN, MAX_NUM_SEQS = 16, 48, 256, 8
LAYER = "model.layers.0.self_attn.attn"
NULL_BLOCK = 0  # vLLM's reserved null block: padded block-table rows point at it


def _vllm_config(tmp_dir, device: torch.device, **additional) -> VllmConfig:
    """A real VllmConfig over the qwen3-0.6b shape shrunk to Hq=4, Hkv=2, D=64 (one layer)."""
    with open(os.path.join(shape_dir("qwen3-0.6b"), "config.json")) as f:
        hf = json.load(f)
    hf.update(num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS, head_dim=HEAD_SIZE,
              hidden_size=256, intermediate_size=512, num_hidden_layers=1,
              max_position_embeddings=2 * MAX_MODEL_LEN, vocab_size=512,
              bos_token_id=0, eos_token_id=0)
    path = os.path.join(str(tmp_dir), "config.json")
    with open(path, "w") as f:
        json.dump(hf, f)
    model_config = ModelConfig(model=str(tmp_dir), skip_tokenizer_init=True, dtype="float32",
                               max_model_len=MAX_MODEL_LEN)
    return VllmConfig(
        model_config=model_config,
        device_config=DeviceConfig(device=device.type),
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        scheduler_config=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN,
                                         max_num_batched_tokens=MAX_MODEL_LEN,
                                         is_encoder_decoder=False),
        additional_config=dict(additional),
    )


@dataclasses.dataclass
class Env:
    vllm_config: VllmConfig
    layer: Attention
    builder: MoeGraphsMetadataBuilder
    kv_cache: torch.Tensor  # the per-layer tensor as vLLM allocates it
    key_cache: torch.Tensor  # [NB, BS, Hkv, D] views
    value_cache: torch.Tensor
    device: torch.device


def _allocate_kv_cache(device: torch.device) -> torch.Tensor:
    """As vLLM's runners do: backend shape, permuted into the backend's stride order."""
    shape = Backend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    order = Backend.get_kv_cache_stride_order()
    raw = torch.empty([shape[i] for i in order], dtype=torch.float32, device=device)
    return raw.permute(*[order.index(i) for i in range(len(order))])


def make_env(tmp_dir) -> Env:
    """vLLM's Attention layer over our backend, its metadata builder and its KV cache, on the GPU
    where there is one (the `env` fixture of conftest.py; `tmp_dir` takes the model config)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    vllm_config = _vllm_config(tmp_dir, device)
    with set_current_vllm_config(vllm_config):
        layer = Attention(NUM_HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, num_kv_heads=NUM_KV_HEADS,
                          cache_config=vllm_config.cache_config, prefix=LAYER,
                          attn_backend=Backend)
        spec = layer.get_kv_cache_spec(vllm_config)
        builder = Backend.get_builder_cls()(spec, [LAYER], vllm_config, device)
        kv_cache = _allocate_kv_cache(device)
    layer.kv_cache = kv_cache  # what vLLM's bind_kv_cache does
    key_cache, value_cache = split_kv_cache(kv_cache, HEAD_SIZE)
    return Env(vllm_config, layer, builder, kv_cache, key_cache, value_cache, device)


@dataclasses.dataclass
class Batch:
    cm: CommonAttentionMetadata
    query: torch.Tensor  # [T, Hq * D]
    key: torch.Tensor  # [T, Hkv * D]
    value: torch.Tensor
    num_real_reqs: int
    num_real_tokens: int
    q_lens: list[int]
    seq_lens: list[int]


def _batch(env: Env, q_lens, seq_lens, *, pad_reqs=0, pad_tokens=0, seed=0) -> Batch:
    """A batch as vLLM's V1 runner pads it for a FULL graph: padded rows have q_len 0, seq_len 0
    and the null block; padded tokens carry slot -1. Cached context is random, every other cache
    slot is NaN, so a read of an unwritten slot or a write through slot -1 shows up."""
    gen = torch.Generator().manual_seed(seed)
    dev = env.device
    num_reqs, num_tokens = len(q_lens) + pad_reqs, sum(q_lens) + pad_tokens
    env.kv_cache.fill_(float("nan"))
    table = torch.full((num_reqs, env.builder.max_blocks), NULL_BLOCK, dtype=torch.int32)
    free = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
    slots = torch.full((num_tokens,), -1, dtype=torch.int64)
    token = 0
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        pages = [free.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        pos = torch.arange(seq_len)
        slot = table[i, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        ctx = seq_len - q_len  # cached prefix, already in the cache
        kv = torch.randn(2, ctx, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dev)
        env.key_cache[slot[:ctx] // BLOCK_SIZE, slot[:ctx] % BLOCK_SIZE] = kv[0]
        env.value_cache[slot[:ctx] // BLOCK_SIZE, slot[:ctx] % BLOCK_SIZE] = kv[1]
        slots[token : token + q_len] = slot[ctx:]
        token += q_len
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    starts += [starts[-1]] * pad_reqs  # non-decreasing, as vLLM pads query_start_loc
    qsl = torch.tensor(starts, dtype=torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=qsl.to(dev),
        query_start_loc_cpu=qsl,
        seq_lens=torch.tensor(list(seq_lens) + [0] * pad_reqs, dtype=torch.int32, device=dev),
        num_reqs=num_reqs,
        num_actual_tokens=num_tokens,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=table.to(dev),
        slot_mapping=slots.to(dev),
    )
    query = torch.randn(num_tokens, NUM_HEADS * HEAD_SIZE, generator=gen).to(dev)
    key = torch.randn(num_tokens, NUM_KV_HEADS * HEAD_SIZE, generator=gen).to(dev)
    value = torch.randn(num_tokens, NUM_KV_HEADS * HEAD_SIZE, generator=gen).to(dev)
    return Batch(cm, query, key, value, len(q_lens), sum(q_lens), list(q_lens), list(seq_lens))


def _run_layer(env: Env, batch: Batch, metadata: MoeGraphsAttentionMetadata) -> torch.Tensor:
    """vLLM's Attention.forward under a forward context: KV update, then our forward."""
    with set_current_vllm_config(env.vllm_config), set_forward_context(
        {LAYER: metadata}, env.vllm_config, num_tokens=batch.cm.num_actual_tokens,
        slot_mapping={LAYER: batch.cm.slot_mapping},
    ):
        out = env.layer(batch.query, batch.key, batch.value)
    return out.view(-1, NUM_HEADS, HEAD_SIZE)


def _reference(env: Env, batch: Batch) -> torch.Tensor:
    n, b = batch.num_real_tokens, batch.num_real_reqs
    query = batch.query.view(-1, NUM_HEADS, HEAD_SIZE)[:n]
    table, seq_lens = batch.cm.block_table_tensor[:b], batch.cm.seq_lens[:b]
    scale = HEAD_SIZE**-0.5
    if max(batch.q_lens) == 1:
        return reference_paged_decode(query, env.key_cache, env.value_cache, table, seq_lens,
                                      scale)
    return reference_paged_prefill(query, env.key_cache, env.value_cache, table,
                                   batch.cm.query_start_loc[: b + 1], seq_lens, scale)


def _assert_kv_written(env: Env, batch: Batch) -> None:
    """New K/V landed at their slots; padded tokens (slot -1) wrote nothing."""
    slots = batch.cm.slot_mapping[: batch.num_real_tokens]
    key = batch.key.view(-1, NUM_KV_HEADS, HEAD_SIZE)[: batch.num_real_tokens]
    value = batch.value.view(-1, NUM_KV_HEADS, HEAD_SIZE)[: batch.num_real_tokens]
    torch.testing.assert_close(env.key_cache[slots // BLOCK_SIZE, slots % BLOCK_SIZE], key,
                               atol=0, rtol=0)
    torch.testing.assert_close(env.value_cache[slots // BLOCK_SIZE, slots % BLOCK_SIZE], value,
                               atol=0, rtol=0)
    filled = int(torch.isfinite(env.key_cache).all(dim=-1).all(dim=-1).sum())
    assert filled == sum(batch.seq_lens), "a padded token or stray write touched the cache"


def _assert_matches_reference(env: Env, batch: Batch, out: torch.Tensor) -> None:
    rows = batch.num_real_tokens
    assert torch.isfinite(out[:rows]).all(), "non-finite output: unwritten row or NaN slot read"
    torch.testing.assert_close(out[:rows].double(), _reference(env, batch), atol=ATOL, rtol=RTOL)
