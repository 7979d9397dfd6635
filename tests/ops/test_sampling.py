"""`ops/sampling.py` against vLLM 0.26's own sampler on CPU: the same distribution (the exact
probabilities of each token, then 100k draws of each compared by a chi-square test), the same
support, ties resolved as vLLM resolves them, greedy rows equal to argmax, raw logprobs as
vLLM reports them; and an op trace that is the same whatever the data (no host sync, no
data-dependent shape or branch). The GPU tier (test_gpu_sampling.py) captures the op in a
CUDA graph."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.ops.sampling_ref import (
    P_MIN,
    chi_square_same,
    dense,
    make_logits,
    params_for,
    vllm_draws,
    vllm_sample,
)
from vllm_moe_graphs.ops.sampling import NUM_CANDIDATES, SamplingTensors, filter_candidates, sample

V = 1000
DRAWS = 100_000
QWEN3 = (0.7, 20, 0.8, 0.0)  # temperature, top_k, top_p, min_p: Qwen3's advice for chat
SETTINGS = {
    "qwen3": QWEN3,
    "t1.0-k50": (1.0, 50, 1.0, 0.0),
    "t0.6-k20-p0.95-minp0.05": (0.6, 20, 0.95, 0.05),
    "t1.3-k5": (1.3, 5, 1.0, 0.0),
}


def our_counts(logits_row: torch.Tensor, setting: tuple, n: int = DRAWS) -> torch.Tensor:
    out = sample(logits_row.expand(n, -1).contiguous(), params_for(n, *setting, V))
    assert out.exact.all(), "these rows' kept tokens are all among the candidates"
    return torch.bincount(out.token_ids, minlength=V)


def vllm_probs(logits_row: torch.Tensor, setting: tuple) -> torch.Tensor:
    """vLLM's distribution for one row: [V] float32."""
    t, k, p, m = setting
    return vllm_sample(logits_row[None].float(), [t], [k], [p], [m])[1][0]


@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_distribution_is_vllms(name):
    setting = SETTINGS[name]
    row = make_logits(seed=1)
    ref = vllm_probs(row, setting)  # [V]
    ids, probs, exact = filter_candidates(row[None], params_for(1, *setting, V))
    ours = dense(ids[0], probs[0], V)
    assert exact.all()
    assert torch.equal(ours > 0, ref > 0), "the same tokens can be drawn"
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)

    torch.manual_seed(0)
    a, b = our_counts(row, setting), vllm_draws(ref, DRAWS)
    assert not (a[ref == 0]).any(), "a token vLLM cannot draw was drawn"
    stat, df, p = chi_square_same(a, b)
    print(f"{name}: support {int((ref > 0).sum())}, chi2 {stat:.1f}, df {df}, p {p:.3f}")
    assert p > P_MIN, f"{name}: chi2 {stat:.1f} on {df} df, p {p:.4f}"


def test_ties_at_the_top_k_cut_all_stay():
    row = make_logits(seed=1)
    for k, kept in ((5, 6), (20, 22), (50, 51)):
        ids, probs, _ = filter_candidates(row[None], params_for(1, 1.0, k, 1.0, 0.0, V))
        assert int((probs > 0).sum()) == kept == int((vllm_probs(row, (1.0, k, 1.0, 0.0)) > 0)
                                                    .sum())


def test_a_tie_at_the_top_p_cut_resolves_as_vllm_on_cuda():
    """Four tokens tied where the top-p cut falls: vLLM (sorted as on CUDA) keeps the higher
    ids of the group, and so do we."""
    x = -5.0 - torch.arange(V) / V  # a tail of distinct values
    x[[7, 3]] = torch.tensor([4.0, 3.0])
    tied = torch.tensor([100, 200, 300, 400])
    x[tied] = 2.0
    setting = (1.0, 20, 0.9, 0.0)  # p(4) .52, p(3) .19, each tied .07: the cut is inside
    ref = vllm_probs(x, setting)
    ids, probs, _ = filter_candidates(x[None], params_for(1, *setting, V))
    ours = dense(ids[0], probs[0], V)
    assert 0 < int((ref[tied] > 0).sum()) < len(tied), "the cut must fall inside the group"
    assert torch.equal(ours > 0, ref > 0)
    assert (ours[tied] > 0).tolist() == sorted((ours[tied] > 0).tolist()), "higher ids stay"


