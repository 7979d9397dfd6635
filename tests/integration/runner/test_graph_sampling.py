"""`integration/runner/graph_sampling.py` on CPU against vLLM 0.26's own `InputBatch` (its
requests added as the runner adds them, its built-in logits processors): every batch feature
the sampler graph does not serve is refused with its reason and left to vLLM's sampler; a
served batch samples each row from vLLM's distribution for that row's parameters (a chi-square
test per setting against vLLM's own draws), greedy rows take the argmax; the runner's `_sample`
override uses it and falls back to vLLM's. Capture emulated as CUDA does it
(tests/graphs/test_sampler_graphs.py)."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("vllm.v1.worker.gpu_input_batch")

from tests.graphs.test_sampler_graphs import CudaLikeCapture  # noqa: E402
from tests.ops.sampling_ref import P_MIN, chi_square_same, make_logits, vllm_draws  # noqa: E402
from tests.ops.sampling_ref import vllm_sample  # noqa: E402
from vllm_moe_graphs.graphs.kinds import StepKind  # noqa: E402
from vllm_moe_graphs.graphs.sampler import SamplerGraphs  # noqa: E402
from vllm_moe_graphs.graphs.stats import GraphStats  # noqa: E402
from vllm_moe_graphs.integration.runner.graph_sampling import GraphSampling  # noqa: E402
from vllm_moe_graphs.killswitch import KillSwitch  # noqa: E402
from vllm_moe_graphs.ops.sampling_plan import SamplingRefusal as R  # noqa: E402

V = 1000
ns = types.SimpleNamespace
CPU = torch.device("cpu")
QWEN3 = dict(temperature=0.7, top_k=20, top_p=0.8)
MIN_P = dict(temperature=0.6, top_k=50, top_p=0.95, min_p=0.05)


@pytest.fixture(autouse=True)
def _no_pinned_memory(monkeypatch):
    """vLLM's CUDA build pins its host buffers (PIN_MEMORY, read at import); no driver here."""
    import vllm.utils.torch_utils
    import vllm.v1.worker.gpu_input_batch

    for module in (vllm.utils.torch_utils, vllm.v1.worker.gpu_input_batch):
        monkeypatch.setattr(module, "PIN_MEMORY", False)


def rows(n: int, vocab: int = V) -> torch.Tensor:
    """[n, vocab] bfloat16 logits, each row `make_logits`'s realistic row."""
    return torch.stack([make_logits(seed=i, vocab=vocab) for i in range(n)])


def input_batch(params: list, max_reqs: int = 64):
    """vLLM's InputBatch with `params` (SamplingParams keyword dicts) as its requests."""
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import (
        LogitBiasLogitsProcessor,
        MinPLogitsProcessor,
        MinTokensLogitsProcessor,
    )
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

    cfg = ns(scheduler_config=ns(max_num_seqs=max_reqs))
    procs = LogitsProcessors([cls(cfg, CPU, False) for cls in (
        MinPLogitsProcessor, LogitBiasLogitsProcessor, MinTokensLogitsProcessor)])
    batch = InputBatch(max_num_reqs=max_reqs, max_model_len=64, max_num_batched_tokens=64,
                       device=CPU, vocab_size=V, block_sizes=[16], kernel_block_sizes=[16],
                       max_num_blocks_per_req=[4], logitsprocs=procs)
    for i, kw in enumerate(params):
        sp = SamplingParams(**kw)
        gen = torch.Generator().manual_seed(sp.seed) if sp.seed is not None else None
        batch.add_request(CachedRequestState(
            req_id=f"r{i}", prompt_token_ids=[1, 2, 3], mm_features=[], sampling_params=sp,
            generator=gen, block_ids=([0],), num_computed_tokens=3, output_token_ids=[]))
    batch.refresh_metadata()
    return batch


def sampling(params: list, kill: KillSwitch | None = None, max_rows: int = 64):
    buffer = torch.zeros(max_rows, V + 24, dtype=torch.bfloat16)
    graphs = SamplerGraphs(buffer, V, (1, 2, 4, 8, 16, 24, 32, 48, 64),
                           capture_fn=CudaLikeCapture())
    runner = ns(input_batch=input_batch(params), device=CPU)
    return GraphSampling(runner, graphs, GraphStats(), kill)


