"""Graph buckets: which captured graph a step pads into.

A pure-decode step's graph is keyed by `GraphKey(batch_bucket, context_bucket)`: the padded
batch size it was captured for and the longest context its attention plan covers. A step that
carries prefill tokens (`mixed_graphs`) is keyed by its padded query tokens,
`GraphKey(token_bucket, 0, request_bucket)` with `request_bucket` a function of the token
bucket up to `mixed_requests` requests (`pick_mixed_key`): one graph serves every mix of
requests within its tokens, and the varlen attention kernel has no context-dependent plan.
Pure functions over host ints; nothing here touches a tensor.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Hashable, Sequence

from vllm_moe_graphs.capability import Reason
from vllm_moe_graphs.config import MIXED_REQUESTS, PluginConfig


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class GraphKey:
    """Identity of one captured graph; hashable, ordered. `batch_bucket` is the rows the
    forward runs on: requests of a decode key, query tokens of a key with prefill tokens, whose
    `request_bucket` (0 for decode keys) counts its padded requests (`pick_mixed_key`)."""

    batch_bucket: int
    context_bucket: int
    request_bucket: int = 0

    @property
    def decode(self) -> bool:
        return self.request_bucket == 0


def pick_bucket(n: int, buckets: Sequence[int]) -> int | None:
    """Smallest bucket >= n, or None past the last one. `buckets` strictly increasing."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def pick_key(num_reqs: int, max_context: int, batch_buckets: Sequence[int],
             context_buckets: Sequence[int]) -> GraphKey | Reason:
    """The key a decode batch of `num_reqs` requests, longest sequence `max_context` tokens,
    pads into; `Reason.BATCH_TOO_LARGE` / `Reason.CONTEXT_TOO_LONG` past the last bucket.
    O(log B) over a handful of buckets: cheap enough for every step."""
    if num_reqs < 1:
        raise ValueError(f"num_reqs={num_reqs!r} must be >= 1")
    if max_context < 0:
        raise ValueError(f"max_context={max_context!r} must be >= 0")
    batch = pick_bucket(num_reqs, batch_buckets)
    if batch is None:
        return Reason.BATCH_TOO_LARGE
    context = pick_bucket(max_context, context_buckets)
    if context is None:
        return Reason.CONTEXT_TOO_LONG
    return GraphKey(batch, context)


def pick_mixed_key(num_tokens: int, num_reqs: int, token_buckets: Sequence[int],
                   max_requests: int, mixed_requests: int = MIXED_REQUESTS) -> GraphKey | Reason:
    """The key a step with prefill tokens (`num_tokens` query tokens of `num_reqs` requests)
    pads into: its token bucket, with requests padded to min(token bucket, `mixed_requests`,
    `max_requests`) when they fit, as every step below saturation does; past that, to the
    next power of two that holds them (512, 1024), still at most the token bucket and
    `max_requests` (the largest decode batch bucket). Every request has a query token, so up to
    `mixed_requests` requests the key, and with it the attention grid and vLLM's
    request-indexed buffers, is a function of the token bucket alone (one graph per token
    bucket, not per token x request pair; a padded request has no query token and its
    attention programs exit at once); a wider step adds at most two keys per token bucket
    (none with `mixed_requests` at `max_requests`). `Reason.STEP_TOO_LARGE` past the last token
    bucket, `Reason.BATCH_TOO_LARGE` past `max_requests`."""
    if num_reqs < 1 or num_tokens < num_reqs:
        raise ValueError(f"num_tokens={num_tokens!r}, num_reqs={num_reqs!r}: need "
                         "num_tokens >= num_reqs >= 1")
    tokens = pick_bucket(num_tokens, token_buckets)
    if tokens is None:
        return Reason.STEP_TOO_LARGE
    if num_reqs > max_requests:
        return Reason.BATCH_TOO_LARGE
    requests = min(tokens, mixed_requests, max_requests)
    while requests < num_reqs:  # only past mixed_requests: num_reqs <= tokens, max_requests
        requests *= 2
    return GraphKey(tokens, 0, min(tokens, requests, max_requests))


