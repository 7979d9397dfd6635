"""Sampling from the plugin's graphs (`sample_in_graph`): vLLM 0.26's `_sample`, served by
`graphs.sampler.SamplerGraphs` where the batch asks nothing the graph does not do.

vLLM's V1 runner samples in `sample_tokens`, after `execute_model`:

    apply_grammar_bitmask(..., logits)          # structured output: -inf in place, first
    sampler_output = self._sample(logits, spec_decode_metadata)
        -> self.sampler(logits, input_batch.sampling_metadata)   # ~15 launches, eager

`GraphSampling.sample` (the runner's `_sample` override) judges the batch on the host from the
input batch's CPU state (no device value read) and, when it is served, stages the rows'
parameters, replays the sampler graph of the batch's bucket over the step's logits (the decode
graph's LM head output in place; other steps' logits are copied in) and returns vLLM's
`SamplerOutput` with the sampled tokens. Anything else returns None, counted under a
`SamplingRefusal`: vLLM's sampler runs, as without the setting. Served: random rows with top-k
1..64 (and top-p, min-p, temperature), greedy rows beside them, structured output (its bitmask
is already in the logits the graph reads: a disallowed token's -inf logit has probability 0 in
the candidates as in vLLM's vocabulary-wide pass), allowed token ids, bad words and min-tokens
(their -inf masks written into the buffer's rows before the replay, a launch each); not: a
per-request seed, logprobs, penalties, logit bias (vLLM adds it in float32), custom logits
processors, a thinking budget or speculative decoding (`ops/sampling_plan.py`). A batch of
greedy rows only keeps vLLM's argmax (`all_greedy`: a few launches, nothing to gain).
"""

from __future__ import annotations

import functools
import logging
import types
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm_moe_graphs.graphs.kinds import StepKind
from vllm_moe_graphs.graphs.sampler import SamplerGraphs
from vllm_moe_graphs.integration.model.graph_logits import MAX_ROWS
from vllm_moe_graphs.ops.sampling import SAMPLING_EPS
from vllm_moe_graphs.ops.sampling_plan import MAX_SERVED_TOP_K, SamplingRefusal, servable

if TYPE_CHECKING:
    from vllm_moe_graphs.graphs.runner import DecodeGraphRunner
    from vllm_moe_graphs.graphs.stats import GraphStats
    from vllm_moe_graphs.integration.model.graph_logits import GraphLogits
    from vllm_moe_graphs.killswitch import KillSwitch

logger = logging.getLogger("vllm.moe_graphs")

R = SamplingRefusal


def install_graph_sampling(runner: Any, logits: GraphLogits | None,
                           graphs: DecodeGraphRunner) -> GraphSampling | None:
    """A `GraphSampling` for `runner` over the in-graph logits' buffer (or one of its own,
    [largest decode batch bucket <= 64, vocabulary] in the model's dtype), counting into the
    decode graphs' stats; None (logged why) without CUDA."""
    if runner.device.type != "cuda":
        logger.info("moe_graphs: sampling by vLLM (sample_in_graph needs CUDA)")
        return None
    vocab, buckets = runner.model_config.get_vocab_size(), graphs.config.decode_batch_buckets
    if logits is not None:
        buffer = logits.buffer
    else:
        rows = min(MAX_ROWS, buckets[-1])  # as GraphLogits sizes its buffer
        buffer = torch.zeros(rows, vocab, dtype=runner.model_config.dtype, device=runner.device)
    try:
        sampler = SamplerGraphs(buffer, vocab, buckets)
    except ValueError as exc:  # e.g. a vocabulary smaller than the candidates
        logger.info("moe_graphs: sampling by vLLM (sample_in_graph: %s)", exc)
        return None
    own = 0 if logits is not None else buffer.numel() * buffer.element_size()
    graphs.set_scratch_bytes(graphs.scratch_bytes + sampler.nbytes + own)
    logger.info("moe_graphs: sampling inside graphs (sample_in_graph) for batches of up to %d "
                "requests", sampler.max_rows)
    return GraphSampling(runner, sampler, graphs.stats, graphs.kill_switch)


