"""The GPU mixed tests' workloads checked on vLLM's CPU build, whose scheduler, given the same
prompts, arrivals, step budget and 16-token KV blocks as on the GPU, schedules the same steps:
- the tiny workload (`TINY_MIXED`) puts prefill tokens into most steps, which the GPU test
  asserts of its run. A step counts as carrying prefill tokens when some request in it has
  more than one query token (the plugin's step kinds, graphs/kinds.py);
- in the Qwen3-0.6B traffic of the mixed-faults test the first key to reach its capture under
  `MIXED_FAULTS_PLUGIN` is one with prefill tokens, the capture that test makes fail;
- the sampling-features parity's harness, run as the GPU test runs it but for two departures
  the CPU build needs (every row seeded, no prompt chunked): two phases of its traffic schedule
  the same steps and sample alike (so a difference on the GPU is the graphs'), and each
  feature shows in the outputs (so their equality is not vacuous)."""

from __future__ import annotations

from tests.serve_util import run_result_script

PROBE = r"""
import json, sys

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from tests.graphs.engine_harness import TINY_MIXED, mixed_prompts
from tests.tiny_models import build_checkpoint

w = TINY_MIXED
path = build_checkpoint(sys.argv[2], head_dim=64, max_positions=w["max_positions"])
vocab = json.load(open(path + "/config.json"))["vocab_size"]
llm = LLM(model=path, skip_tokenizer_init=True, max_model_len=w["max_positions"],
          max_num_seqs=w["max_num_seqs"], max_num_batched_tokens=w["max_num_batched_tokens"],
          enable_prefix_caching=True, enable_chunked_prefill=True, enforce_eager=True,
          block_size=16, dtype="float32")
sched = llm.llm_engine.engine_core.engine_core.scheduler
counts = {"with_prefill": 0, "decode": 0}
schedule = sched.schedule


def counting_schedule(*args, **kwargs):
    out = schedule(*args, **kwargs)
    if out.total_num_scheduled_tokens:
        prefill = any(n > 1 for n in out.num_scheduled_tokens.values())
        counts["with_prefill" if prefill else "decode"] += 1
    return out


sched.schedule = counting_schedule
engine = llm.llm_engine
prompts = [TokensPrompt(prompt_token_ids=p) for p in mixed_prompts(vocab, w["scale"])]
params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True, detokenize=False)
step = sent = 0
while sent < len(prompts) or engine.has_unfinished_requests():
    if sent < len(prompts) and step % w["arrive_every"] == 0:
        engine.add_request(str(sent), prompts[sent], params)
        sent += 1
    engine.step()
    step += 1
print("RESULT " + json.dumps(counts), flush=True)
"""


def test_tiny_mixed_workload_puts_prefill_tokens_into_most_steps(cpu_vllm, tmp_path):
    counts = run_result_script(PROBE, cpu_vllm, argv=[str(tmp_path / "tiny")],
                               VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_PLUGINS="")
    assert counts["with_prefill"] > counts["decode"] > 0, counts


