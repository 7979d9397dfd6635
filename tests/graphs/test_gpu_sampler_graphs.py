"""GPU tier of `graphs/sampler.py`: sampler graphs captured with CUDA at Qwen3's vocabulary
width draw 100k+ samples per setting from fixed logits, and the frequencies fit vLLM 0.26's own
distribution for that setting (its `Sampler` on the GPU: temperature, min-p, top-k, top-p); a
replay makes no host sync; greedy and padding rows of a partly filled bucket take the argmax."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.ops.sampling_ref import P_MIN, chi_square_fit, make_logits, vllm_sample
from vllm_moe_graphs.graphs.sampler import SamplerGraphs

pytestmark = pytest.mark.gpu
VOCAB = 151_936  # Qwen3's
ROWS = 64
DRAWS = 100_000
SETTINGS = {  # temperature, top_k, top_p, min_p
    "qwen3": (0.7, 20, 0.8, 0.0),
    "t1.0-k50": (1.0, 50, 1.0, 0.0),
    "t0.6-k20-p0.95-minp0.05": (0.6, 20, 0.95, 0.05),
    "t1.0-k64": (1.0, 64, 1.0, 0.0),  # the largest top_k served
}


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def sampler() -> SamplerGraphs:
    buffer = torch.empty(ROWS, VOCAB + 64, dtype=torch.bfloat16, device="cuda")  # padded head
    return SamplerGraphs(buffer, VOCAB, (1, 2, 4, 8, 16, 24, 32, 48, 64))


def stage(s: SamplerGraphs, n: int, setting: tuple, greedy_every: int = 0) -> None:
    t, k, p, m = setting
    greedy = np.zeros(n, bool) if not greedy_every else np.arange(n) % greedy_every == 0
    s.stage(np.where(greedy, 0.0, t).astype(np.float32), np.where(greedy, VOCAB, k),
            np.full(n, p, np.float32), np.full(n, m, np.float32) if m else None)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_replayed_draws_fit_vllms_distribution(name):
    pytest.importorskip("vllm")
    setting = SETTINGS[name]
    row = make_logits(seed=7, vocab=VOCAB).cuda()  # [V]
    s = sampler()
    s.logits[:, :VOCAB] = row
    logits = s.logits[:ROWS, :VOCAB]  # the buffer's rows: no copy, as after a decode graph
    counts = torch.zeros(VOCAB, dtype=torch.long, device="cuda")
    steps = -(-DRAWS // ROWS)
    for _ in range(steps):
        stage(s, ROWS, setting)
        counts += torch.bincount(s.run(logits)[:, 0].long(), minlength=VOCAB)
    assert s.copied_in == 0 and s.captured == (ROWS,)
    t, k, p, m = setting
    ref = vllm_sample(row[None].float(), [t], [k], [p], [m], pin_sort_order=False)[1][0]
    assert not counts[ref == 0].any(), "a token vLLM cannot draw was drawn"
    stat, df, p_value = chi_square_fit(counts, ref)
    print(f"{name}: {steps * ROWS} draws, support {int((ref > 0).sum())}, chi2 {stat:.1f}, "
          f"df {df}, p {p_value:.3f}, inexact rows {s.inexact_rows}")
    assert p_value > P_MIN, f"{name}: chi2 {stat:.1f} on {df} df, p {p_value:.4f}"
    assert s.inexact_rows == 0


def test_a_replay_makes_no_host_sync_and_greedy_rows_take_the_argmax():
    s = sampler()
    x = torch.stack([make_logits(seed=i, vocab=VOCAB) for i in range(37)]).cuda()  # [37, V]
    stage(s, 37, SETTINGS["qwen3"], greedy_every=3)
    s.run(x)  # captures bucket 48
    torch.cuda.synchronize()
    stage(s, 37, SETTINGS["qwen3"], greedy_every=3)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = s.run(x)[:, 0].long()  # copies x in, replays
    finally:
        torch.cuda.set_sync_debug_mode("default")
    greedy = torch.arange(37, device="cuda") % 3 == 0
    assert torch.equal(out[greedy], x.float().argmax(dim=-1)[greedy])
    kth = x.float().topk(20, dim=-1).values[:, -1]
    assert (x.float().gather(1, out[:, None])[:, 0] >= kth).all(), "within each row's top-k"
    assert s.captured == (48,) and s.copied_in == 2