class GraphSampling:
    """The runner's `_sample`, from sampler graphs where the batch allows (module docstring)."""

    def __init__(self, runner: Any, graphs: SamplerGraphs, stats: GraphStats,
                 kill_switch: KillSwitch | None = None) -> None:
        self._runner = runner
        self.graphs = graphs
        self._stats = stats
        self._kill = kill_switch
        self.kind = StepKind.DECODE  # the kind of the step whose logits come next (metrics)
        self._failed: str | None = None  # a capture or replay raised: vLLM samples from then on
        self._pool_counted = 0  # the sampler graphs' pool bytes in the stats' scratch bytes

    def capture_all(self) -> None:
        """Start-up: capture every bucket's graph, so no serving step waits for one. A failure
        is logged and leaves sampling to vLLM (`sampler_failed`), never the start-up."""
        try:
            self.graphs.capture_all()
        except Exception as exc:  # noqa: BLE001 - the engine starts either way
            self._fail(exc)
        self._count_pool()

    def _fail(self, exc: Exception) -> None:
        self._failed = f"{type(exc).__name__}: {exc}"
        logger.exception("moe_graphs: a sampler graph failed; vLLM samples from now on")

    def drop(self) -> None:
        """Drop the graphs (wake-up, reload, close); the next use recaptures."""
        self.graphs.drop()
        self._count_pool()

    def _count_pool(self) -> None:
        now = self.graphs.pool_bytes
        self._stats.scratch_bytes += now - self._pool_counted
        self._pool_counted = now

    def sample(self, logits: torch.Tensor | None, spec_decode_metadata: Any) -> Any:
        """vLLM's `SamplerOutput` from the sampler graph, or None: vLLM's sampler runs."""
        why = self.refusal(logits, spec_decode_metadata)
        if why is not R.SERVABLE:
            self._stats.sampler_fallback(why, self.kind)
            return None
        # as vLLM's _sample: a no-op unless some request needs its output tokens on the host
        batch = self._runner.input_batch
        batch.update_async_output_token_ids()
        try:
            tokens = self.graphs.run(logits, _masks(batch.sampling_metadata))
        except Exception as exc:  # noqa: BLE001 - a capture failure must not fail the step
            self._fail(exc)
            self._stats.sampler_fallback(R.SAMPLER_FAILED, self.kind)
            return None
        self._stats.sampled_in_graph(self.kind, self.graphs.inexact_rows)
        if self.graphs.pool_bytes != self._pool_counted:  # a bucket's first use captured it
            self._count_pool()
        return _vllm().SamplerOutput(sampled_token_ids=tokens, logprobs_tensors=None)

    def refusal(self, logits: torch.Tensor | None, spec_decode_metadata: Any) -> SamplingRefusal:
        """Host checks, cheapest first; SERVABLE stages the rows' parameters."""
        if self._failed is not None:
            return R.SAMPLER_FAILED
        if self._kill is not None and self._kill.active():
            return R.KILL_SWITCH
        if spec_decode_metadata is not None:
            return R.SPEC_DECODE
        batch = self._runner.input_batch
        n = batch.num_reqs
        if logits is None or logits.dim() != 2 or logits.shape[0] != n \
                or logits.shape[1] != self.graphs.vocab or logits.dtype != self.graphs.logits.dtype:
            return R.LOGITS_SHAPE  # another dtype: a copy into the buffer would round it
        md = batch.sampling_metadata
        if md.all_greedy:
            return R.ALL_GREEDY
        if (why := _batch_features(md)) is not None:
            return why
        if n > self.graphs.max_rows:
            return R.BATCH_TOO_LARGE
        min_p = _min_p(md.logitsprocs)
        min_p = None if min_p is None else min_p[:n]
        temperature, top_k, top_p = (batch.temperature_cpu[:n], batch.top_k_cpu[:n],
                                     batch.top_p_cpu[:n])
        if md.generators or not _plainly_servable(temperature, top_k, batch.vocab_size):
            verdict = servable(temperature, top_k, top_p,
                               min_p if min_p is not None else np.zeros(n, np.float32),
                               vocab_size=batch.vocab_size, seeded_rows=md.generators.keys())
            if not verdict.ok:
                return verdict.reason
        self.graphs.stage(temperature, top_k, top_p, min_p)
        return R.SERVABLE