FIRST_CAPTURE = r"""
import json, os, sys

import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from tests.graphs.engine_harness import MIXED_FAULTS_PLUGIN, mixed_prompts
from tests.tiny_models import build_checkpoint
from vllm_moe_graphs.config import PluginConfig
from vllm_moe_graphs.graphs.buckets import graph_config
from vllm_moe_graphs.graphs.decision import Action
from vllm_moe_graphs.graphs.kinds import StepKind, step_kind
from vllm_moe_graphs.graphs.runner import DecodeGraphRunner
from vllm_moe_graphs.killswitch import KillSwitch

# run_mixed's Qwen3-0.6B engine: 4864 positions, a 256-token step budget, 64 sequences, prefix
# caching, one arrival every 4 steps, the kill file flipped every 24; its prompts drawn for
# the shape's vocabulary, their ids folded into the tiny checkpoint's (lengths and shared
# prefixes kept)
MAX_LEN, BUDGET, SEQS, EVERY, TOGGLE, VOCAB = 4864, 256, 64, 4, 24, 151936
path = build_checkpoint(sys.argv[2], head_dim=64, max_positions=MAX_LEN)
vocab = json.load(open(path + "/config.json"))["vocab_size"]
prompts = [[10 + t % (vocab - 20) for t in p] for p in mixed_prompts(VOCAB)]
llm = LLM(model=path, skip_tokenizer_init=True, max_model_len=MAX_LEN, max_num_seqs=SEQS,
          max_num_batched_tokens=BUDGET, enable_prefix_caching=True, enable_chunked_prefill=True,
          enforce_eager=True, block_size=16, dtype="float32")
sched = llm.llm_engine.engine_core.engine_core.scheduler
schedule = sched.schedule

# the plugin's own runner decides each step (host only: its forward is a stand-in and nothing
# is captured; one graph per decode bucket pair, as with no shared attention plan)
def no_capture(*args, **kwargs):
    raise AssertionError("the probe stops at the first CAPTURE decision")


kill_file = sys.argv[2] + ".kill"
runner = DecodeGraphRunner(
    lambda rows: torch.zeros(rows, 1),
    graph_config(PluginConfig(mixed_graphs=True, **MIXED_FAULTS_PLUGIN), SEQS, MAX_LEN, BUDGET),
    kill_switch=KillSwitch(kill_file, interval_s=0.0), capture_fn=no_capture)
steps, first = [], []


def watching_schedule(*args, **kwargs):
    out = schedule(*args, **kwargs)
    if out.total_num_scheduled_tokens and not first:
        lens = list(out.num_scheduled_tokens.values())
        decode = step_kind(sum(lens), len(lens), max(lens), lens) is StepKind.DECODE
        context = max(sched.requests[r].num_computed_tokens for r in out.num_scheduled_tokens)
        d = (runner.decide(len(lens), context, True) if decode
             else runner.decide(sum(lens), context, False, requests=len(lens)))
        steps.append([d.action.value, str(d.key)])
        if d.action is Action.CAPTURE:
            k = d.key
            first.append(["decode" if decode else "prefill tokens",
                          [k.batch_bucket, k.context_bucket, k.request_bucket], len(steps)])
        else:
            runner.run(d)
    return out


sched.schedule = watching_schedule
engine, killed = llm.llm_engine, False
params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True, detokenize=False)
step = sent = 0
while not first and step < 200:
    if step and step % TOGGLE == 0:
        killed = not killed
        if killed:
            open(kill_file, "w").close()
        else:
            os.remove(kill_file)
    if sent < len(prompts) and step % EVERY == 0:
        engine.add_request(str(sent), TokensPrompt(prompt_token_ids=prompts[sent]), params)
        sent += 1
    engine.step()
    step += 1
print("RESULT " + json.dumps({"first_capture": first[0] if first else None,
                              "steps": steps[:16]}), flush=True)
"""


def test_mixed_faults_traffic_captures_a_key_with_prefill_tokens_first(cpu_vllm, tmp_path):
    result = run_result_script(FIRST_CAPTURE, cpu_vllm, argv=[str(tmp_path / "tiny")],
                               VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_PLUGINS="")
    assert result["first_capture"] is not None, result
    kind, (_, _, requests), _ = result["first_capture"]
    assert kind == "prefill tokens" and requests > 0, result


def test_sampling_features_schedule_and_sample_alike_in_two_phases(cpu_vllm, tmp_path,
                                                                   monkeypatch):
    from tests.graphs.test_gpu_sampling import (SAMPLING_FEATURES, check_sampling_features,
                                               first_divergence, run_sampling_features)

    # Two departures from the GPU run, both for vLLM's CPU build: its sampler honours the
    # per-request seeds only when every row of the batch has one (else it samples every row
    # from the global generator), so the greedy entries sample at a low temperature with a
    # seed; and it cannot rewind a seeded generator after sampling a partial prefill chunk,
    # which it discards ("CPU Generator does not use offset"), so no prompt is chunked. On the
    # GPU vLLM does both, so the GPU test keeps greedy rows and chunked steps.
    features = [{"seed": 100 + i, **f, "temperature": f.get("temperature") or 0.05}
                for i, f in enumerate(SAMPLING_FEATURES)]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # vLLM runs stock here
    summary = run_sampling_features(
        tmp_path, "sampling-features-cpu", features, max_tokens=48,
        llm_extra={"enforce_eager": True, "dtype": "float32", "block_size": 16,
                   "enable_chunked_prefill": False, "max_num_batched_tokens": 2048},
        env_extra={"PYTHONPATH": cpu_vllm, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_PLUGINS": ""})
    assert first_divergence(summary["schedules"]) is None
    assert len(summary["schedules"][0]) > 64, summary["schedules"][0]  # steps were recorded
    counts = check_sampling_features(summary["details"], features)
    assert counts == {"requests": 64, "phases": 2, "identical": 64}, counts
