"""The verdict of the GPU end-to-end backend test (tests/attention/test_gpu_backend_e2e.py), pure:
`compare` turns two runs into agreement numbers and `check` judges CUSTOM's numbers against the
absolute thresholds or, where those fail, against a control run (TRITON_ATTN rescheduled).

Criteria (`check`, pure; n = 64 prompts; "genuine" = prompts whose first divergence is not a
near-tie, i.e. not where each run holds the other's token within TIE_NATS of its own choice).
Each holds when its absolute threshold does OR CUSTOM is no further from the reference than the
control is, with PROMPT_SLACK = 3 prompts of allowance for 64-prompt sampling noise:
  (1) first-token agreement counting near-ties >= min(0.95, control's - 3/n)   (prefill kernel)
  (2) strict first-token agreement               >= min(0.90, control's - 3/n)
  (3) genuine divergences                        <= max(0.05 n, control's + 3)
  (4) max |logprob diff| of the chosen token along the common prefix
                                                 <= max(0.5 nats, 1.5 x control's)
  (5) mean common prefix >= 0.75 x control's: CUSTOM does not diverge systematically earlier
      (relative only; it has no absolute threshold);
  (6) the reference logits are not flat (mean top-1 logprob > -10.5; -ln 151936 = -11.93), i.e.
      the weight re-draw took effect (otherwise every comparison here would be vacuous).
A control bit-identical to the reference (no prompt diverged) leaves nothing to allow for:
then (1)-(4) use their absolute thresholds alone and (5) does not apply. We request
logprobs=20 (TOP_LOGPROBS) so that a 3- or more-way near-tie still classifies: with 2, the other
run's token is often 3rd and not reported. The report also gives the identical-token fraction."""

from __future__ import annotations

TOP_LOGPROBS = 20  # vLLM's default max_logprobs; multi-way near-ties need more than the top 2
TIE_NATS = 0.1  # each run holds the other's token within this many nats of its own choice
MAX_LOGPROB_DIFF = 0.5  # nats, chosen token, along the common prefix
PROMPT_SLACK = 3  # prompts of allowance over the control: sampling noise of 64 prompts
CONTROL_LOGPROB_FACTOR = 1.5  # CUSTOM's max logprob difference may reach 1.5x the control's
CONTROL_PREFIX_FRACTION = 0.75  # CUSTOM's mean common prefix >= 0.75x the control's


def _lp(top: list[list[float]], token: int) -> float | None:
    for tok, lp in top:
        if int(tok) == token:
            return lp
    return None


def _near_tie(ref_top, test_top, ref_tok: int, test_tok: int) -> bool:
    """Each side holds the other's token within TIE_NATS of its own choice."""
    ref_other, test_other = _lp(ref_top, test_tok), _lp(test_top, ref_tok)
    if ref_other is None or test_other is None:
        return False
    return (_lp(ref_top, ref_tok) - ref_other <= TIE_NATS
            and _lp(test_top, test_tok) - test_other <= TIE_NATS)


def compare(ref: list[dict], test: list[dict]) -> dict:
    """Per-prompt agreement of two runs ({"tokens", "top"} per prompt, same prompt order)."""
    assert len(ref) == len(test), "both runs must answer every prompt"
    n = len(ref)
    identical = total = first_agree = first_tie = diverged = diverged_tie = 0
    prefixes, max_diff, max_diff_first = [], 0.0, 0.0
    for r, t in zip(ref, test):
        rt, tt = r["tokens"], t["tokens"]
        length = min(len(rt), len(tt))
        total += max(len(rt), len(tt))
        identical += sum(a == b for a, b in zip(rt, tt))
        d = next((i for i in range(length) if rt[i] != tt[i]), length)
        prefixes.append(d)
        for i in range(d):
            lp_ref, lp_test = _lp(r["top"][i], rt[i]), _lp(t["top"][i], tt[i])
            assert lp_ref is not None and lp_test is not None, "sampled token without logprob"
            diff = abs(lp_ref - lp_test)
            max_diff = max(max_diff, diff)
            if i == 0:
                max_diff_first = max(max_diff_first, diff)
        tie = d < length and _near_tie(r["top"][d], t["top"][d], rt[d], tt[d])
        if d > 0 or length == 0:
            first_agree += 1
        if d > 0 or length == 0 or tie:
            first_tie += 1
        if d < length:
            diverged += 1
            diverged_tie += tie
    return {
        "num_prompts": n,
        "tokens_compared": total,
        "identical_token_fraction": identical / max(total, 1),
        "first_token_agreement": first_agree / n,
        "first_token_agreement_tie_aware": first_tie / n,
        "prompts_fully_identical": n - diverged,
        "prompts_diverged": diverged,
        "prompts_diverged_at_near_tie": diverged_tie,
        "mean_common_prefix": sum(prefixes) / n,
        "min_common_prefix": min(prefixes),
        "max_abs_logprob_diff": max_diff,
        "max_abs_logprob_diff_first_token": max_diff_first,
    }


