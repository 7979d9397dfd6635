"""`DecodeInputs` writes what vLLM's `_prepare_inputs` writes, on a real engine.

vLLM's CPU build runs the V1 runner's `_prepare_inputs` (its CPU runner subclasses the GPU
one; device buffers alias the host ones there). The probe serves staggered greedy requests of
different lengths (arrivals make mixed steps, finishes make the batch shrink and reorder, long
ones cross KV block boundaries) and, at every pure-decode step, runs vLLM's path and then ours
from the same starting state and compares every buffer the step reads afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.serve_util import free_port, run_result_script

pytest.importorskip("vllm.v1.worker.gpu_model_runner")

PROBE = r"""
import json, os, sys, tempfile
import numpy as np
import torch
from tests.gpu_util import engine_starting
from tests.tiny_models import build_checkpoint
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm_moe_graphs.integration.runner.decode_inputs import DecodeInputs, pure_decode, unsupported

path = build_checkpoint(tempfile.mkdtemp())
ASYNC = sys.argv[2] == "async"
if ASYNC:
    # vLLM's CPU platform switches async scheduling off ("not required on CPU"); switch it back
    # on after that hook so the runner keeps last step's sampled tokens on the device, as on a GPU
    from vllm.platforms.cpu import CpuPlatform

    _update = CpuPlatform.check_and_update_config.__func__

    def _keep_async(cls, vllm_config):
        _update(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(_keep_async)
GPU = len(sys.argv) > 3 and sys.argv[3] == "gpu"
# on the GPU: bfloat16, TRITON_ATTN (the GPU bundle has no FlashAttention), and a fixed 1 GiB
# KV cache instead of vLLM's default 92% of the GPU (other test lanes share it)
extra = {"attention_config": {"backend": "TRITON_ATTN"}, "gpu_memory_utilization": 0.05,
         "kv_cache_memory_bytes": 1 << 30} if GPU else {}
with engine_starting():  # a no-op outside the GPU tier's lanes
    llm = LLM(path, enforce_eager=True, max_model_len=256, max_num_seqs=8, block_size=16,
              dtype="bfloat16" if GPU else "float32", seed=0, async_scheduling=ASYNC, **extra)
engine = llm.llm_engine
runner = engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
assert unsupported(runner) is None, unsupported(runner)
fast = DecodeInputs(runner)
table = runner.input_batch.block_table.block_tables[0]


def buffers():
    return {"input_ids": runner.input_ids.cpu, "input_ids_gpu": runner.input_ids.gpu,
            "query_start_loc": runner.query_start_loc.cpu,
            "optimistic_seq_lens": runner.optimistic_seq_lens_cpu,
            "prev_positions": runner.prev_positions.cpu,
            "discard_request_mask": runner.discard_request_mask.cpu,
            "positions": runner.positions, "seq_lens": runner.seq_lens,
            "slot_mapping": table.slot_mapping.gpu, "block_table": table.block_table.gpu}


stats = {"fast": 0, "vllm_only": 0, "mismatches": [], "batches": set(), "max_position": 0,
         "async": 0, "kept_rows": 0, "moved_rows": 0, "new_rows": 0, "bookkeeping": 0,
         "bookkeeping_vllm": 0, "discarded_rows": 0}
stock = runner._prepare_inputs


def checked(scheduler_output, num_scheduled_tokens):
    if not pure_decode(runner, scheduler_output):
        stats["vllm_only"] += 1
        return stock(scheduler_output, num_scheduled_tokens)
    n = runner.input_batch.num_reqs
    if runner.input_batch.prev_sampled_token_ids is not None:  # async: last tokens on device
        stats["async"] += 1
        runner._compute_prev_positions(n)
        prev = runner.prev_positions.np[:n]
        kept = prev == np.arange(n)
        stats["kept_rows"] += int(kept.all())
        stats["moved_rows"] += int(bool(((prev >= 0) & ~kept).any()))
        stats["new_rows"] += int(bool((prev < 0).any()))
    before = {k: v.clone() for k, v in buffers().items()}
    ref_logits, ref_spec = stock(scheduler_output, num_scheduled_tokens)
    if GPU:
        # vLLM's path leaves non-blocking copies from pinned host buffers in flight: let them
        # read those buffers before they are restored below (else the copies race the restore)
        torch.cuda.synchronize()
    ref = {k: v.clone() for k, v in buffers().items()}
    for k, v in buffers().items():
        v.copy_(before[k])
    logits, spec = fast.prepare(runner, scheduler_output)
    mine = buffers()
    # rows past n of input_ids / positions / prev_positions / discard mask are left stale by
    # both. The slot mapping past n: the GPU's Triton kernel pads it with -1 (PAD_SLOT_ID, up to
    # max_num_batched_tokens), the CPU build's C++ kernel leaves it; ours must pad like the GPU.
    rows = {"input_ids": n, "input_ids_gpu": n, "positions": n, "prev_positions": n, "discard_request_mask": n,
            "slot_mapping": n}
    if not bool((mine["slot_mapping"][n:] == -1).all()):
        stats["mismatches"].append("slot_mapping past the batch is not all -1")
    for k in ref:
        a, b = ref[k], mine[k]
        if k in rows:
            a, b = a[:rows[k]], b[:rows[k]]
        if a.dtype != b.dtype or not torch.equal(a, b):
            stats["mismatches"].append(f"step {stats['fast']}: {k}: vLLM {a.tolist()[:12]} "
                                       f"ours {b.tolist()[:12]}")
    # ours is a slice (a view in vLLM's `hidden_states[logits_indices]`): the rows it picks
    picked = torch.arange(runner.max_num_tokens)[logits] if isinstance(logits, slice) else None
    if spec is not ref_spec or picked is None or not torch.equal(picked,
                                                                 ref_logits.cpu().long()):
        stats["mismatches"].append(f"logits indices {logits} vs {ref_logits}")
    stats["fast"] += 1
    stats["batches"].add(n)
    stats["max_position"] = max(stats["max_position"], int(runner.positions[:n].max()))
    return logits, spec


runner._prepare_inputs = checked
stock_bookkeeping = runner._bookkeeping_sync


def bookkeeping_state():
    b = runner.input_batch
    return {"token_ids": b.token_ids_cpu.copy(), "is_token_ids": b.is_token_ids.copy(),
            "num_tokens_no_spec": b.num_tokens_no_spec.copy(),
            "outputs": {r: list(st.output_token_ids) for r, st in runner.requests.items()},
            "prev_sampled": b.prev_sampled_token_ids,
            "prev_index": dict(b.prev_req_id_to_index or {})}


def checked_bookkeeping(scheduler_output, sampler_output, logits, hidden_states, n_tokens):
    # vLLM's _bookkeeping_sync, then DecodeInputs.bookkeeping from the same state: the same
    # return value and the same runner state afterwards
    if not pure_decode(runner, scheduler_output):
        return stock_bookkeeping(scheduler_output, sampler_output, logits, hidden_states, n_tokens)
    b = runner.input_batch
    before = bookkeeping_state()
    ref = stock_bookkeeping(scheduler_output, sampler_output, logits, hidden_states, n_tokens)
    ref_state = bookkeeping_state()
    b.token_ids_cpu[:] = before["token_ids"]
    b.is_token_ids[:] = before["is_token_ids"]
    b.num_tokens_no_spec[:] = before["num_tokens_no_spec"]
    for r, ids in before["outputs"].items():
        runner.requests[r].output_token_ids[:] = ids
    b.prev_sampled_token_ids, b.prev_req_id_to_index = before["prev_sampled"], before["prev_index"]
    mine = fast.bookkeeping(runner, sampler_output)
    if mine is None:
        stats["bookkeeping_vllm"] += 1
        b.token_ids_cpu[:] = ref_state["token_ids"]  # vLLM's result stands
        b.is_token_ids[:] = ref_state["is_token_ids"]
        b.num_tokens_no_spec[:] = ref_state["num_tokens_no_spec"]
        for r, ids in ref_state["outputs"].items():
            runner.requests[r].output_token_ids[:] = ids
        b.prev_sampled_token_ids = ref_state["prev_sampled"]
        b.prev_req_id_to_index = ref_state["prev_index"]
        return ref
    stats["bookkeeping"] += 1
    mine_state = bookkeeping_state()
    if repr(mine) != repr(ref):
        stats["mismatches"].append(f"bookkeeping returned {mine!r} vs vLLM {ref!r}")
    for k, v in ref_state.items():
        w = mine_state[k]
        same = (v is w) if k == "prev_sampled" else (
            bool((v == w).all()) if hasattr(v, "shape") else v == w)
        if not same:
            stats["mismatches"].append(f"bookkeeping state {k} differs")
    stats["discarded_rows"] += len(ref[-1])
    return mine


runner._bookkeeping_sync = checked_bookkeeping
rng = np.random.default_rng(0)
vocab = 300
plan = [(int(rng.integers(2, 40)), int(rng.integers(4, 70))) for _ in range(14)]
step, nxt, done = 0, 0, 0
while nxt < len(plan) or engine.has_unfinished_requests():
    if nxt < len(plan) and step % 5 == 0:
        plen, gen = plan[nxt]
        ids = rng.integers(0, vocab, size=plen).tolist()
        engine.add_request(f"r{nxt}", TokensPrompt(prompt_token_ids=ids),
                           SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=gen))
        nxt += 1
    for out in engine.step():
        done += out.finished
    step += 1