def test_top_p_always_keeps_the_largest_token():
    """A top_p so small that 1 - top_p rounds to 1: every cumulative sum is <= it, and vLLM
    still keeps the last token of its ascending sort: of a tied maximum, the highest id."""
    x = -5.0 - torch.arange(V) / V
    x[[30, 10, 20]] = 4.0
    setting = (1.0, 20, 1e-9, 0.0)
    ref = vllm_probs(x, setting)
    ids, probs, _ = filter_candidates(x[None], params_for(1, *setting, V))
    assert ref.nonzero().tolist() == [[30]]
    assert torch.equal(dense(ids[0], probs[0], V), ref)


def test_a_mixed_batch_samples_greedy_and_random_rows_as_vllm():
    """Every 11th row greedy (on a row whose maximum is tied: argmax's first index wins), the
    others Qwen3's setting; vLLM's sampler runs the same mixed batch."""
    greedy_row, random_row = make_logits(seed=2), make_logits(seed=3)
    greedy_row[[40, 900]] = greedy_row.max() + 1
    n = DRAWS + DRAWS // 10
    is_greedy = torch.arange(n) % 11 == 0
    logits = torch.where(is_greedy[:, None], greedy_row, random_row)  # [n, V]
    t, k, p, m = QWEN3
    params = SamplingTensors.allocate(n, "cpu")
    params.fill(torch.where(is_greedy, 0.0, t), torch.where(is_greedy, V, k).int(),
                torch.where(is_greedy, 1.0, p), torch.zeros(n))
    torch.manual_seed(0)
    out = sample(logits, params)

    ref_tokens, ref_probs = vllm_sample(torch.stack([greedy_row, random_row]).float(),
                                        [0.0, t], [0, k], [1.0, p], [0.0, m])
    assert int(ref_tokens[0]) == 40
    assert (out.token_ids[is_greedy] == 40).all()
    draws = out.token_ids[~is_greedy]
    a = torch.bincount(draws, minlength=V)
    stat, df, p_value = chi_square_same(a, vllm_draws(ref_probs[1], draws.numel()))
    print(f"mixed: {int(is_greedy.sum())} greedy rows, chi2 {stat:.1f}, df {df}, p {p_value:.3f}")
    assert p_value > P_MIN
    assert out.exact.all()


def test_a_tie_group_past_the_candidates_is_reported():
    """200 tokens tied with the 20th largest: top_k 20 keeps all of them in vLLM, more than the
    candidates hold; the row says so. Top-k 5 on the same logits and greedy rows are exact."""
    x = make_logits(seed=4).float()
    order = x.argsort(descending=True)
    x[order[19:219]] = float(x[order[19]])
    logits = x.expand(3, -1).contiguous()
    params = SamplingTensors.allocate(3, "cpu")
    params.fill(torch.tensor([0.7, 0.7, 0.0]), torch.tensor([20, 5, V], dtype=torch.int32),
                torch.ones(3), torch.zeros(3))
    assert sample(logits, params).exact.tolist() == [False, True, True]
    assert int((vllm_probs(x, (0.7, 20, 1.0, 0.0)) > 0).sum()) == 219 > NUM_CANDIDATES


def test_raw_logprobs_and_ranks_are_vllms():
    from vllm.v1.sample.sampler import Sampler

    logits = torch.stack([make_logits(seed=s) for s in range(8)])
    params = params_for(8, *QWEN3, V)
    params.temperature[::2] = 0.0  # greedy rows too
    out = sample(logits, params, logprobs=True)
    with torch.compiler.set_stance("force_eager"):  # vLLM compiles its rank count
        ref = Sampler.gather_logprobs(Sampler.compute_logprobs(logits), 0, out.token_ids)
    torch.testing.assert_close(out.logprob, ref.logprobs[:, 0], atol=1e-6, rtol=0)
    assert torch.equal(out.rank, ref.selected_token_ranks)
    assert (out.rank > 1).any(), "some sampled token is not the most likely"