RANDOM = dict(QWEN3)
REFUSED = {
    "all greedy": ([{"temperature": 0}] * 3, R.ALL_GREEDY),
    "seeded": ([RANDOM, {**RANDOM, "seed": 7}], R.SEEDED),
    "top-k off": ([RANDOM, {"temperature": 0.7, "top_p": 0.8}], R.TOP_K_DISABLED),
    "top-k 200": ([{**RANDOM, "top_k": 200}], R.TOP_K_TOO_LARGE),
    "penalties": ([{**RANDOM, "repetition_penalty": 1.2}], R.PENALTIES),
    "logit bias": ([RANDOM, {"temperature": 0, "logit_bias": {5: 2.0}}], R.LOGIT_BIAS),
    "logprobs": ([{**RANDOM, "logprobs": 0}], R.LOGPROBS),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_the_graph_does_not_serve_is_refused_with_its_reason(name):
    params, reason = REFUSED[name]
    s = sampling(params)
    s.kind = StepKind.MIXED
    assert s.sample(rows(len(params)), None) is None
    assert s._stats.sampler_fallbacks_by_kind == {(reason, StepKind.MIXED): 1}
    assert not s._stats.sampled_by_kind and s.graphs.captured == ()


def test_speculative_decoding_and_other_logits_are_refused():
    s = sampling([RANDOM] * 3)
    assert s.refusal(rows(3), spec_decode_metadata=object()) is R.SPEC_DECODE
    assert s.refusal(rows(2), None) is R.LOGITS_SHAPE  # not one row per request
    assert s.refusal(rows(3, V + 1), None) is R.LOGITS_SHAPE
    assert s.refusal(rows(3), None) is R.SERVABLE


def test_the_kill_switch_and_a_failed_graph_leave_sampling_to_vllm(tmp_path):
    kill_file = tmp_path / "kill"
    s = sampling([RANDOM] * 2, kill=KillSwitch(str(kill_file), interval_s=0))
    kill_file.touch()
    assert s.refusal(rows(2), None) is R.KILL_SWITCH
    kill_file.unlink()
    s.graphs.run = lambda logits: (_ for _ in ()).throw(RuntimeError("capture failed"))
    assert s.sample(rows(2), None) is None
    assert s.refusal(rows(2), None) is R.SAMPLER_FAILED  # for the engine's life


def test_a_failed_start_up_capture_leaves_sampling_to_vllm_and_starts():
    class Failing(CudaLikeCapture):
        def __call__(self, *args, **kwargs):
            raise RuntimeError("operation not permitted when stream is capturing")

    s = sampling([RANDOM] * 2)
    s.graphs._capture_fn = Failing()
    s.capture_all()  # no exception: the engine starts
    assert s.refusal(rows(2), None) is R.SAMPLER_FAILED


def test_a_batch_past_the_largest_bucket_is_vllms():
    s = sampling([RANDOM] * 9)
    s.graphs.buckets = (1, 2, 4, 8)
    assert s.refusal(rows(9), None) is R.BATCH_TOO_LARGE


DRAW_STEPS = 500  # x 23 rows of each setting = 11,500 draws each


def test_a_served_batch_samples_each_row_from_vllms_distribution():
    """Rows 0-22 Qwen3's chat settings, 23-45 min-p with top-k 50, 46-47 greedy: the rows'
    parameters travel from vLLM's InputBatch (and its min-p processor) into the graph."""
    params = [QWEN3] * 23 + [MIN_P] * 23 + [{"temperature": 0}] * 2
    s = sampling(params)
    logits = make_logits(seed=3, vocab=V).expand(len(params), -1).contiguous()
    counts = torch.zeros(2, V, dtype=torch.long)
    torch.manual_seed(0)
    for _ in range(DRAW_STEPS):
        out = s.sample(logits, None)
        tokens = out.sampled_token_ids[:, 0].long()
        counts[0] += torch.bincount(tokens[:23], minlength=V)
        counts[1] += torch.bincount(tokens[23:46], minlength=V)
        assert (tokens[46:] == logits[0].float().argmax()).all()
    assert s._stats.sampled_by_kind == {StepKind.DECODE: DRAW_STEPS}
    assert s.graphs.captured == (48,) and s.graphs.inexact_rows == 0
    for i, kw in enumerate((QWEN3, MIN_P)):
        ref = vllm_sample(logits[:1].float(), [kw["temperature"]], [kw["top_k"]],
                          [kw["top_p"]], [kw.get("min_p", 0.0)])[1][0]
        assert not counts[i][ref == 0].any(), f"{kw}: a token vLLM cannot draw was drawn"
        stat, df, p = chi_square_same(counts[i], vllm_draws(ref, int(counts[i].sum())))
        print(f"{kw}: chi2 {stat:.1f}, df {df}, p {p:.3f}")
        assert p > P_MIN, f"{kw}: chi2 {stat:.1f} on {df} df, p {p:.4f}"


def test_the_runner_samples_from_the_graph_and_else_runs_vllms_sampler():
    from tests.integration.runner.bare_runner import _bare_runner, _kv

    r = _bare_runner({"model.layers.0.self_attn.attn": _kv()})
    s = sampling([RANDOM] * 2)
    r.moe_graphs.sampling, r.input_batch = s, s._runner.input_batch
    calls = []
    r.sampler = lambda logits, sampling_metadata: calls.append(logits.shape) or "vllm's"
    out = r._sample(rows(2), None)
    assert out.sampled_token_ids.shape == (2, 1) and out.logprobs_tensors is None
    assert calls == []
    r.input_batch = s._runner.input_batch = input_batch([{"temperature": 0}] * 2)
    assert r._sample(rows(2), None) == "vllm's" and calls == [(2, V)]


def test_logits_of_another_dtype_are_vllms():
    """A copy into the bfloat16 buffer would round float32 logits: vLLM samples those."""
    s = sampling([RANDOM] * 2)
    assert s.refusal(rows(2).float(), None) is R.LOGITS_SHAPE


def test_the_sampler_graphs_pool_is_counted_in_the_scratch_bytes():
    class Sized(CudaLikeCapture):
        def __call__(self, fn, pool, before_capture, *, warm_up: bool = True):
            graph = super().__call__(fn, pool, before_capture, warm_up=warm_up)
            return type(graph)(graph.replay, graph.output, 1000, graph.release)

    s = sampling([RANDOM] * 2)
    s.graphs._capture_fn = Sized()
    s._stats.scratch_bytes = 50
    s.sample(rows(2), None)  # bucket 2 captured on first use
    assert s._stats.scratch_bytes == 1050
    s.capture_all()  # the other eight buckets
    assert s._stats.scratch_bytes == 50 + 9 * 1000
    s.drop()
    assert s._stats.scratch_bytes == 50


def test_a_decode_step_samples_the_logits_its_graph_wrote_in_place():
    """Warm-up, capture and replay of a decode key with the LM head in the graph: the logits
    vLLM's compute_logits receives are the static buffer's rows, which the sampler graph reads
    where they are (no copy); the random rows draw among their top-k, the greedy row takes the
    argmax; every step is counted as sampled in the graph, by kind."""
    from tests.integration.runner.bare_runner import _in_step, _stepping_runner
    from tests.integration.runner.test_override_steps import _ToyLM
    from vllm_moe_graphs.integration.model.graph_logits import GraphLogits

    r, capture, _ = _stepping_runner(warmup_steps=1)
    lm = _ToyLM(hidden=1, vocab=V, padded=V + 8)  # logits rise with the token id
    r.moe_graphs.logits = GraphLogits(lm, max_rows=4)
    r.input_batch = input_batch([RANDOM, {"temperature": 0}, RANDOM])
    sampler = SamplerGraphs(r.moe_graphs.logits.buffer, V, (1, 2, 4),
                            capture_fn=CudaLikeCapture())
    stats = r.moe_graphs.graphs.stats
    r.moe_graphs.sampling = GraphSampling(ns(input_batch=r.input_batch, device=CPU), sampler,
                                          stats)
    for _ in ("warm-up", "capture", "replay"):
        with _in_step(r, 3, [1, 1, 1]) as (_, _, out):
            logits = lm.compute_logits(out[slice(0, 3)])
        tokens = r._sample(logits, None).sampled_token_ids[:, 0]
        assert tokens[1] == V - 1 and ((tokens >= V - 20) & (tokens < V)).all(), tokens
    assert capture.captures == 1 and r.moe_graphs.logits.handed_over == 3
    assert sampler.copied_in == 0 and sampler.captured == (4,)
    assert stats.sampled_by_kind == {StepKind.DECODE: 3} and not stats.sampler_fallbacks_by_kind


@pytest.mark.parametrize("allowed", [10, 300])
def test_a_grammars_bitmask_in_the_logits_samples_as_vllm(allowed):
    """Structured output: vLLM writes -inf over the disallowed tokens of the logits the sampler
    then reads (apply_grammar_bitmask, in place, before _sample). Fewer allowed tokens than
    top-k (10 < 20) or many more (300): the same distribution as vLLM's sampler on those
    logits, nothing disallowed drawn."""
    params = [QWEN3] * 48
    s = sampling(params)
    g = torch.Generator().manual_seed(allowed)
    ok = torch.zeros(V, dtype=torch.bool)
    ok[torch.randperm(V, generator=g)[:allowed]] = True
    masked = make_logits(seed=5, vocab=V).masked_fill(~ok, float("-inf"))
    logits = masked.expand(48, -1).contiguous()
    counts = torch.zeros(V, dtype=torch.long)
    torch.manual_seed(1)
    for _ in range(200):
        counts += torch.bincount(s.sample(logits, None).sampled_token_ids[:, 0].long(),
                                 minlength=V)
    assert not counts[~ok].any(), "a disallowed token was drawn"
    assert s.graphs.inexact_rows == 0
    ref = vllm_sample(masked[None].float(), [QWEN3["temperature"]], [QWEN3["top_k"]],
                      [QWEN3["top_p"]], [0.0])[1][0]
    stat, df, p = chi_square_same(counts, vllm_draws(ref, int(counts.sum())))
    assert p > P_MIN, f"chi2 {stat:.1f} on {df} df, p {p:.4f}"


def test_min_tokens_masks_the_stop_tokens_of_rows_short_of_it():
    """Row 0 is short of its min_tokens: vLLM's processor writes -inf over its stop tokens (the
    two largest logits here) into the buffer before the replay, so it never draws them; row 1,
    without min_tokens, draws them most of the time. The serving benchmark's requests
    (min_tokens = max_tokens with ignore_eos: no stop token) mask nothing."""
    stops = [7, 9]
    s = sampling([{**QWEN3, "min_tokens": 4, "stop_token_ids": stops},
                  {**QWEN3, "stop_token_ids": stops}])
    x = rows(2).float()
    x[:, stops] = x.max() + 2.0  # the two likeliest tokens
    logits = x.to(torch.bfloat16)
    drawn = [[], []]
    for _ in range(50):
        out = s.sample(logits.clone(), None).sampled_token_ids[:, 0]
        drawn[0].append(int(out[0]))
        drawn[1].append(int(out[1]))
    assert not set(drawn[0]) & set(stops), drawn[0]
    assert sum(t in stops for t in drawn[1]) > 25, drawn[1]
    assert s._stats.sampled_by_kind == {StepKind.DECODE: 50}
    bench = sampling([{**QWEN3, "max_tokens": 64, "min_tokens": 64, "ignore_eos": True}] * 2)
    md = bench._runner.input_batch.sampling_metadata
    from vllm_moe_graphs.integration.runner.graph_sampling import _masks

    tracked = [p.min_toks for p in md.logitsprocs.non_argmax_invariant
               if getattr(p, "min_toks", None)]
    assert tracked and all(not stops for _, _, stops in tracked[0].values()), tracked
    assert _masks(md) is None  # the processor tracks the rows, with no stop token
    assert bench.refusal(rows(2), None) is R.SERVABLE


def test_allowed_token_ids_and_bad_words_mask_the_graphs_logits():
    """Row 0 may draw only tokens 3, 5 and 7 (allowed_token_ids); row 1 never its bad word's
    token once the word's prefix is its last output (here a one-token bad word: always); row
    2 is free. vLLM's own masks, written into the buffer's rows before the replay."""
    from vllm_moe_graphs.integration.runner.graph_sampling import _masks

    s = sampling([{**QWEN3, "allowed_token_ids": [3, 5, 7]},
                  {**QWEN3, "top_k": 2}, {**QWEN3, "top_k": 2}])
    batch = s._runner.input_batch
    batch.bad_words_token_ids[1] = [[11]]  # what add_request keeps of a tokenized bad word
    batch.refresh_metadata()
    batch.sampling_metadata = batch._make_sampling_metadata()
    x = rows(3).float()
    x[:, [11, 12]] = x.max() + 3.0  # rows 1 and 2 would draw 11 or 12
    x[0, [3, 5, 7]] = 0.0  # row 0's allowed tokens, equally likely
    logits = x.to(torch.bfloat16)
    drawn = [set(), set(), set()]
    for _ in range(40):
        out = s.sample(logits.clone(), None).sampled_token_ids[:, 0]
        for i in range(3):
            drawn[i].add(int(out[i]))
    assert drawn[0] <= {3, 5, 7} and len(drawn[0]) > 1, drawn[0]
    assert 11 not in drawn[1] and 12 in drawn[1], drawn[1]
    assert drawn[2] == {11, 12}, drawn[2]
    assert _masks(sampling([QWEN3])._runner.input_batch.sampling_metadata) is None