def mean_top1_logprob(outputs: list[dict]) -> float:
    """Mean logprob of the greedy token: about -ln(vocab) when the logits are flat."""
    values = [pos[0][1] for out in outputs for pos in out["top"]]
    return sum(values) / max(len(values), 1)


def genuine_divergences(summary: dict) -> int:
    """Prompts whose first divergence is not a near-tie."""
    return summary["prompts_diverged"] - summary["prompts_diverged_at_near_tie"]


def check(summary: dict, control: dict | None = None) -> list[str]:
    """The criteria of the module docstring; empty when they hold. `summary` is `compare(reference,
    CUSTOM)`, `control` is `compare(reference, control run)`. Each criterion holds when its
    absolute threshold does or when CUSTOM is no further from the reference than the control is
    (PROMPT_SLACK prompts of allowance). Without a control, or with one bit-identical to the
    reference, only the absolute thresholds apply. Pure: reads its arguments, changes nothing."""
    n = summary["num_prompts"]
    if control is not None:
        assert control["num_prompts"] == n, "the control must answer the same prompts"
    relative = control is not None and control["prompts_diverged"] > 0
    slack = PROMPT_SLACK / max(n, 1)
    failures: list[str] = []

    def fail(measured: str, absolute: str, allowance: str, control_value: str) -> None:
        """One failure message: CUSTOM's value, the absolute threshold, the control's value."""
        if control is None:
            tail = "no control run"
        elif not relative:
            tail = f"the control ({control_value}) is bit-identical to the reference: no allowance"
        else:
            tail = f"{allowance} (control {control_value})"
        failures.append(f"{measured}: {absolute} (absolute); {tail}")

    for key, label, absolute in (
        ("first_token_agreement_tie_aware", "first-token agreement (near-ties allowed)", 0.95),
        ("first_token_agreement", "first-token agreement", 0.90),
    ):
        value = summary[key]
        floor = control[key] - slack if control is not None else absolute
        if value < (min(absolute, floor) if relative else absolute):
            fail(f"{label} {value:.3f}", f"< {absolute}",
                 f"< {floor:.3f} = control - {PROMPT_SLACK}/{n}",
                 f"{control[key]:.3f}" if control is not None else "")

    genuine = genuine_divergences(summary)
    control_genuine = genuine_divergences(control) if control is not None else 0
    ceiling = control_genuine + PROMPT_SLACK
    if genuine > (max(0.05 * n, ceiling) if relative else 0.05 * n):
        fail(f"{genuine} of {n} prompts diverged at a position that is not a near-tie",
             f"> {0.05 * n:.1f} = 5%", f"> {ceiling} = control + {PROMPT_SLACK}",
             f"{control_genuine}")

    diff = summary["max_abs_logprob_diff"]
    control_diff = control["max_abs_logprob_diff"] if control is not None else 0.0
    ceiling = CONTROL_LOGPROB_FACTOR * control_diff
    if diff > (max(MAX_LOGPROB_DIFF, ceiling) if relative else MAX_LOGPROB_DIFF):
        fail(f"logprob difference {diff:.3f} nats along the common prefix",
             f"> {MAX_LOGPROB_DIFF}", f"> {ceiling:.3f} = {CONTROL_LOGPROB_FACTOR} x control",
             f"{control_diff:.3f}")

    if relative:  # relative only: a bit-identical control's prefix is the whole completion
        prefix, control_prefix = summary["mean_common_prefix"], control["mean_common_prefix"]
        floor = CONTROL_PREFIX_FRACTION * control_prefix
        if prefix < floor:
            failures.append(
                f"mean common prefix {prefix:.1f} tokens: no absolute threshold, and < "
                f"{floor:.1f} = {CONTROL_PREFIX_FRACTION} x control (control {control_prefix:.1f}):"
                " CUSTOM diverges systematically earlier than a reschedule of the reference")
    return failures