def test_the_chi_square_test_rejects_a_different_distribution():
    """The test of the test: draws at temperature 0.7 against vLLM's at 0.8 must fail, and the
    p-value is the chi-square distribution's (its 99th percentile at 10 df is 23.209)."""
    row = make_logits(seed=1)
    torch.manual_seed(0)
    a = our_counts(row, QWEN3, n=20_000)
    b = vllm_draws(vllm_probs(row, (0.8, 20, 0.8, 0.0)), 20_000)
    assert chi_square_same(a, b)[2] < P_MIN
    counts = torch.tensor([40, 60])  # stat 8.0 on 1 df: p = 0.00468
    assert abs(chi_square_same(counts, counts.flip(0))[2] - 0.00468) < 1e-5
    q = torch.special.gammaincc(torch.tensor(5.0, dtype=torch.float64),
                                torch.tensor(23.209 / 2, dtype=torch.float64))
    assert abs(float(q) - 0.01) < 1e-4


# -- graph safety on CPU: the op's trace does not depend on the data
SYNCING_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "_unique",
               "unique_dim", "unique_consecutive", "repeat_interleave")


class OpTrace(TorchDispatchMode):
    """Every aten op run, with the shapes of its outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shapes = tuple(tuple(t.shape) for t in (out if isinstance(out, tuple | list) else [out])
                       if isinstance(t, torch.Tensor))
        self.ops.append((str(func.overloadpacket.__name__), shapes))
        return out


def trace(fn, logits, params) -> list[tuple[str, tuple]]:
    with OpTrace() as t:
        fn(logits, params)
    return t.ops


def batch(seed: int, rows: int = 6) -> tuple[torch.Tensor, SamplingTensors]:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, V, generator=g) * (1 + seed)).bfloat16()
    params = SamplingTensors.allocate(rows, "cpu")
    params.fill(torch.rand(rows, generator=g) * 2 * (torch.arange(rows) % 3 > 0),
                torch.randint(1, 129, (rows,), generator=g, dtype=torch.int32),
                torch.rand(rows, generator=g) * 0.9 + 0.1, torch.rand(rows, generator=g) * 0.2)
    return logits, params


def _sample_with_logprobs(logits, params):
    return sample(logits, params, logprobs=True)


def test_the_op_runs_the_same_ops_on_the_same_shapes_whatever_the_data():
    traces = [trace(_sample_with_logprobs, *batch(seed)) for seed in range(3)]
    assert len(traces[0]) > 20 and traces[0] == traces[1] == traces[2]
    found = sorted({op for op, _ in traces[0] if op.startswith(SYNCING_OPS)})
    assert not found, f"ops that read device data on the host: {found}"


def test_the_trace_check_sees_a_sync_and_a_branch():
    def with_item(logits, params):
        return sample(logits, params).token_ids[0].item()

    def with_branch(logits, params):
        out = sample(logits, params)
        return out.token_ids if bool((out.token_ids > V // 2).all()) else out.token_ids * 2

    assert any(op == "_local_scalar_dense" for op, _ in trace(with_item, *batch(0)))
    logits, params = batch(0)
    params.temperature.zero_()
    greedy_high = logits.clone()
    greedy_high[:, V - 1] = 100
    assert trace(with_branch, greedy_high, params) != trace(with_branch, logits, params)


def test_bad_shapes_are_refused():
    logits, params = batch(0)
    with pytest.raises(ValueError, match="V >= 129"):
        sample(logits[:, :100], params)
    with pytest.raises(ValueError, match="expected 5 rows"):
        sample(logits[:5], params)
