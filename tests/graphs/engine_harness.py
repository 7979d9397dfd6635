"""The engine harness of the GPU end-to-end tests: one `vllm.LLM` per run, in its own interpreter.

`run_engine` starts the engine script (`ENGINE` of tests/graphs/engine_script.py, the plugin
loaded through its entry point, so it takes graphs over exactly as for an operator) on a JSON
spec: engine arguments, prompts and a list of phases (a batch size or staggered arrivals, the
kill file on or off, sleep/wake, a KV swap, sampling parameters), and returns every phase's
tokens and /metrics text. Parity is
measured *within one engine*: the same prompts with graphs, then with the kill file present
(every step eager at the key's padded size, graphs kept), and the tokens must be identical
(`check_parity`). `run_mixed` is the staggered traffic whose steps mostly carry prefill tokens.

Dummy weights are re-drawn after load (norm gains 1, matrices N(0, 1/fan_in); see
tests/attention/test_gpu_backend_e2e.py for why vLLM's dummy weights make flat logits, which
would make any comparison vacuous); the report checks the logits are not flat.
Set MOE_GRAPHS_TEST_OUT=/dir to get one JSON summary per test there (`report`).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time

from tests.gpu_util import engine_env, engine_memory_kwargs, engine_timeout_s, shape_dir
from tests.graphs.engine_script import ENGINE
from tests.serve_util import metric_sum
from vllm_moe_graphs.ops.sampling_plan import SamplingRefusal

NUM_LAYERS = 4
NUM_PROMPTS, MAX_TOKENS = 64, 256
PARITY_BATCHES = (1, 8, 32, 64)
ENGINE_TIMEOUT_S = engine_timeout_s(420)
WARMED_KERNELS = {"_paged_prefill_kernel", "_paged_decode_kernel", "_decode_reduce_kernel",
                  "_write_kv_kernel", "_small_m_gemm_kernel", "_small_m_reduce_kernel",
                  "_compute_slot_mapping_kernel",
                  "fused_moe_kernel"}


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (exposition text; 0 when
    there is none)."""
    return metric_sum(text, name, **labels) or 0.0


def cut_shape_dir(tmp_path, shape: str) -> tuple[str, int]:
    return shape_dir(tmp_path, shape, NUM_LAYERS)


def parity_prompts(vocab_size: int, n: int = NUM_PROMPTS) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(10, vocab_size - 10) for _ in range(8 + (i * 13) % 57)]
            for i in range(n)]


def engine_kwargs(model: str, **extra) -> dict:
    return {"model": model, "skip_tokenizer_init": True, "dtype": "bfloat16", "seed": 0,
            "max_model_len": 512, "max_num_seqs": 64, "enable_prefix_caching": False,
            **engine_memory_kwargs(0.5), **extra}


def run_engine(tmp_path, name: str, llm_kwargs: dict, prompts, phases, *, redraw=True,
               max_tokens=MAX_TOKENS, env_extra=None, **spec_extra) -> dict:
    out = tmp_path / f"{name}.json"
    spec = {"llm_kwargs": llm_kwargs, "prompts": prompts, "phases": phases, "redraw": redraw,
            "max_tokens": max_tokens, "out": str(out), **spec_extra}
    # engine in this interpreter: the capture-failure injection patches it, sleep/wake is local
    env = engine_env(MOE_GRAPHS_KILL_FILE=str(tmp_path / f"{name}.kill"), **(env_extra or {}))
    t0 = time.perf_counter()
    log = tmp_path / f"{name}.log"
    # NOTE: streamed to the file (not captured): a run cut short by a time guard leaves its log,
    # with one ENGINE_PHASE line per finished phase, for benchmarks/gpu/tests.sh to collect.
    with open(log, "w") as f:
        spec_file = tmp_path / f"{name}.spec.json"  # a file: long prompts exceed argv's limit
        spec_file.write_text(json.dumps(spec))
        proc = subprocess.run([sys.executable, "-c", ENGINE, str(spec_file)], env=env,
                              stdout=f, stderr=subprocess.STDOUT, text=True,
                              timeout=ENGINE_TIMEOUT_S)
    text = log.read_text()
    assert proc.returncode == 0 and out.exists(), (
        f"{name} engine failed (exit {proc.returncode}):\n{text[-8000:]}")
    result = json.loads(out.read_text())
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["log_lines"] = [ln for ln in text.splitlines() if "moe_graphs" in ln][:60]
    # vLLM's JIT monitor: a Triton kernel compiled while requests ran (after ready)
    result["jit_in_requests"] = re.findall(r"JIT compilation during inference: (\w+)", text)
    return result


def report(name: str, data: dict) -> None:
    print(json.dumps(data, indent=1, sort_keys=True, default=str)[:20000])
    if (d := os.environ.get("MOE_GRAPHS_TEST_OUT")):
        with open(os.path.join(d, f"{name}.json"), "w") as f:
            json.dump(data, f, indent=1, sort_keys=True, default=str)