stats["batches"] = sorted(stats["batches"])
stats["finished"] = done
print("RESULT " + json.dumps(stats))
"""


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_decode_inputs_match_vllm_prepare_inputs(cpu_vllm: str, scheduling: str) -> None:
    stats = run_result_script(PROBE, cpu_vllm, VLLM_ENABLE_V1_MULTIPROCESSING="0",
                              argv=[scheduling])
    assert stats["mismatches"] == [], stats["mismatches"][:10]
    assert stats["finished"] == 14, stats
    # both paths ran, over many batch sizes, past several 16-token KV blocks
    assert stats["fast"] >= 100 and stats["vllm_only"] >= 14, stats
    assert len(stats["batches"]) >= 4 and stats["max_position"] > 64, stats
    if scheduling == "async":
        # the tokens sampled last step come from the device, by both branches of the copy:
        # every row kept (one slice copy) and rows moved by a finish (a scatter). (A request
        # new to the batch arrives by a prefill step, so a pure-decode step never has one.)
        assert stats["async"] >= 100, stats
        assert min(stats["kept_rows"], stats["moved_rows"]) > 0, stats
        # the placeholder bookkeeping ran ours on every pure-decode step, compared with vLLM's
        assert stats["bookkeeping"] >= 100 and stats["bookkeeping_vllm"] == 0, stats
    else:
        assert stats["async"] == 0, stats
        assert stats["bookkeeping"] == 0 and stats["bookkeeping_vllm"] >= 100, stats


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_decode_inputs_match_vllm_prepare_inputs() -> None:
    """The same probe on the GPU build: vLLM's V1 runner with async scheduling, its real
    device buffers (pinned staging, non-blocking copies, the slot-mapping kernel)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_GRAPHS_")}
    env.update(MOE_GRAPHS_DISABLE="1", VLLM_USE_V2_MODEL_RUNNER="0",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    env.pop("TRITON_INTERPRET", None)
    here = os.path.dirname(os.path.abspath(__file__))  # tests/integration/runner
    repo = os.path.dirname(os.path.dirname(os.path.dirname(here)))
    proc = subprocess.run([sys.executable, "-c", PROBE, str(free_port()), "async", "gpu"],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    stats = json.loads(lines[-1].removeprefix("RESULT "))
    assert stats["mismatches"] == [], stats["mismatches"][:10]
    assert stats["finished"] == 14 and stats["fast"] >= 100 and stats["async"] >= 100, stats
    assert min(stats["kept_rows"], stats["moved_rows"]) > 0, stats
    assert stats["bookkeeping"] >= 100 and stats["bookkeeping_vllm"] == 0, stats


def test_bookkeeping_skips_discarded_rows_as_vllm_does():
    """The discarded-row branch of `DecodeInputs.bookkeeping` (a request whose sampled token is
    thrown away), which the engine probe's pure-decode steps never reach: the row gets no
    placeholder, keeps its count, leaves the next step's row map and is returned as invalid;
    its generator steps back 4 offsets, as in vLLM's `_bookkeeping_sync`."""
    import types

    import numpy as np

    from vllm_moe_graphs.integration.runner.decode_inputs import DecodeInputs

    class Gen:
        def __init__(self):
            self.offset = 12

        def get_offset(self):
            return self.offset

        def set_offset(self, v):
            self.offset = v

    n, ns = 3, types.SimpleNamespace
    gen = Gen()
    batch = ns(num_reqs=n, req_ids=["a", "b", "c"], req_id_to_index={"a": 0, "b": 1, "c": 2},
               generators={1: gen}, prev_sampled_token_ids=None, prev_req_id_to_index=None,
               token_ids_cpu=np.zeros((n, 8), dtype=np.int32),
               is_token_ids=np.zeros((n, 8), dtype=bool),
               num_tokens_no_spec=np.array([3, 5, 2], dtype=np.int32))
    runner = ns(input_batch=batch, use_async_scheduling=True, num_prompt_logprobs={},
                discard_request_mask=ns(np=np.array([False, True, False])),
                arange_np=np.arange(8), max_model_len=8,
                requests={r: ns(output_token_ids=[7]) for r in "abc"})
    sampled = torch.zeros(n, 1, dtype=torch.int32)
    fast = DecodeInputs.__new__(DecodeInputs)  # bookkeeping reads no staging row
    out = fast.bookkeeping(runner, ns(sampled_token_ids=sampled))
    assert out == ({}, None, [], {}, ["a", "b", "c"], {"a": 0, "b": 1, "c": 2}, [1])
    assert batch.prev_sampled_token_ids is sampled
    assert batch.prev_req_id_to_index == {"a": 0, "c": 2}
    assert batch.num_tokens_no_spec.tolist() == [4, 5, 3]
    assert batch.token_ids_cpu[0, 3] == -1 and batch.token_ids_cpu[2, 2] == -1
    assert batch.is_token_ids.sum() == 2 and not batch.is_token_ids[1].any()
    assert [runner.requests[r].output_token_ids for r in "abc"] == [[7, -1], [7], [7, -1]]
    assert gen.offset == 8
    # past max_model_len: vLLM's assertion
    batch.num_tokens_no_spec[:] = 8
    with pytest.raises(AssertionError, match="exceed the max model length"):
        fast.bookkeeping(runner, ns(sampled_token_ids=sampled))
    # synchronous scheduling is not this path: vLLM's own runs
    runner.use_async_scheduling = False
    assert fast.bookkeeping(runner, ns(sampled_token_ids=sampled)) is None
