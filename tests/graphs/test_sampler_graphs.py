"""`graphs/sampler.py` on CPU: one graph per batch bucket over the static logits buffer, the
staged parameters with greedy padding, the copy-in of logits that are not the buffer's rows, a
fresh output tensor per step, the inexact-row count, drop and recapture. Capture is emulated as
CUDA does it: capturing runs nothing, each replay re-runs the captured function."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_moe_graphs.graphs.capture import CapturedGraph
from vllm_moe_graphs.graphs.sampler import SamplerGraphs
from vllm_moe_graphs.ops.sampling import NUM_CANDIDATES

V = 200  # vocabulary; the buffer's rows are padded to 256 columns as an LM head's may be
BUCKETS = (1, 2, 4, 8)


class CudaLikeCapture:
    """Capture records the function; replay runs it (a CUDA graph's behaviour, not its speed)."""

    def __init__(self) -> None:
        self.captures, self.replays, self.releases = 0, 0, 0

    def __call__(self, fn, pool, before_capture, *, warm_up: bool = True) -> CapturedGraph:
        self.captures += 1

        def replay():
            self.replays += 1
            return fn()

        def release():
            self.releases += 1

        return CapturedGraph(replay, torch.empty(0), 0, release)


def make(rows: int = 8) -> tuple[SamplerGraphs, CudaLikeCapture]:
    capture = CudaLikeCapture()
    buffer = torch.full((rows, 256), float("nan"), dtype=torch.bfloat16)
    return SamplerGraphs(buffer, V, BUCKETS, capture_fn=capture), capture


def params(n: int, t: float = 0.0, k: int = V, p: float = 1.0, m: float | None = None):
    return (np.full(n, t, np.float32), np.full(n, k, np.int32), np.full(n, p, np.float32),
            None if m is None else np.full(n, m, np.float32))


def logits(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, V, generator=g) * 3).to(torch.bfloat16)


def test_greedy_rows_take_the_argmax_through_one_graph_per_bucket():
    s, capture = make()
    for n in (3, 4, 1, 3):
        x = logits(n, seed=n)
        s.stage(*params(n))
        out = s.run(x)
        assert out.shape == (n, 1) and out.dtype == torch.int32
        assert torch.equal(out[:, 0].long(), x.float().argmax(dim=-1))
    assert s.captured == (1, 4) and capture.captures == 2 and capture.replays == 4
    assert s.copied_in == 4  # logits of their own: copied into the buffer's leading rows


def test_logits_that_are_the_buffers_rows_are_not_copied():
    s, _ = make()
    s.logits[:2, :V] = logits(2)
    s.stage(*params(2))
    out = s.run(s.logits[:2, :V])
    assert s.copied_in == 0
    assert torch.equal(out[:, 0].long(), s.logits[:2, :V].float().argmax(dim=-1))


def test_each_step_returns_a_new_tensor():
    """vLLM copies the tokens to the host on another stream while the next step replays."""
    s, _ = make()
    s.stage(*params(2))
    first = s.run(logits(2, seed=1))
    s.stage(*params(2))
    second = s.run(logits(2, seed=2))
    assert first.data_ptr() != second.data_ptr() != s.tokens.data_ptr()


def test_random_rows_draw_only_from_their_top_k():
    s, _ = make()
    x = logits(3, seed=4)
    kth = x.float().topk(5, dim=-1).values[:, -1:]  # [3, 1]  ties with the 5th all stay
    top5 = [(x[row].float() >= kth[row]).nonzero().squeeze(1) for row in range(3)]
    seen = [set() for _ in range(3)]
    torch.manual_seed(0)
    for _ in range(200):
        s.stage(*params(3, t=1.0, k=5, p=1.0))
        out = s.run(x)[:, 0]
        for row in range(3):
            seen[row].add(int(out[row]))
    for row in range(3):
        assert seen[row] <= set(top5[row].tolist()) and len(seen[row]) >= 3, seen[row]


def test_padding_rows_are_greedy_and_the_params_of_the_real_rows_are_read():
    """Rows 3.. of bucket 4 are padding: staged greedy whatever the previous step left."""
    s, _ = make()
    s.stage(*params(4, t=1.0, k=5, m=0.5))
    s.run(logits(4))
    s.stage(*params(3, t=0.7, k=20, p=0.8, m=0.1))
    staged = s._params[:, :4]
    assert staged[:, :3].tolist() == [[pytest.approx(0.7)] * 3, [20.0] * 3,
                                      [pytest.approx(0.8)] * 3, [pytest.approx(0.1)] * 3]
    assert staged[:, 3].tolist() == [0.0, 1.0, 1.0, 0.0]


def test_inexact_rows_are_counted_once_per_step():
    """A flat row (every logit tied) keeps the whole vocabulary under top-k: the candidates
    cannot hold it; the capture's eager run does not count."""
    s, _ = make()
    flat = torch.zeros(2, V, dtype=torch.bfloat16)
    for step in range(1, 4):
        s.stage(*params(2, t=1.0, k=20))
        s.run(flat)
        assert s.inexact_rows == 2 * step
    s.stage(*params(2))  # greedy rows are always exact
    s.run(flat)
    assert s.inexact_rows == 6


def test_drop_releases_every_graph_and_the_next_use_recaptures():
    s, capture = make()
    assert s.capture_all() == len(BUCKETS) and s.captured == BUCKETS
    s.drop()
    assert capture.releases == len(BUCKETS) and s.captured == ()
    s.stage(*params(1))
    s.run(logits(1))
    assert s.captured == (1,)


@pytest.mark.parametrize("bad,match", [
    (lambda s: s.stage(*params(9)), "9 rows to stage"),
    (lambda s: s.run(logits(2)), "do not match the 0 staged rows"),
    (lambda s: (s.stage(*params(2)), s.run(logits(3))), "do not match the 2 staged rows"),
])
def test_mismatches_are_refused_with_what_was_expected(bad, match):
    s, _ = make()
    with pytest.raises(ValueError, match=match):
        bad(s)


def test_a_buffer_without_a_fitting_bucket_is_refused():
    with pytest.raises(ValueError, match="no bucket"):
        SamplerGraphs(torch.zeros(8, 256), V, (16, 32))
    with pytest.raises(ValueError, match="vocab"):
        SamplerGraphs(torch.zeros(8, NUM_CANDIDATES), V, BUCKETS)
    with pytest.raises(ValueError, match=f"vocabulary of >= {NUM_CANDIDATES}"):
        SamplerGraphs(torch.zeros(8, 256), NUM_CANDIDATES - 1, BUCKETS)