def delta(phases: list[dict], i: int, name: str, **labels) -> float:
    before = metric(phases[i - 1]["metrics"], name, **labels) if i else 0.0
    return metric(phases[i]["metrics"], name, **labels) - before


def parity_phases(batches=PARITY_BATCHES) -> list[dict]:
    return [{"batch": b, "kill": k} for b in batches for k in (False, True)]


def check_parity(result: dict) -> dict:
    """Graph phase i*2 vs kill phase i*2+1: identical tokens; replays in the first, kill-switch
    fallbacks (and no replay) in the second. An unpaired last phase is left to the caller."""
    phases, rows = result["phases"], []
    for i in range(0, len(phases) - 1, 2):
        g, k = phases[i], phases[i + 1]
        same = sum(a == b for a, b in zip(g["tokens"], k["tokens"], strict=True))
        rows.append({
            "batch": g["batch"], "identical_sequences": same, "sequences": len(g["tokens"]),
            "tokens_per_sequence": len(g["tokens"][0]),
            "graph_s": g["seconds"], "eager_s": k["seconds"],
            "replays": delta(phases, i, "moe_graphs_replays_total"),
            "replays_while_killed": delta(phases, i + 1, "moe_graphs_replays_total"),
            "kill_switch_fallbacks": delta(phases, i + 1, "moe_graphs_eager_fallbacks_total",
                                            reason="kill_switch"),
            "mean_top1_logprob": round(g["mean_top1_logprob"], 3),
        })
    return {"rows": rows, "config": result["config"], "startup_s": result["startup_s"],
            "mode_graphs": metric(phases[-1]["metrics"], "moe_graphs_info", mode="graphs"),
            "captures": metric(phases[-1]["metrics"], "moe_graphs_captures_total"),
            "step_captures": metric(phases[-1]["metrics"], "moe_graphs_step_captures_total"),
            "pool_bytes": metric(phases[-1]["metrics"], "moe_graphs_pool_bytes"),
            "scratch_bytes": metric(phases[-1]["metrics"], "moe_graphs_scratch_bytes"),
            "graph_logits_handed_over": result.get("graph_logits_handed_over"),
            "lean_replay": result.get("lean_replay"),
            "jit_in_requests": result.get("jit_in_requests", []),
            "log_lines": result["log_lines"]}


def assert_parity(summary: dict) -> None:
    assert summary["mode_graphs"] == 1, summary["log_lines"]
    assert "MoeGraphsWorker" in summary["config"]["worker_cls"], summary["config"]
    # the default host shortcuts were live: decode steps took their logits from the graph's
    # LM head (logits_in_graph) and replays skipped the attention metadata
    assert summary["graph_logits_handed_over"] > 0 and summary["lean_replay"], summary
    # the start-up warm-up compiled every kernel it is there for: ours, the V1 runner's slot
    # mapping, vLLM's fused MoE (other vLLM kernels are reported, not asserted)
    late = [k for k in summary["jit_in_requests"] if k in WARMED_KERNELS]
    assert not late, f"compiled while serving, after the warm-up: {late}"
    for row in summary["rows"]:
        assert row["identical_sequences"] == row["sequences"], row
        assert row["replays"] > 0 and row["replays_while_killed"] == 0, row
        assert row["kill_switch_fallbacks"] > 0, row
        assert row["mean_top1_logprob"] > -10.5, f"flat logits: comparison vacuous ({row})"


def mixed_prompts(vocab: int, scale: float = 1.0) -> list[list[int]]:
    """64 prompts: 56 of 64-1000 tokens, each behind one of four shared prefixes of 48-160
    tokens (prefix-cache hits), and 8 of 4096-4500 tokens (chunked prefill over many steps),
    shuffled; every length times `scale` (a model with a short context), a prefix at least one
    16-token KV block long."""
    rng = random.Random(1)
    tok = lambda n: [rng.randrange(10, vocab - 10) for _ in range(n)]  # noqa: E731
    prefixes = [tok(max(16, int(rng.randrange(48, 160) * scale))) for _ in range(4)]
    prompts = [prefixes[i % 4] + tok(int(rng.randrange(16, 840) * scale)) for i in range(56)]
    prompts += [tok(int(rng.randrange(4096, 4500) * scale)) for _ in range(8)]
    rng.shuffle(prompts)
    return prompts


# The tiny checkpoint's staggered mixed workload (`run_mixed`): sized so that most of its steps
# carry prefill tokens with 16-token KV blocks (checked on the CPU build by
# tests/graphs/test_mixed_workload_schedule.py).
TINY_MIXED = {"max_positions": 1280, "scale": 0.2, "max_num_batched_tokens": 48,
              "max_num_seqs": 48, "arrive_every": 1}

