"""GPU tier: what clients of `vllm serve` ask of sampling, through steps replayed from graphs.

The tiny real checkpoint (it has a tokenizer, which structured outputs need) serves the staggered
mixed traffic of `run_mixed` with per-request sampling parameters (SAMPLING_FEATURES), first
with graphs, then with the kill switch (steps at the same padded sizes, so the logits are the
same bits); every request's tokens, logprobs and prompt logprobs must be identical, and each
feature visible in them. The harness itself runs on vLLM's CPU build in CI
(tests/graphs/test_mixed_workload_schedule.py).
"""

from __future__ import annotations

import re

import pytest

from tests.gpu_util import require_cuda_and_vllm
from tests.graphs.engine_harness import report, run_mixed

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda_and_vllm():
    require_cuda_and_vllm()


# The sampling-features parity's per-request parameters (request i takes entry i % 7, over
# greedy, one logprob and ignore_eos): what a `vllm serve` client may ask for, each reading the
# logits that a replayed step hands to vLLM's sampler, or the history it keeps. Not
# `allowed_token_ids`: in vLLM 0.26 its mask stays on the batch row a finished request leaves
# (InputBatch.condense, vllm-project/vllm#43894), so a later request there samples under it.
BANNED, STOP = 8, 9
SAMPLING_FEATURES = [
    {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 11},
    {"temperature": 1.0, "min_p": 0.05, "repetition_penalty": 1.3, "presence_penalty": 0.5,
     "frequency_penalty": 0.5, "seed": 12},  # penalties read every output token so far
    {"logit_bias": {7: 3.0, BANNED: -100.0}, "logprobs": 3},
    {"temperature": 0.7, "n": 2, "seed": 13},  # two children, seeds 13 and 14
    {"prompt_logprobs": 2},  # logits of every prompt token, in the steps that prefill it
    {"min_tokens": 16, "ignore_eos": False, "stop_token_ids": [STOP]},
    {"structured_outputs": {"regex": "[ab]{4,24}"}, "ignore_eos": False, "temperature": 0.9,
     "seed": 15},  # a grammar's bitmask applied to the logits
]
SAMPLING_REGEX = SAMPLING_FEATURES[-1]["structured_outputs"]["regex"]


def run_sampling_features(tmp_path, name: str, features: list[dict] = SAMPLING_FEATURES,
                          max_tokens: int = 256, llm_extra: dict | None = None,
                          env_extra=None) -> dict:
    """The tiny checkpoint's staggered mixed traffic (`run_mixed`) with `features`, graphs
    then the kill switch; the tokenizer loaded (structured outputs need it)."""
    return run_mixed(tmp_path, "tiny", name, {}, max_tokens=max_tokens,
                     llm_extra={"skip_tokenizer_init": False, **(llm_extra or {})},
                     env_extra=env_extra, sampling_features=features, record_schedule=True)


def first_divergence(schedules: list[list[list[int]]]) -> int | None:
    """The first step at which a phase scheduled other tokens or requests than the first phase
    (or ran more or fewer steps); None when every phase scheduled the same steps."""
    first = schedules[0]
    for other in schedules[1:]:
        for step, (a, b) in enumerate(zip(first, other)):
            if a != b:
                return step
        if len(first) != len(other):
            return min(len(first), len(other))
    return None


def check_sampling_features(details: list[list[dict]],
                            features: list[dict] = SAMPLING_FEATURES) -> dict:
    """Each feature did what it asks in every phase (so a comparison of phases is not vacuous),
    and every phase's per-request results (tokens, their logprobs, prompt logprobs) equal the
    first phase's exactly. Returns the counts checked."""
    first, n = details[0], len(features)
    counts = {"requests": len(first), "phases": len(details), "identical": 0}
    for phase in details:
        for i, req in enumerate(phase):
            feature, outs = features[i % n], req["completions"]
            tokens = [t for c in outs for t in c["tokens"]]
            assert len(outs) == feature.get("n", 1), (i, req)
            if "n" in feature:  # the two children sample with their own seeds
                assert outs[0]["tokens"] != outs[1]["tokens"], (i, outs)
            if "logit_bias" in feature:
                assert BANNED not in tokens, (i, tokens)
            if "min_tokens" in feature:
                assert len(tokens) >= feature["min_tokens"], (i, tokens)
                assert STOP not in tokens[:feature["min_tokens"]], (i, tokens)
            if "structured_outputs" in feature:
                assert re.fullmatch(SAMPLING_REGEX, outs[0]["text"]), (i, outs[0])
            if "prompt_logprobs" in feature:
                lps = req["prompt_logprobs"]
                assert len(lps) == req["prompt_len"] and lps[0] is None, (i, req["prompt_len"])
                assert all(len(pos) >= 2 for pos in lps[1:]), i
            else:
                assert req["prompt_logprobs"] is None, i
    for phase in details[1:]:
        same = [a == b for a, b in zip(first, phase, strict=True)]
        assert all(same), [i for i, ok in enumerate(same) if not ok]
        counts["identical"] += sum(same)
    return counts