def all_keys(batch_buckets: Sequence[int], context_buckets: Sequence[int]) -> tuple[GraphKey, ...]:
    """Every key, largest batch first (the capture order that lets smaller graphs reuse the
    shared pool's memory)."""
    return tuple(sorted((GraphKey(b, c) for b in batch_buckets for c in context_buckets),
                        reverse=True))


DecodePlan = Callable[[int, int], Hashable]  # (batch bucket, context bucket) -> attention launch


def shared_context_buckets(batch_buckets: Sequence[int], context_buckets: Sequence[int],
                           plan: DecodePlan) -> dict[tuple[int, int], int]:
    """(batch bucket, context bucket) -> the context bucket of the key whose graph serves it:
    the smallest one with the same decode attention plan (`plan(batch, context)`: what the
    context bucket decides in the captured launches, e.g. the decode kernel's split count).
    Keys with equal plans would capture the same kernels on the same buffers, so one graph
    serves them all: fewer captures, less pool."""
    shared: dict[tuple[int, int], int] = {}
    for batch in batch_buckets:
        first: dict[Hashable, int] = {}
        for context in sorted(context_buckets):
            shared[(batch, context)] = first.setdefault(plan(batch, context), context)
    return shared


def _fit(buckets: tuple[int, ...], limit: int) -> tuple[int, ...]:
    """`buckets` capped at `limit`: when one reaches it, those at or past it become `limit`."""
    if buckets[-1] < limit:
        return buckets
    return tuple(b for b in buckets if b < limit) + (limit,)


def attention_context_buckets(configured: Sequence[int], max_model_len: int) -> tuple[int, ...]:
    """The contexts the attention plan sizes its split-K for: the graph's context buckets
    fitted to max_model_len (`graph_config`), then max_model_len itself when they stop short
    (a longer context runs eager, `CONTEXT_TOO_LONG`, and is planned for max_model_len). So a
    graph key's context bucket is always one of these."""
    fitted = _fit(tuple(configured), max_model_len)
    return fitted if fitted[-1] == max_model_len else fitted + (max_model_len,)


def context_coverage(context_buckets: Sequence[int], max_model_len: int) -> str | None:
    """What an operator must hear when decode contexts past the largest context bucket exist
    (`context_buckets` as configured, before fitting): such steps run eager
    (`context_too_long`) and the setting that covers them. None when the buckets cover
    `max_model_len`."""
    last = context_buckets[-1]
    if last >= max_model_len:
        return None
    return (f"decode steps whose context is past {last} tokens (up to max_model_len "
            f"{max_model_len}) run eager (context_too_long): add {max_model_len} to "
            f"context_buckets in --additional-config '{{\"moe_graphs\": {{\"context_buckets\": "
            f"[..., {max_model_len}]}}}}' to graph them")


def context_bucket(buckets: Sequence[int], max_seq_len: int) -> int:
    """The bucket a step's longest context is planned at: the smallest holding it, the last one
    when none does."""
    picked = pick_bucket(max_seq_len, buckets)
    return buckets[-1] if picked is None else picked


def graph_config(config: PluginConfig, max_num_seqs: int, max_model_len: int,
                 max_num_tokens: int | None = None) -> PluginConfig:
    """`config` with its buckets fitted to the engine: no batch bucket above max_num_seqs (vLLM's
    persistent buffers hold that many rows), no context bucket above max_model_len (no key
    for a context the engine never serves; the attention metadata plans such a context with
    max_model_len too) and no token bucket above max_num_tokens (the scheduler's token budget
    per step, the size of vLLM's token buffers). A configured largest bucket below the limit
    stays: past it, eager."""
    return dataclasses.replace(
        config, decode_batch_buckets=_fit(config.decode_batch_buckets, max_num_seqs),
        context_buckets=_fit(config.context_buckets, max_model_len),
        token_buckets=(config.token_buckets if max_num_tokens is None
                       else _fit(config.token_buckets, max_num_tokens)))