# The mixed-faults engine's settings: a 1 MiB pool budget, which the first capture overruns, and
# two warm-up steps per key, with which the first key of `run_mixed`'s Qwen3-0.6B traffic to
# reach its capture is one with prefill tokens (checked on vLLM's CPU build by
# tests/graphs/test_mixed_workload_schedule.py).
MIXED_FAULTS_PLUGIN = {"graph_memory_budget_mib": 1, "warmup_steps": 2}


def run_mixed(tmp_path, shape: str, name: str, plugin: dict, graph_phase: dict | None = None,
              max_tokens: int = 256, llm_extra: dict | None = None, env_extra=None,
              checkpoint: tuple[str, int] | None = None, **spec_extra) -> dict:
    """Staggered arrivals (one request every 4 engine steps) of `mixed_prompts`, `max_tokens`
    greedy tokens each, a 256-token step budget: first with graphs, then with the kill switch,
    each phase from an empty prefix cache so both schedule the same steps. `shape` "tiny": the
    tiny real checkpoint with 1280 positions (`TINY_MIXED`): prompts scaled to 1/5 (the long
    ones 819-900 tokens), a 48-token step budget and 48 sequences so they still chunk, one
    arrival every step. `llm_extra`: more engine arguments; with `sampling_features` in the
    spec, the summary's `details` are each phase's per-request results, with `record_schedule`
    its `schedules` each phase's scheduled steps ([tokens, requests] each). `checkpoint`:
    (path, vocab size) of a checkpoint of `shape` to load instead of its re-drawn dummy
    weights."""
    cfg = {"enable_prefix_caching": True, "enable_chunked_prefill": True,
           "additional_config": {"moe_graphs": {"mixed_graphs": True, **plugin}}}
    if shape == "tiny":
        from tests.tiny_models import build_checkpoint

        w = TINY_MIXED
        model = build_checkpoint(str(tmp_path / "tiny-qwen3"), head_dim=64,
                                 max_positions=w["max_positions"])
        vocab = json.loads((tmp_path / "tiny-qwen3" / "config.json").read_text())["vocab_size"]
        kwargs = engine_kwargs(model, max_model_len=w["max_positions"],
                             max_num_batched_tokens=w["max_num_batched_tokens"],
                             max_num_seqs=w["max_num_seqs"], **cfg)
        prompts, redraw = mixed_prompts(vocab, scale=w["scale"]), False
        every = w["arrive_every"]
    else:
        model, vocab = checkpoint or cut_shape_dir(tmp_path, shape)
        kwargs = engine_kwargs(model, max_model_len=4864, max_num_batched_tokens=256, **cfg,
                               **({} if checkpoint else {"load_format": "dummy"}))
        prompts, redraw, every = mixed_prompts(vocab), checkpoint is None, 4
    phases = [{"batch": 64, "kill": k, "arrive_every": every, "reset_prefix_cache": True}
              for k in (False, True)]
    phases[0].update(graph_phase or {})
    kwargs.update(llm_extra or {})
    result = run_engine(tmp_path, name, kwargs, prompts, phases, max_tokens=max_tokens,
                        redraw=redraw, env_extra=env_extra, **spec_extra)
    summary = check_parity(result)
    if spec_extra.get("sampling_features"):
        summary["details"] = [ph["detail"] for ph in result["phases"]]
    if spec_extra.get("record_schedule"):
        summary["schedules"] = [ph["schedule"] for ph in result["phases"]]
    summary["graph_keys"] = result["graph_keys"]
    summary["mixed_keys"] = [k for k in result["graph_keys"] if k[2] > 0]
    g = result["phases"][0]
    summary["replays_by_kind"] = {
        kind: metric(g["metrics"], "moe_graphs_replays_total", kind=kind)
        for kind in ("decode", "mixed", "prefill")}
    # the kill phase runs every step eager under the kill switch: its steps by kind
    summary["steps_by_kind"] = {
        kind: delta(result["phases"], 1, "moe_graphs_eager_fallbacks_total", kind=kind)
        for kind in ("decode", "mixed", "prefill")}
    for reason in ("mixed_batch", "step_too_large", "cascade_attention", "kill_switch",
                   "capture_failed", "memory_budget"):
        summary[f"{reason}_fallbacks"] = metric(g["metrics"], "moe_graphs_eager_fallbacks_total",
                                                reason=reason)
    summary["capture_failures"] = metric(g["metrics"], "moe_graphs_capture_failures_total")
    # sample_in_graph: steps a sampler graph drew, and vLLM's sampler's steps by reason
    summary["sampled_in_graph"] = metric(g["metrics"], "moe_graphs_sampled_in_graph_total")
    summary["sampler_fallbacks"] = {
        reason.value: n for reason in SamplingRefusal
        if (n := metric(g["metrics"], "moe_graphs_sampler_fallbacks_total", reason=reason.value))}
    summary["sampling_inexact_rows"] = metric(g["metrics"],
                                              "moe_graphs_sampling_inexact_rows_total")
    summary["startup_captures"] = metric(result["startup_metrics"], "moe_graphs_captures_total")
    return summary