def test_sampling_features_through_graphs_match_kill_switch_eager(tmp_path):
    """What clients of `vllm serve` ask of sampling, through steps replayed from graphs: seeded
    random sampling (top-p/top-k, min-p), penalties, logit bias, min tokens with a stop token,
    two completions of one prompt, prompt logprobs in the steps that prefill (graphed, mixed),
    a structured output's grammar. The tiny checkpoint's staggered mixed traffic, graphs then
    the kill switch (steps at the same padded sizes, so the logits are the same bits): the same
    steps scheduled, every request's tokens, logprobs and prompt logprobs identical, each
    feature visible in them (`check_sampling_features`). That two phases of this harness
    schedule and sample alike without graphs is checked on vLLM's CPU build
    (tests/graphs/test_mixed_workload_schedule.py, with the two departures that build needs)."""
    summary = run_sampling_features(tmp_path, "sampling-features")
    schedules = summary.pop("schedules")
    # outputs that differ change what is scheduled next: where the phases' steps part says
    # which step to look at first
    summary["steps_per_phase"] = [len(s) for s in schedules]
    summary["first_schedule_divergence"] = first_divergence(schedules)
    details = summary.pop("details")
    report("parity-sampling-features", summary)  # before the checks: a failed run keeps it
    summary["sampling_features"] = counts = check_sampling_features(details)
    report("parity-sampling-features", summary)
    assert summary["first_schedule_divergence"] is None, summary
    assert summary["mode_graphs"] == 1, summary["log_lines"]
    (row,) = summary["rows"]
    assert row["replays"] > 0 and row["replays_while_killed"] == 0, row
    assert row["kill_switch_fallbacks"] > 0, row
    replays = summary["replays_by_kind"]
    assert replays["mixed"] > 0 and replays["decode"] > 0, replays
    # decode steps handed their in-graph logits to the sampler these features act on
    assert summary["graph_logits_handed_over"] > 0, summary
    assert counts["identical"] == counts["requests"], counts


SAMPLE_IN_GRAPH = {"sample_in_graph": True}
QWEN3_CHAT = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "logprobs": None}


def test_sampling_features_with_sampler_graphs_stay_vllms(tmp_path):
    """`sample_in_graph` on: every feature of the parity above is one the sampler graph leaves
    to vLLM's sampler (seeds, logprobs, penalties, logit bias, min tokens, structured output),
    so graphs and the kill switch stay identical, and each batch is counted under its reason."""
    summary = run_mixed(tmp_path, "tiny", "sampling-features-sampler-graphs", SAMPLE_IN_GRAPH,
                        max_tokens=256, llm_extra={"skip_tokenizer_init": False},
                        sampling_features=SAMPLING_FEATURES)
    details = summary.pop("details")
    report("parity-sampling-features-sampler-graphs", summary)
    counts = check_sampling_features(details)
    report("parity-sampling-features-sampler-graphs", {**summary, "sampling_features": counts})
    assert counts["identical"] == counts["requests"], counts
    assert summary["sampled_in_graph"] == 0, summary
    assert summary["sampler_fallbacks"].get("logprobs", 0) > 0, summary["sampler_fallbacks"]
    assert "sampler_failed" not in summary["sampler_fallbacks"], summary["sampler_fallbacks"]


def test_unseeded_chat_sampling_is_drawn_by_sampler_graphs(tmp_path):
    """Qwen3's advised chat sampling, unseeded, no logprobs, every other request under a
    grammar: with `sample_in_graph` the graph phase's sampled steps (decode and mixed) draw
    from sampler graphs, none falls back to vLLM's sampler, every plain request gets its 64
    tokens and every structured one matches its regex. (Unseeded draws differ between phases;
    the distribution is tests/graphs/test_gpu_sampler_graphs.py's.)"""
    structured = {**QWEN3_CHAT, "structured_outputs": {"regex": SAMPLING_REGEX},
                  "ignore_eos": False}
    summary = run_mixed(tmp_path, "tiny", "chat-sampling-sampler-graphs", SAMPLE_IN_GRAPH,
                        max_tokens=64, llm_extra={"skip_tokenizer_init": False},
                        sampling_features=[QWEN3_CHAT, structured])
    details = summary.pop("details")
    report("sampler-graphs-chat", summary)
    assert summary["mode_graphs"] == 1, summary["log_lines"]
    assert summary["sampled_in_graph"] > 0, summary
    assert not summary["sampler_fallbacks"], summary["sampler_fallbacks"]
    for i, req in enumerate(details[0]):
        out = req["completions"][0]
        if i % 2:
            assert re.fullmatch(SAMPLING_REGEX, out["text"]), (i, out)
        else:
            assert len(out["tokens"]) == 64, (i, out)
