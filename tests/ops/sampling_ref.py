"""vLLM 0.26's own sampler as the reference for `ops/sampling.py`, and the statistics to compare
draws: tests only.

`vllm_sample` runs vLLM's `Sampler.forward` (the real code: temperature, `MinPLogitsProcessor`,
`apply_top_k_top_p_pytorch`, `random_sample`) on a few distinct rows, in `processed_logits`
mode with `max_num_logprobs=-1`, so that it also returns the logits vLLM samples from: their
softmax is vLLM's exact distribution. `vllm_draws` repeats vLLM's race (`random_sample`) on
that distribution for many rows at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from unittest import mock

import torch

from vllm_moe_graphs.ops.sampling import SamplingTensors

P_MIN = 0.01  # a chi-square p-value below this fails


@contextlib.contextmanager
def cuda_sort_order() -> Iterator[None]:
    """vLLM's top-p sorts a vocabulary-wide row ascending; on CUDA that sort is a stable radix
    sort (ties in token-id order; tests/ops/test_gpu_sampling.py checks it), on CPU it is not
    stable for long rows. The reference runs with stable=True so that a tie at the top-p cut
    resolves as on the GPU."""
    sort = torch.Tensor.sort

    def stable_sort(self, *args, **kwargs):
        return sort(self, *args, **{**kwargs, "stable": True})

    with mock.patch.object(torch.Tensor, "sort", stable_sort):
        yield


def vllm_sample(
    logits: torch.Tensor,  # [R, V]
    temperature: Sequence[float],
    top_k: Sequence[int],  # SamplingParams' encoding: 0 or -1 disabled
    top_p: Sequence[float],
    min_p: Sequence[float],
    pin_sort_order: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's sampler on R rows, on the logits' device: ([R] sampled token ids, [R, V] float32
    probabilities it drew the random rows from). `pin_sort_order`: sort as CUDA does (CPU)."""
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    rows, vocab = logits.shape
    device = logits.device
    greedy = [t < 1e-5 for t in temperature]
    # InputBatch.add_request's encoding: greedy rows temperature 0, disabled top-k -> vocab.
    temps = torch.tensor([0.0 if g else t for g, t in zip(greedy, temperature)], device=device)
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], dtype=torch.int32,
                      device=device)
    ps = torch.tensor(top_p, dtype=torch.float32, device=device)
    min_p_proc = MinPLogitsProcessor(
        SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=rows)), device, False
    )
    added = [(i, SamplingParams(temperature=t, min_p=m), None, [])
             for i, (t, m) in enumerate(zip(temperature, min_p))]
    min_p_proc.update_state(BatchUpdate(batch_size=rows, removed=[], added=added, moved=[]))
    metadata = SamplingMetadata(
        temperature=None if all(greedy) else temps,
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_p=ps if (ps < 1).any() else None,
        top_k=ks if (ks < vocab).any() else None,
        generators={},
        max_num_logprobs=-1,  # the whole processed row comes back
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(rows, device=device),
        presence_penalties=torch.zeros(rows, device=device),
        repetition_penalties=torch.ones(rows, device=device),
        output_token_ids=[[] for _ in range(rows)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors([min_p_proc]),
    )
    with cuda_sort_order() if pin_sort_order else contextlib.nullcontext():
        out = Sampler(logprobs_mode="processed_logits")(logits.clone(), metadata)
    processed = out.logprobs_tensors.logprobs  # [R, V]
    return out.sampled_token_ids.squeeze(1).long(), processed.softmax(dim=-1)


def chi_square_fit(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, float]:
    """Chi-square goodness of fit of token counts [V] to probabilities [V] (a token of
    probability 0 must not be drawn: checked by the caller); bins pooled as in
    `chi_square_same`."""
    counts, expected = counts.double().cpu(), probs.double().cpu() * float(counts.sum())
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1, _upper_gamma(int(keep.sum()) - 1, stat)


def _upper_gamma(df: int, stat: float) -> float:
    """P(chi-square(df) > stat): the regularized upper incomplete gamma Q(df / 2, stat / 2)."""
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def vllm_draws(probs: torch.Tensor, n: int, chunk: int = 50_000) -> torch.Tensor:
    """n draws of vLLM's `random_sample` from one row of probabilities [V]: [V] counts. The
    race runs on the tokens of nonzero probability only (the others cannot win it)."""
    from vllm.v1.sample.ops.topk_topp_sampler import random_sample

    support = probs.nonzero().squeeze(1)  # [S]
    counts = torch.zeros(probs.shape[0], dtype=torch.long)
    for start in range(0, n, chunk):
        rows = min(chunk, n - start)
        winners = random_sample(probs[support].expand(rows, -1).clone(), {})  # [rows]
        counts += torch.bincount(support[winners], minlength=probs.shape[0])
    return counts


def chi_square_same(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int, float]:
    """Two-sample chi-square test of homogeneity on token counts a, b [V] (equal totals):
    (statistic, degrees of freedom, p-value). Tokens whose expected count is below 5 are pooled
    into one bin; the p-value is the regularized upper incomplete gamma Q(df / 2, stat / 2)."""
    assert int(a.sum()) == int(b.sum()), "chi_square_same: equal totals expected"
    a, b = a.double(), b.double()
    seen = (a + b) > 0
    big = seen & ((a + b) / 2 >= 5)
    bins_a, bins_b = a[big], b[big]
    rest_a, rest_b = a[seen & ~big].sum(), b[seen & ~big].sum()
    if rest_a + rest_b > 0:
        bins_a = torch.cat([bins_a, rest_a.reshape(1)])
        bins_b = torch.cat([bins_b, rest_b.reshape(1)])
    stat = float(((bins_a - bins_b) ** 2 / (bins_a + bins_b)).sum())
    df = bins_a.numel() - 1
    return stat, df, _upper_gamma(df, stat)


def make_logits(seed: int, vocab: int = 1000) -> torch.Tensor:
    """[V] bfloat16, a realistic row: a dozen peaked tokens over a long normal tail, with the
    ties bfloat16 brings (many in the tail) and exact ties forced at ranks 5 and 20 (the last
    token top_k 5 and top_k 20 keep, each tied with the next ones) and 50."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(vocab, generator=g) * 1.5
    peaks = torch.randperm(vocab, generator=g)[:12]
    x[peaks] = torch.linspace(6.0, 3.0, 12) + 0.3 * torch.randn(12, generator=g)
    x = x.bfloat16()
    order = x.float().argsort(descending=True)
    for rank, ties in ((4, 1), (19, 2), (49, 1)):  # 0-based rank, tokens tied with it below
        x[order[rank + 1 : rank + 1 + ties]] = float(x[order[rank]])
    return x


def params_for(rows: int, temperature: float, top_k: int, top_p: float, min_p: float,
               vocab: int, device: torch.device | str = "cpu") -> SamplingTensors:
    """`SamplingTensors` for `rows` identical rows, filled in vLLM's encoding."""
    params = SamplingTensors.allocate(rows, device)
    params.fill(
        torch.full((rows,), temperature if temperature >= 1e-5 else 0.0),
        torch.full((rows,), top_k if 0 < top_k < vocab else vocab, dtype=torch.int32),
        torch.full((rows,), top_p),
        torch.full((rows,), min_p),
    )
    return params


def dense(ids: torch.Tensor, probs: torch.Tensor, vocab: int) -> torch.Tensor:
    """Candidate probabilities ([C] ids, [C] probs) spread over the vocabulary: [V]."""
    return torch.zeros(vocab, dtype=probs.dtype).index_put_((ids,), probs)

