"""CPU tier: the verdict logic of the GPU end-to-end test (tests/attention/e2e_verdict.py, used
by tests/attention/test_gpu_backend_e2e.py).

`compare` turns two runs into agreement numbers and `check` judges CUSTOM's numbers against the
absolute thresholds or, where those fail, against a control run (TRITON_ATTN rescheduled). Both
are pure, so they are tested here on hand-made runs and summaries, with the H200 numbers of the
run judged by absolute thresholds alone (its summary is in git history) as CUSTOM's.
"""

from __future__ import annotations

import copy

import pytest

from .e2e_verdict import (
    TIE_NATS,
    TOP_LOGPROBS,
    _near_tie,
    check,
    compare,
    genuine_divergences,
)
from .test_gpu_backend_e2e import MAX_TOKENS

N = 64


def _summary(first=1.0, first_tie=1.0, diverged=0, at_tie=0, prefix=float(MAX_TOKENS),
             logprob=0.0) -> dict:
    """The numbers `check` reads, as `compare` names them."""
    return {"num_prompts": N, "first_token_agreement": first,
            "first_token_agreement_tie_aware": first_tie, "prompts_diverged": diverged,
            "prompts_diverged_at_near_tie": at_tie, "mean_common_prefix": prefix,
            "max_abs_logprob_diff": logprob}


# CUSTOM vs TRITON_ATTN as measured on the H200 (first e2e run)
DENSE = _summary(first=0.984375, first_tie=1.0, diverged=61, at_tie=52, prefix=42.42,
                 logprob=0.0323)
MOE = _summary(first=0.9375, first_tie=0.953125, diverged=64, at_tie=32, prefix=19.98,
               logprob=0.594)
PERFECT = _summary()


def _top(*pairs) -> list[list[float]]:
    """A position's top-k list, most likely first: (token, logprob) pairs."""
    return sorted(([tok, lp] for tok, lp in pairs), key=lambda item: -item[1])


def _run(tokens_and_tops):
    return [{"tokens": [t for t, _ in seq], "top": [top for _, top in seq]}
            for seq in tokens_and_tops]


@pytest.mark.parametrize("custom, control", [
    (DENSE, _summary(first=0.97, first_tie=1.0, diverged=60, at_tie=53, prefix=45.0,
                     logprob=0.03)),
    (MOE, _summary(first=0.92, first_tie=0.94, diverged=64, at_tie=34, prefix=22.0,
                   logprob=0.45)),
], ids=["dense", "moe"])
def test_within_the_control_passes(custom, control):
    assert check(custom) != [], "these H200 numbers fail the absolute thresholds alone"
    before = copy.deepcopy((custom, control))
    assert check(custom, control) == []
    assert (custom, control) == before, "check must not change its arguments"


def test_no_worse_than_the_control_at_the_edges():
    """Each relative bound is inclusive: control - 3/n, control + 3, 1.5x, 0.75x."""
    control = _summary(first=0.90, first_tie=0.94, diverged=40, at_tie=30, prefix=40.0,
                       logprob=0.4)
    edge = _summary(first=0.90 - 3 / N, first_tie=0.94 - 3 / N, diverged=40, at_tie=27,
                    prefix=30.0, logprob=0.6)
    assert check(edge, control) == []


def test_genuine_divergences_far_beyond_the_control_fail():
    control = _summary(first=0.98, first_tie=1.0, diverged=50, at_tie=48, prefix=40.0,
                       logprob=0.05)
    custom = _summary(first=0.98, first_tie=1.0, diverged=50, at_tie=30, prefix=38.0,
                      logprob=0.05)
    assert genuine_divergences(custom) == 20 and genuine_divergences(control) == 2
    failures = check(custom, control)
    assert len(failures) == 1, failures
    # CUSTOM's value, the absolute threshold (5% of 64) and the control's value with allowance
    assert failures[0].startswith("20 of 64 prompts diverged at a position that is not a near-tie")
    assert "> 3.2 = 5% (absolute)" in failures[0]
    assert "> 5 = control + 3 (control 2)" in failures[0]


def test_diverging_systematically_earlier_than_the_control_fails():
    control = _summary(first=0.98, first_tie=1.0, diverged=40, at_tie=38, prefix=60.0,
                       logprob=0.05)
    custom = _summary(first=0.98, first_tie=1.0, diverged=60, at_tie=58, prefix=30.0,
                      logprob=0.05)
    assert check(custom) == [], "within every absolute threshold"
    failures = check(custom, control)
    assert len(failures) == 1, failures
    assert "mean common prefix 30.0 tokens" in failures[0]
    assert "< 45.0 = 0.75 x control (control 60.0)" in failures[0]


def test_every_criterion_quotes_custom_absolute_and_control():
    control = _summary(first=0.97, first_tie=0.98, diverged=30, at_tie=29, prefix=80.0,
                       logprob=0.2)
    custom = _summary(first=0.80, first_tie=0.85, diverged=64, at_tie=40, prefix=10.0,
                      logprob=0.9)
    failures = check(custom, control)
    assert len(failures) == 5, failures
    tie_aware, strict, genuine, logprob, prefix = failures
    assert tie_aware == ("first-token agreement (near-ties allowed) 0.850: < 0.95 (absolute); "
                         "< 0.933 = control - 3/64 (control 0.980)")
    assert strict == ("first-token agreement 0.800: < 0.9 (absolute); "
                      "< 0.923 = control - 3/64 (control 0.970)")
    assert genuine == ("24 of 64 prompts diverged at a position that is not a near-tie: "
                       "> 3.2 = 5% (absolute); > 4 = control + 3 (control 1)")
    assert logprob == ("logprob difference 0.900 nats along the common prefix: > 0.5 "
                       "(absolute); > 0.300 = 1.5 x control (control 0.200)")
    assert prefix.startswith("mean common prefix 10.0 tokens: no absolute threshold, and < 60.0")


