"""Top-k softmax routing with the padding rows sent to a sentinel (`ops/moe_router.py`).

Runs on the GPU when there is one, else under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from vllm_moe_graphs.ops.moe_router import topk_softmax


def reference_topk_softmax(logits: torch.Tensor, top_k: int,
                           renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's `fused_topk` softmax routing in float64: ties go to the lower expert id."""
    probs = torch.softmax(logits.double(), dim=-1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _logits(rows: int, experts: int, dtype: torch.dtype, device: torch.device,
            seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, experts, generator=g) * 2).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows, experts, top_k, renormalize", [
    (1, 128, 8, True),  # Qwen3-30B-A3B, one decode row
    (37, 128, 8, False),  # rows not a multiple of the row block
    (9, 60, 4, True),  # Qwen1.5-MoE's 60 experts: not a power of two
    (6, 8, 2, True),  # Mixtral's 8 experts, top-2
    (5, 16, 1, False),
])
def test_matches_the_reference(dtype, rows, experts, top_k, renormalize, device) -> None:
    logits = _logits(rows, experts, dtype, device)
    weights, ids = topk_softmax(logits, top_k, renormalize)
    ref_w, ref_i = reference_topk_softmax(logits.cpu(), top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (rows, top_k)
    assert torch.equal(ids.cpu().long(), ref_i)  # bf16 logits tie often: lower id first
    torch.testing.assert_close(weights.cpu().double(), ref_w, atol=1e-6, rtol=1e-5)


def test_ties_go_to_the_lower_expert_id(device) -> None:
    logits = torch.zeros(3, 128, dtype=torch.bfloat16, device=device)
    logits[0, [90, 7, 64]] = 1.0  # three equal maxima, then 125 equal zeros
    logits[1] = 1.0  # all equal
    logits[2, 127] = -1.0
    _, ids = topk_softmax(logits, 8, True)
    assert ids[0].tolist() == [7, 64, 90, 0, 1, 2, 3, 4]
    assert ids[1].tolist() == list(range(8))
    assert ids[2].tolist() == list(range(8))


@pytest.mark.parametrize("rows, real, sentinel", [(12, 9, 128), (4, 1, -1), (8, 0, 128),
                                                  (8, 8, 128), (5, 40, 128)])
def test_padding_rows_get_the_sentinel_and_real_rows_do_not_move(rows, real, sentinel,
                                                                 device) -> None:
    logits = _logits(rows, 128, torch.bfloat16, device, seed=rows)
    count = torch.tensor([real], dtype=torch.int32, device=device)
    weights, ids = topk_softmax(logits, 8, True, real=count, sentinel=sentinel)
    all_w, all_i = topk_softmax(logits, 8, True)  # no padding rows
    n = min(real, rows)
    assert torch.equal(ids[:n], all_i[:n]) and torch.equal(weights[:n], all_w[:n])
    assert (ids[n:] == sentinel).all()
    assert torch.equal(weights, all_w)  # a padding row's weights are computed like any row's
    count.fill_(rows)  # the count is read on the device at each launch
    assert torch.equal(topk_softmax(logits, 8, True, real=count, sentinel=sentinel)[1], all_i)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it(device) -> None:
    """A graph key pads the rows; the kill switch runs the real ones: same bits per row."""
    logits = _logits(64, 128, torch.bfloat16, device, seed=3)
    w64, i64 = topk_softmax(logits, 8, True)
    for rows in (1, 3, 17):
        w, i = topk_softmax(logits[:rows], 8, True)
        assert torch.equal(i, i64[:rows]) and torch.equal(w, w64[:rows]), rows


def test_strided_logits_and_int64_ids(device) -> None:
    wide = _logits(6, 160, torch.float16, device, seed=5)
    logits = wide[:, :128]  # row stride 160
    weights, ids = topk_softmax(logits, 8, False, ids_dtype=torch.int64)
    ref_w, ref_i = reference_topk_softmax(logits.cpu(), 8, False)
    assert ids.dtype == torch.int64 and torch.equal(ids.cpu(), ref_i)
    torch.testing.assert_close(weights.cpu().double(), ref_w, atol=1e-6, rtol=1e-5)
    empty_w, empty_i = topk_softmax(logits[:0], 8, False)
    assert empty_w.shape == empty_i.shape == (0, 8)


def test_bad_input_names_the_value(device) -> None:
    logits = _logits(4, 128, torch.bfloat16, device)
    with pytest.raises(ValueError, match=r"top_k=0 with 128 experts"):
        topk_softmax(logits, 0, True)
    with pytest.raises(ValueError, match=r"top_k=129 with 128 experts"):
        topk_softmax(logits, 129, True)
    with pytest.raises(ValueError, match=r"unit expert stride, got shape \(128, 4\)"):
        topk_softmax(logits.t(), 2, True)
    with pytest.raises(NotImplementedError, match="logits dtype torch.int32"):
        topk_softmax(logits.to(torch.int32), 2, True)
    with pytest.raises(NotImplementedError, match="ids dtype torch.int16"):
        topk_softmax(logits, 2, True, ids_dtype=torch.int16)
    with pytest.raises(ValueError, match="real must be one int32 element, got torch.int64"):
        topk_softmax(logits, 2, True, real=torch.tensor([1], device=device))

