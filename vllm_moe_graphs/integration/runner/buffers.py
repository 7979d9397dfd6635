"""The V1 runner's tensors a decode graph depends on: the KV tensor of each attention layer, the
persistent input and metadata buffers a replay reads, and our metadata builders' in-place reads.
Functions of a `MoeGraphsModelRunner` (vLLM 0.26.0 attribute names)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from vllm_moe_graphs.graphs.buckets import GraphKey


def kv_tensors(runner: Any, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Layer name -> the KV tensor vLLM bound to that layer (`bind_kv_cache`)."""
    ctx: dict[str, Any] = runner.compilation_config.static_forward_context
    out = {}
    for name in names:
        t = getattr(ctx.get(name), "kv_cache", None)
        if isinstance(t, torch.Tensor) and t.numel():
            out[name] = t
    return out


def graph_buffers(runner: Any) -> dict[str, torch.Tensor]:
    """The persistent buffers a decode graph reads (vLLM's inputs and our metadata)."""
    from vllm_moe_graphs.integration.attention.metadata import MoeGraphsMetadataBuilder

    bufs = {"input_ids": runner.input_ids.gpu, "positions": runner.positions,
            "query_start_loc": runner.query_start_loc.gpu, "seq_lens": runner.seq_lens}
    for gid, table in enumerate(runner.input_batch.block_table.block_tables):
        bufs[f"block_table.{gid}"] = table.block_table.gpu
        bufs[f"slot_mapping.{gid}"] = table.slot_mapping.gpu
    for gi, groups in enumerate(runner.attn_groups):
        for ai, group in enumerate(groups):
            builder = group.get_metadata_builder()
            if isinstance(builder, MoeGraphsMetadataBuilder):
                for name, t in builder.persistent_buffers().items():
                    bufs[f"attn.{gi}.{ai}.{name}"] = t
    return bufs


def our_metadata_builders(runner: Any) -> list[Any]:
    """The runner's attention metadata builders that are the plugin's."""
    from vllm_moe_graphs.integration.attention.metadata import MoeGraphsMetadataBuilder

    return [b for groups in runner.attn_groups for g in groups
            if isinstance(b := g.get_metadata_builder(), MoeGraphsMetadataBuilder)]


def plan_builders(builders: Iterable[Any], key: GraphKey | None) -> None:
    """Our metadata `builders` plan the next build for `key` (`plan_for`): a decode key's
    context bucket (the decode kernel's split count), a key with prefill tokens' token bucket
    (the varlen kernel's tile: one launch shape per graph); None: the step's own."""
    if key is None:
        planned = (None, None)
    else:
        planned = (key.context_bucket, None) if key.decode else (None, key.batch_bucket)
    for builder in builders:
        builder.plan_for(*planned)


def decode_split_plan(runner: Any) -> Callable[[int, int], tuple[int, ...]] | None:
    """A decode key's attention plan, (batch bucket, context bucket) -> the split count of each
    of our metadata builders: all that the context bucket decides in a decode graph, so keys
    with equal plans can share one (`DecodeGraphRunner(decode_plan=...)`). None without ours."""
    builders = our_metadata_builders(runner)
    if not builders:
        return None
    return lambda batch, context: tuple(b.num_splits(batch, context) for b in builders)


def read_metadata_in_place(runner: Any) -> bool:
    """Let our metadata builders read vLLM's persistent query_start_loc, seq_lens and block
    tables in place (no per-step copies): they are in the storage's identity just bound.
    Only while vLLM's own capture is off (its capture path rewrites seq_lens).

    Returns whether a replayed step may skip building attention metadata: every builder is
    ours and reads in place (so a build has no device copy to skip), and nothing else reads the
    metadata of a replayed step (vLLM's routed-experts capture does)."""
    from vllm_moe_graphs.integration.attention.metadata import MoeGraphsMetadataBuilder

    own = runner.compilation_config.cudagraph_mode
    if own is not None and own.name != "NONE":
        return False
    tables = runner.input_batch.block_table.block_tables
    ours = 0
    for gid, groups in enumerate(runner.attn_groups):
        for group in groups:
            builder = group.get_metadata_builder()
            if isinstance(builder, MoeGraphsMetadataBuilder) and gid < len(tables):
                builder.read_in_place(runner.query_start_loc.gpu, runner.seq_lens,
                                      tables[gid].block_table.gpu)
                ours += 1
    return ours == sum(map(len, runner.attn_groups)) > 0 and not getattr(
        runner, "routed_experts_initialized", False)