def test_bit_identical_control_leaves_the_absolute_thresholds_alone():
    # near-ties only, diverging early: the absolute thresholds hold, the prefix is not judged
    early = _summary(first=1.0, first_tie=1.0, diverged=64, at_tie=64, prefix=5.0, logprob=0.1)
    assert check(early, PERFECT) == check(early) == []
    # the measured numbers fail exactly as without a control, and say why there is no allowance
    for custom in (DENSE, MOE):
        failures = check(custom, PERFECT)
        assert [f.split(";")[0] for f in failures] == [f.split(";")[0] for f in check(custom)]
        assert all("bit-identical to the reference: no allowance" in f for f in failures)
    # with few prompts control - 3/n would undercut 0.95; a bit-identical control must not
    few = dict(_summary(first=0.9, first_tie=0.9), num_prompts=20)
    control = dict(PERFECT, num_prompts=20)
    assert any("near-ties allowed" in f for f in check(few, control))


def test_control_of_zeros_needs_no_special_case():
    """A control with zero agreement, prefix and logprob difference: nothing divides by zero,
    and CUSTOM no further off than that control passes (the control is the yardstick)."""
    zero = _summary(first=0.0, first_tie=0.0, diverged=N, at_tie=0, prefix=0.0, logprob=0.0)
    assert check(PERFECT, zero) == []
    assert check(zero, zero) == []
    assert len(check(zero)) == 3  # no control: agreement twice and genuine divergences fail


def test_near_tie_deep_in_the_top_k():
    """TOP_LOGPROBS = 20 lets a multi-way near-tie classify: the other run's token at rank 5."""
    assert TOP_LOGPROBS == 20
    ref_top = _top(*[(100 + i, -2.0 - 0.01 * i) for i in range(20)])  # 100 first, 104 fifth
    test_top = _top((104, -2.0), (101, -2.01), (102, -2.02), (103, -2.03), (100, -2.05),
                    *[(100 + i, -2.1 - 0.01 * i) for i in range(5, 20)])  # 100 fifth
    assert ref_top[4][0] == 104 and test_top[4][0] == 100 and len(test_top) == TOP_LOGPROBS
    assert _near_tie(ref_top, test_top, 100, 104)
    # the same ranks, but the other run's token too far below: a genuine divergence
    far_ref = [[tok, lp if tok != 104 else -2.0 - 2 * TIE_NATS] for tok, lp in ref_top]
    assert not _near_tie(far_ref, test_top, 100, 104)
    # not reported at all (outside the top k): cannot be a tie
    assert not _near_tie(ref_top[:4], test_top, 100, 104)


def test_compare_counts_a_three_way_tie_at_rank_three():
    """Both runs' tokens within TIE_NATS, each 3rd in the other's top list: a near-tie, which
    the old logprobs=2 could not see."""
    same = [(5, _top((5, -1.0), (6, -1.5), (9, -3.0)))]
    ref = _run([same + [(7, _top((7, -0.70), (2, -0.71), (8, -0.72)))]] * 10)
    test = _run([same + [(8, _top((8, -0.70), (2, -0.705), (7, -0.71)))]] * 10)
    summary = compare(ref, test)
    assert summary["prompts_diverged"] == summary["prompts_diverged_at_near_tie"] == 10
    assert summary["first_token_agreement"] == 1.0 and summary["mean_common_prefix"] == 1.0
    assert genuine_divergences(summary) == 0
    # the control of a rerun identical to the reference is bit-identical
    control = compare(ref, ref)
    assert control["prompts_diverged"] == 0 and control["max_abs_logprob_diff"] == 0.0
    assert check(summary, control) == []


def test_e2e_comparison_verdicts():
    """The comparison the GPU e2e test relies on: agreement, near-ties, genuine divergence."""
    same = [(5, [[5, -1.0], [6, -1.5]]), (7, [[7, -0.5], [8, -2.0]])]
    ref = _run([same] * 20)
    summary = compare(ref, _run([same] * 20))
    assert summary["first_token_agreement"] == 1.0 and summary["prompts_diverged"] == 0
    assert summary["max_abs_logprob_diff"] == 0.0 and check(summary) == []

    # second token flips between two tokens 0.02 nats apart in both runs: a near-tie
    tie_ref = [(5, [[5, -1.0], [6, -1.5]]), (7, [[7, -0.70], [8, -0.72]])]
    tie_test = [(5, [[5, -1.01], [6, -1.5]]), (8, [[8, -0.70], [7, -0.71]])]
    summary = compare(_run([tie_ref] * 20), _run([tie_test] * 20))
    assert summary["prompts_diverged"] == summary["prompts_diverged_at_near_tie"] == 20
    assert summary["first_token_agreement"] == 1.0
    assert abs(summary["max_abs_logprob_diff"] - 0.01) < 1e-9 and check(summary) == []

    # first token replaced by one outside the reference's top 2 in 2 of 20 prompts: genuine
    wrong = [(9, [[9, -0.2], [3, -3.0]]), (7, [[7, -0.5], [8, -2.0]])]
    summary = compare(ref, _run([wrong] * 2 + [same] * 18))
    assert summary["first_token_agreement"] == summary["first_token_agreement_tie_aware"] == 0.9
    failures = check(summary)
    assert any("not a near-tie" in f for f in failures)
    assert any("near-ties allowed" in f for f in failures)

    # same tokens, logprobs far apart: attention numerically wrong without a flip
    off = [(5, [[5, -2.0], [6, -2.5]]), (7, [[7, -0.5], [8, -2.0]])]
    failures = check(compare(ref, _run([off] * 20)))
    assert any("logprob difference" in f for f in failures)