@functools.cache
def _vllm() -> types.SimpleNamespace:
    """The vLLM classes the per-step checks compare against, imported once (the worker has
    already imported them; no import statement runs on the step path)."""
    from vllm.v1.outputs import SamplerOutput
    from vllm.v1.sample.logits_processor.builtin import (
        LogitBiasLogitsProcessor,
        MinPLogitsProcessor,
        MinTokensLogitsProcessor,
    )
    from vllm.v1.sample.ops.bad_words import apply_bad_words

    return types.SimpleNamespace(
        SamplerOutput=SamplerOutput, LogitBias=LogitBiasLogitsProcessor,
        MinP=MinPLogitsProcessor, MinTokens=MinTokensLogitsProcessor,
        apply_bad_words=apply_bad_words)


def _batch_features(md: Any) -> SamplingRefusal | None:
    """What the batch asks of vLLM's sampler beyond the op's parameters (None: nothing)."""
    v = _vllm()
    if md.max_num_logprobs is not None or md.logprob_token_ids:
        return R.LOGPROBS
    if not md.no_penalties:
        return R.PENALTIES
    holder = md.thinking_budget_state_holder
    if holder is not None and holder.has_tracked_requests():
        return R.LOGITS_PROCESSORS
    for proc in md.logitsprocs.non_argmax_invariant:
        if type(proc) is v.LogitBias:
            if proc.biases:  # added in float32 by vLLM: the buffer's dtype would round it
                return R.LOGIT_BIAS
        elif type(proc) is not v.MinTokens:  # min-tokens: `_masks`
            return R.LOGITS_PROCESSORS
    if any(type(proc) is not v.MinP for proc in md.logitsprocs.argmax_invariant):
        return R.LOGITS_PROCESSORS
    return None


def _masks(md: Any) -> Any:
    """The -inf masks vLLM's sampler would write into the batch's logits before it samples, as
    one edit of the logits buffer's rows (batch rows: the buffer's rows; -inf is exact in any
    dtype), or None when none applies: allowed token ids (its [n, V] mask), bad words (vLLM's
    own per-row writes, from the output tokens `_sample` brought up to date) and min-tokens
    (-inf over the stop tokens of rows still short of it; none with `ignore_eos`)."""
    v = _vllm()
    edits = []
    if (allowed := md.allowed_token_ids_mask) is not None:
        edits.append(lambda view: view.masked_fill_(allowed, float("-inf")))
    if md.bad_words_token_ids:
        edits.append(lambda view: v.apply_bad_words(view, md.bad_words_token_ids,
                                                    md.output_token_ids))
    for proc in md.logitsprocs.non_argmax_invariant:
        if type(proc) is v.MinTokens and proc.min_toks \
                and proc.logits_slice[0].numel():
            rows_tokens = proc.logits_slice  # ([k] rows, [k] token ids), on the device
            # NOTE: not proc.apply: its -inf is float32, where vLLM's logits are by then
            edits.append(lambda view, at=rows_tokens: view.__setitem__(at, float("-inf")))
    if not edits:
        return None

    def mask(view: torch.Tensor) -> None:
        for edit in edits:
            edit(view)

    return mask


def _min_p(logitsprocs: Any) -> np.ndarray | None:
    """The batch rows' min-p (vLLM keeps it in its built-in processor); None: no row has one."""
    for proc in logitsprocs.argmax_invariant:
        if getattr(proc, "min_p_count", 0):
            return proc.min_p_cpu
    return None


def _plainly_servable(temperature: np.ndarray, top_k: np.ndarray, vocab: int) -> bool:
    """The common case in one vectorised pass: every random row has top-k 1..MAX_SERVED_TOP_K
    and a finite temperature (top-p and min-p in range are SamplingParams' own validation)."""
    k = top_k[temperature >= SAMPLING_EPS]  # the random rows'
    top = min(MAX_SERVED_TOP_K, vocab - 1)
    return bool(np.isfinite(temperature).all() and ((k >= 1) & (k <= top)).all())
