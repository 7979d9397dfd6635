"""The GPU mixed-parity test's tiny workload (`TINY_MIXED`) checked on vLLM's CPU build: its
scheduler, given the same prompts, arrivals, step budget and 16-token KV blocks as on the GPU,
puts prefill tokens into most steps, which the GPU test asserts of its run. A step counts as
carrying prefill tokens when some request in it has more than one query token (the plugin's
step kinds, graphs/kinds.py)."""

from __future__ import annotations

from tests.serve_util import run_result_script

PROBE = r"""
import json, sys

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from tests.graphs.test_gpu_integration import TINY_MIXED, mixed_prompts
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
