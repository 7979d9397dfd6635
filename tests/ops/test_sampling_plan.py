"""`ops/sampling_plan.servable`: which batches the in-graph sampler serves, and each refusal with
its reason and row; `SamplingTensors.fill`: the leading rows copied, the rest greedy padding."""

from __future__ import annotations

import pytest
import torch

from vllm_moe_graphs.ops.sampling import SamplingTensors
from vllm_moe_graphs.ops.sampling_plan import MAX_SERVED_TOP_K as K_MAX
from vllm_moe_graphs.ops.sampling_plan import SamplingRefusal, servable

VOCAB = 151_936  # Qwen3's


def check(temperature, top_k, top_p=None, min_p=None, **kwargs):
    n = len(temperature)
    return servable(torch.tensor(temperature), torch.tensor(top_k, dtype=torch.int32),
                    torch.tensor(top_p or [1.0] * n), torch.tensor(min_p or [0.0] * n),
                    vocab_size=VOCAB, **kwargs)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    ([0.7, 0.6, 1.0], [20, 20, 50], [0.8, 0.95, 1.0], [0.0, 0.05, 0.0]),  # Qwen3's, and others
    ([0.0, 0.0], [VOCAB, VOCAB], [1.0, 1.0], [0.0, 0.0]),  # greedy: vLLM stores top_k = vocab
    ([0.0, 1.3], [VOCAB, K_MAX], [1.0, 0.5], [0.0, 1.0]),  # greedy beside random; the limits
])
def test_batches_the_op_serves(temperature, top_k, top_p, min_p):
    answer = check(temperature, top_k, top_p, min_p)
    assert answer.ok and answer.reason is SamplingRefusal.SERVABLE and answer.row is None


@pytest.mark.parametrize("temperature,top_k,top_p,min_p,seeded,reason,row,words", [
    ([0.7, 0.7], [20, 20], None, None, {1}, SamplingRefusal.SEEDED, 1, "own seed"),
    ([0.7, 0.7], [20, VOCAB], [0.8, 0.95], None, (), SamplingRefusal.TOP_K_DISABLED, 1,
     "without top-k"),
    ([1.0], [0], None, None, (), SamplingRefusal.TOP_K_DISABLED, 0, "top_k 0"),
    ([1.0], [-1], None, None, (), SamplingRefusal.TOP_K_DISABLED, 0, "top_k -1"),
    ([0.7, 0.7, 0.7], [20, 40, K_MAX + 1], None, None, (), SamplingRefusal.TOP_K_TOO_LARGE, 2,
     f"top_k {K_MAX + 1} > {K_MAX}"),
    ([float("nan")], [20], None, None, (), SamplingRefusal.INVALID_PARAMETER, 0, "temperature"),
    ([-0.5], [20], None, None, (), SamplingRefusal.INVALID_PARAMETER, 0, "temperature"),
    ([0.7], [20], [0.0], None, (), SamplingRefusal.INVALID_PARAMETER, 0, "top_p 0.0"),
    ([0.7], [20], None, [1.5], (), SamplingRefusal.INVALID_PARAMETER, 0, "min_p 1.5"),
])
def test_each_refusal_names_its_reason_and_row(temperature, top_k, top_p, min_p, seeded,
                                               reason, row, words):
    answer = check(temperature, top_k, top_p, min_p, seeded_rows=seeded)
    assert not answer.ok
    assert (answer.reason, answer.row) == (reason, row)
    assert words in answer.detail and f"row {row}" in answer.detail


def test_greedy_rows_are_served_whatever_else_they_carry():
    """A greedy row's top-k / seed are never read (vLLM drops them for greedy requests too)."""
    assert check([0.0, 0.7], [0, 20], seeded_rows={0}).ok
    assert check([0.0], [K_MAX * 10], [0.2], [0.5]).ok


def test_the_first_refused_row_is_reported():
    answer = check([0.7, 0.7, 0.7], [20, 0, K_MAX + 1])
    assert (answer.reason, answer.row) == (SamplingRefusal.TOP_K_DISABLED, 1)


def test_malformed_inputs_are_value_errors():
    with pytest.raises(ValueError, match=r"one length, got \[2, 1, 2, 2\]"):
        servable([0.7, 0.7], [20], [1.0, 1.0], [0.0, 0.0], vocab_size=VOCAB)
    with pytest.raises(ValueError, match="seeded row 5 outside the batch of 1 rows"):
        check([0.7], [20], seeded_rows={5})


def test_fill_copies_the_rows_and_pads_the_rest_as_greedy():
    params = SamplingTensors.allocate(4, "cpu")
    params.temperature.fill_(9.0)  # stale values of an earlier, larger step
    params.top_k.fill_(77)
    params.fill(torch.tensor([0.7, 0.0]), torch.tensor([20, VOCAB], dtype=torch.int32),
                torch.tensor([0.8, 1.0]), torch.tensor([0.05, 0.0]))
    assert params.temperature.tolist() == pytest.approx([0.7, 0.0, 0.0, 0.0])
    assert params.top_k.tolist() == [20, VOCAB, 1, 1]
    assert params.top_p.tolist() == pytest.approx([0.8, 1.0, 1.0, 1.0])
    assert params.min_p.tolist() == pytest.approx([0.05, 0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="one length <= 4 rows"):
        params.fill(*(torch.zeros(5),) * 4)
    with pytest.raises(ValueError, match="rows must be >= 1"):
        SamplingTensors.allocate(0, "cpu")


def test_the_largest_served_top_k_keeps_realistic_rows_exact():
    """The served cap's margin (MAX_SERVED_TOP_K's comment): on realistic bf16 rows of Qwen3's
    vocabulary the k-th largest logit's ties stay within the candidates up to the cap, where
    at the op's own limit (K_CAP) most rows spill."""
    from tests.ops.sampling_ref import make_logits
    from vllm_moe_graphs.ops.sampling import K_CAP, filter_candidates

    def spilled(k: int) -> int:
        rows = torch.stack([make_logits(seed=s, vocab=151_936) for s in range(30)])
        params = SamplingTensors.allocate(30, "cpu")
        params.fill(torch.ones(30), torch.full((30,), k, dtype=torch.int32), torch.ones(30),
                    torch.zeros(30))
        return int((~filter_candidates(rows, params)[2]).sum())

    assert spilled(K_MAX) == 0
    assert spilled(K_CAP) > 15
