"""GPU tier of `ops/sampling.py`: no host sync (CUDA's sync debug mode), a capture in a
torch.cuda.CUDAGraph that samples new logits with new parameters on every replay and draws
from the right distribution, at Qwen3's vocabulary width; the CUDA sort order vLLM's top-p
relies on; and, where vLLM is installed, vLLM's own sampler on the GPU as the reference."""

from __future__ import annotations

import pytest
import torch

from tests.ops.sampling_ref import P_MIN, chi_square_fit, dense, make_logits, params_for
from vllm_moe_graphs.ops.sampling import SamplingTensors, filter_candidates, sample

pytestmark = pytest.mark.gpu
VOCAB = 151_936  # Qwen3's
QWEN3 = (0.7, 20, 0.8, 0.0)
SETTINGS = [QWEN3, (1.0, 50, 1.0, 0.0), (0.6, 20, 0.95, 0.05), (1.3, 5, 1.0, 0.0)]


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def rows_of(*seeds: int) -> torch.Tensor:
    return torch.stack([make_logits(s, VOCAB) for s in seeds]).cuda()  # [B, V] bfloat16


def mixed_params(rows: int, greedy_every: int, setting=QWEN3) -> SamplingTensors:
    t, k, p, m = setting
    greedy = torch.arange(rows) % greedy_every == 0
    params = SamplingTensors.allocate(rows, "cuda")
    params.fill(torch.where(greedy, 0.0, t), torch.where(greedy, VOCAB, k).int(),
                torch.where(greedy, 1.0, p), torch.full((rows,), float(m)))
    return params


def test_cuda_sort_is_stable_at_vocabulary_width():
    """vLLM's top-p sorts whole rows ascending (`logits.sort()`): at this width CUDA's sort is a
    stable radix sort, so tied tokens come in id order; `ops/sampling.py` relies on it."""
    x = torch.randn(4, VOCAB, device="cuda")
    x[:, ::97] = 0.25
    values, ids = x.sort(dim=-1, descending=False)
    tied = ids[values == 0.25].view(4, -1)
    assert tied.shape[1] == len(range(0, VOCAB, 97))
    assert (tied.diff(dim=-1) > 0).all()


def test_the_op_makes_no_host_sync():
    logits, params = rows_of(0, 1, 2, 3), mixed_params(4, greedy_every=2)
    sample(logits, params, logprobs=True)  # warm-up: lazy init may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sample(logits, params, logprobs=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.token_ids.shape == (4,)


class Captured:
    """`sample` captured once over static buffers; `step` copies new inputs in and replays."""

    def __init__(self, rows: int, logprobs: bool = False) -> None:
        self.logits = torch.zeros(rows, VOCAB, dtype=torch.bfloat16, device="cuda")
        self.params = SamplingTensors.allocate(rows, "cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            sample(self.logits, self.params, logprobs=logprobs)  # warm-up
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = sample(self.logits, self.params, logprobs=logprobs)

    def step(self, logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        self.logits.copy_(logits)
        for name in ("temperature", "top_k", "top_p", "min_p"):
            getattr(self.params, name).copy_(getattr(params, name))
        self.graph.replay()
        return self.out.token_ids.clone()


def test_replays_sample_new_logits_with_new_parameters():
    graph = Captured(rows=8, logprobs=True)
    first = rows_of(*range(8))
    first[0, [150_000, 5]] = first[0].max() + 1  # a tied maximum: the first index wins
    params = mixed_params(8, greedy_every=2)
    tokens = graph.step(first, params)
    assert int(tokens[0]) == 5 and torch.equal(tokens[::2], first[::2].argmax(-1))
    ids, probs, _ = filter_candidates(first, params)
    for row in range(1, 8, 2):  # random rows: a token the filter kept
        assert int(tokens[row]) in ids[row][probs[row] > 0].tolist()
    torch.testing.assert_close(graph.out.logprob, first.float().log_softmax(-1)
                               .gather(1, tokens[:, None]).squeeze(1), atol=1e-5, rtol=0)

    second = rows_of(*range(10, 18))
    tokens = graph.step(second, mixed_params(8, greedy_every=1))  # all greedy now
    assert torch.equal(tokens, second.argmax(-1))

    flat = torch.zeros(8, VOCAB, dtype=torch.bfloat16, device="cuda")
    flat[:, 1000:1128] = 1.0  # 128 equal tokens
    wide = params_for(8, 1.0, 128, 1.0, 0.0, VOCAB, "cuda")
    draws = torch.stack([graph.step(flat, wide) for _ in range(4)])  # [4, 8]
    assert ((draws >= 1000) & (draws < 1128)).all()
    assert len(set(draws.flatten().tolist())) > 16, "the noise must change on every replay"


@pytest.mark.parametrize("setting", SETTINGS, ids=str)
def test_replayed_draws_follow_the_distribution(setting):
    rows, replays = 4096, 25  # 102,400 draws
    graph = Captured(rows)
    row = rows_of(5)
    params = params_for(rows, *setting, VOCAB, device="cuda")
    ids, probs, exact = filter_candidates(row, params_for(1, *setting, VOCAB, device="cuda"))
    expected = dense(ids[0].cpu(), probs[0].cpu(), VOCAB)
    assert exact.all()
    counts = torch.zeros(VOCAB, dtype=torch.long, device="cuda")
    logits = row.expand(rows, -1)
    for _ in range(replays):
        counts += torch.bincount(graph.step(logits, params), minlength=VOCAB)
    counts = counts.cpu()
    assert not counts[expected == 0].any()
    stat, df, p = chi_square_fit(counts, expected)
    print(f"{setting}: chi2 {stat:.1f}, df {df}, p {p:.3f}")
    assert p > P_MIN


def test_vllms_sampler_on_the_gpu_keeps_the_same_tokens_with_the_same_probabilities():
    """vLLM's own path on CUDA (`apply_top_k_top_p_pytorch` with CUDA's sort, unpinned) at
    Qwen3's vocabulary width, for each setting and a tie straddling the top-p cut."""
    pytest.importorskip("vllm")
    from tests.ops.sampling_ref import vllm_sample

    tie = torch.full((VOCAB,), -5.0, device="cuda") - torch.arange(VOCAB, device="cuda") / VOCAB
    tie[[7, 3]] = torch.tensor([4.0, 3.0], device="cuda")
    tie[[100, 200, 300, 400]] = 2.0
    cases = [(rows_of(s)[0], setting) for s, setting in enumerate(SETTINGS)]
    cases.append((tie, (1.0, 20, 0.9, 0.0)))
    for row, setting in cases:
        t, k, p, m = setting
        _, ref = vllm_sample(row[None].float(), [t], [k], [p], [m], pin_sort_order=False)
        ids, probs, _ = filter_candidates(row[None], params_for(1, *setting, VOCAB, "cuda"))
        ours = dense(ids[0].cpu(), probs[0].cpu(), VOCAB)
        assert torch.equal(ours > 0, ref[0].cpu() > 0), setting
        torch.testing.assert_close(ours, ref[0].cpu(), atol=1e-6, rtol=1e-5)
    assert int((ours[[100, 200, 300, 400]] > 0).sum()) == 3
