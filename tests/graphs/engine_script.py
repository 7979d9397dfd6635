"""The script of the GPU end-to-end tests' engines (`ENGINE`), run by tests/graphs/engine_harness.py
in a fresh interpreter per engine: `vllm.LLM` with the plugin loaded through its entry point, a
JSON spec in, every phase's tokens and /metrics text out. `FAIL_FIRST_MIXED_CAPTURE`, its first
part, is also a test server's sitecustomize."""

from __future__ import annotations

# With MOE_GRAPHS_TEST_FAIL_MIXED_CAPTURE=1 in its environment, a process fails the first
# capture of a key with prefill tokens: a host sync inside the region invalidates it, as
# `fail_capture_bucket` does by row count. Run by the test engine below, and by every Python
# process of a test server as its sitecustomize.
FAIL_FIRST_MIXED_CAPTURE = r"""
import os

if os.environ.get("MOE_GRAPHS_TEST_FAIL_MIXED_CAPTURE") == "1":
    import torch
    from vllm_moe_graphs.graphs.runner import DecodeGraphRunner

    _real_capture, _failed = DecodeGraphRunner._capture, []

    def _failing_capture(self, key, forward, *args, **kwargs):
        if key.decode or _failed:
            return _real_capture(self, key, forward, *args, **kwargs)
        _failed.append(key)

        def syncing(batch):
            y = forward(batch)
            torch.cuda.synchronize()
            return y

        return _real_capture(self, key, syncing, *args, **kwargs)

    DecodeGraphRunner._capture = _failing_capture
"""

# Runs in a fresh interpreter: argv[1] is a JSON spec file; the result goes to spec["out"].
ENGINE = FAIL_FIRST_MIXED_CAPTURE + r"""
import json, os, sys, time
spec = json.load(open(sys.argv[1]))
import torch

if spec.get("fail_capture_bucket"):
    import vllm_moe_graphs.graphs.runner as runner_mod
    real_capture = runner_mod.cuda_capture

    def failing_capture(fn, pool, before_capture, **kwargs):
        out = fn()  # a forward outside the capture; rows = the bucket being captured
        if out.shape[0] != spec["fail_capture_bucket"]:
            return real_capture(fn, pool, before_capture, **kwargs)

        def syncing():  # a host sync inside the region: CUDA invalidates the capture
            y = fn()
            torch.cuda.synchronize()
            return y

        return real_capture(syncing, pool, before_capture, **kwargs)

    runner_mod.cuda_capture = failing_capture

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm_moe_graphs.metrics_transport import collect_text
from tests.gpu_util import engine_starting, redraw_weights, sleep_or_wake


def kill(on):
    path = os.environ["MOE_GRAPHS_KILL_FILE"]
    if on:
        open(path, "w").close()
    elif os.path.exists(path):
        os.remove(path)
    time.sleep(0.3)  # the switch is re-read at most every 100 ms


kwargs = spec["llm_kwargs"]
if "cpu_offload_params" in kwargs:  # a set in EngineArgs; JSON carries a list
    kwargs = {**kwargs, "cpu_offload_params": set(kwargs["cpu_offload_params"])}
t0 = time.perf_counter()
with engine_starting():
    llm = LLM(**kwargs)
result = {"startup_s": round(time.perf_counter() - t0, 1), "phases": [],
          "startup_metrics": collect_text()}
cfg = llm.llm_engine.vllm_config
result["config"] = {"worker_cls": cfg.parallel_config.worker_cls,
                    "cudagraph_mode": str(cfg.compilation_config.cudagraph_mode),
                    "compilation_mode": str(cfg.compilation_config.mode),
                    "attention_backend": str(cfg.attention_config.backend),
                    "quantization": cfg.model_config.quantization}
from vllm_moe_graphs.config import PluginConfig
from vllm_moe_graphs.integration.config_facts import facts_from_vllm_config
# the offload mode the plugin's capability check saw ("none", "uva", ...)
result["config"]["offload"] = facts_from_vllm_config(
    cfg, PluginConfig.from_additional_config(cfg.additional_config)).offload


def uva_offloaded(model):
    # parameters vLLM's UVA offloader moved to pinned host memory (device views of it)
    params = [(n, p) for n, p in model.named_parameters()
              if getattr(p, "_vllm_is_uva_offloaded", False)]
    return {"params": len(params), "bytes": sum(p.numel() * p.element_size() for _, p in params),
            "names": sorted({n.split(".")[-1] for n, _ in params})}


result["uva_offloaded"] = llm.apply_model(uva_offloaded)[0]
if spec.get("redraw"):
    llm.apply_model(redraw_weights)
params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True,
                        logprobs=1, detokenize=False)
prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
SCHEDULE = []  # this phase's scheduled steps, [tokens, requests] each (spec "record_schedule")
if spec.get("record_schedule"):
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    _schedule = scheduler.schedule

    def recording_schedule(*args, **kwargs):
        out = _schedule(*args, **kwargs)
        if out.total_num_scheduled_tokens:
            SCHEDULE.append([out.total_num_scheduled_tokens, len(out.num_scheduled_tokens)])
        return out

    scheduler.schedule = recording_schedule
FEATURES = spec.get("sampling_features")
if FEATURES:
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    # grammars compiled inside add_request, not on vLLM's thread pool: a request then waits for
    # its grammar the same steps in every phase, so every phase schedules the same steps
    llm.llm_engine.engine_core.engine_core.scheduler.structured_output_manager \
        ._use_async_grammar_compilation = False
    tokenizer = llm.get_tokenizer()


def request_params(i, base):
    # request i's sampling parameters: `base`, or entry i % len of spec["sampling_features"]
    # (SamplingParams keywords over greedy, 1 logprob, ignore_eos; `structured_outputs` a dict)
    if not FEATURES:
        return base
    # FINAL_ONLY: a request's one output holds all its completions (n > 1), as in generate()
    kw = {"max_tokens": spec["max_tokens"], "temperature": 0.0, "ignore_eos": True,
          "logprobs": 1, "detokenize": False, "output_kind": RequestOutputKind.FINAL_ONLY,
          **FEATURES[i % len(FEATURES)]}
    if "structured_outputs" in kw:
        kw["structured_outputs"] = StructuredOutputsParams(**kw["structured_outputs"])
    if "logit_bias" in kw:  # token ids: JSON keys are strings
        kw["logit_bias"] = {int(t): bias for t, bias in kw["logit_bias"].items()}
    return SamplingParams(**kw)


def detail(out):
    # what a request's sampling produced: every completion's tokens, their logprobs and text,
    # and the prompt logprobs (None where not asked for)
    prompt = out.prompt_logprobs
    return {"prompt_len": len(out.prompt_token_ids),
            "completions": [{"tokens": list(c.token_ids),
                             "logprobs": [pos[t].logprob for pos, t in zip(c.logprobs or [],
                                                                           c.token_ids)],
                             "text": tokenizer.decode(c.token_ids, skip_special_tokens=True)}
                            for c in out.outputs],
            "prompt_logprobs": None if prompt is None else [
                None if pos is None else {str(t): lp.logprob for t, lp in pos.items()}
                for pos in prompt]}


def swap_first_kv(model):
    # Rebind one attention layer's KV tensor behind the plugin's back (same contents, new
    # address): a graph captured before must never be replayed against the old one.
    for m in model.modules():
        if hasattr(m, "impl") and isinstance(getattr(m, "kv_cache", None), torch.Tensor):
            old = m.kv_cache
            m.kv_cache = old.clone()
            return [old.data_ptr(), m.kv_cache.data_ptr()]
    return None


def metadata_copies():
    # Back to the builders' own buffers (per-step copies) instead of reading vLLM's in place,
    # and to vLLM's _prepare_inputs instead of the plugin's DecodeInputs.
    from vllm_moe_graphs.integration.attention.metadata import MoeGraphsMetadataBuilder
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker \
        .model_runner
    builders = [g.get_metadata_builder() for groups in runner.attn_groups for g in groups]
    reset = [b for b in builders
             if isinstance(b, MoeGraphsMetadataBuilder) and b._in_place is not None]
    for b in reset:
        b._in_place = None
    fast_steps = runner.moe_graphs.inputs.steps if runner.moe_graphs.inputs is not None else 0
    runner.moe_graphs.inputs = None
    return {"in_place_builders_reset": len(reset), "fast_input_steps_before": fast_steps}


def staggered(prompts, step_params, every, toggle_kill=0):
    # One request arrives every `every` engine steps (a schedule in steps, not seconds, so
    # every phase sees the same steps), the engine stepping in between: prefill chunks of
    # new arrivals share steps with earlier requests' decode rows. `toggle_kill`: the kill
    # file is created or removed every that many steps. Outputs in prompt order.
    engine, done, step, sent, killed = llm.llm_engine, {}, 0, 0, False
    while sent < len(prompts) or engine.has_unfinished_requests():
        if toggle_kill and step and step % toggle_kill == 0:
            killed = not killed
            kill(killed)
        if sent < len(prompts) and step % every == 0:
            engine.add_request(str(sent), prompts[sent], request_params(sent, step_params))
            sent += 1
        for out in engine.step():
            if out.finished:
                done[int(out.request_id.split("-")[0])] = out  # vLLM may suffix the id
        step += 1
    return [done[i] for i in range(len(prompts))]


for phase in spec["phases"]:
    if phase.get("metadata_copies"):
        phase = {**phase, **metadata_copies()}
    if phase.get("sleep"):
        with sleep_or_wake():
            llm.sleep(level=1)
            llm.wake_up()
    if phase.get("swap_kv"):
        phase = {**phase, "swapped_ptrs": llm.apply_model(swap_first_kv)[0]}
    kill(phase["kill"])
    b = phase["batch"]
    SCHEDULE.clear()
    t1 = time.perf_counter()
    tokens, top1 = [], []
    # "temperature": random sampling from vLLM's default CUDA generator (not comparable)
    step_params = params if "temperature" not in phase else SamplingParams(
        max_tokens=spec["max_tokens"], temperature=phase["temperature"], ignore_eos=True,
        logprobs=1, detokenize=False)
    if phase.get("reset_prefix_cache"):
        assert llm.reset_prefix_cache(), "prefix cache not reset"
    if phase.get("arrive_every"):
        outs = staggered(prompts, step_params, phase["arrive_every"],
                         phase.get("toggle_kill_every", 0))
    else:
        outs = [o for i in range(0, len(prompts), b)
                for o in llm.generate(prompts[i:i + b],
                                      [request_params(j, step_params)
                                       for j in range(i, min(i + b, len(prompts)))],
                                      use_tqdm=False)]
    for out in outs:
        c = out.outputs[0]
        tokens.append(list(c.token_ids))
        top1.extend(max(lp.logprob for lp in pos.values()) for pos in c.logprobs or [])
    kill(False)
    seconds = round(time.perf_counter() - t1, 2)
    print("ENGINE_PHASE", json.dumps({k: v for k, v in phase.items() if k != "tokens"}),
          f"{seconds} s", flush=True)
    result["phases"].append({**phase, "tokens": tokens, "seconds": seconds,
                             "mean_top1_logprob": sum(top1) / max(1, len(top1)),
                             "metrics": collect_text()})
    if FEATURES:
        result["phases"][-1]["detail"] = [detail(out) for out in outs]
    if spec.get("record_schedule"):
        result["phases"][-1]["schedule"] = list(SCHEDULE)
runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
plugin = getattr(runner, "moe_graphs", None)  # None: stock runner
logits = plugin.logits if plugin is not None else None  # None: vLLM computes them
graphs = plugin.graphs if plugin is not None else None
result["graph_keys"] = [[k.batch_bucket, k.context_bucket, k.request_bucket]
                        for k in graphs.keys] if graphs is not None else []
result["graph_logits_handed_over"] = logits.handed_over if logits is not None else 0
result["lean_replay"] = bool(plugin is not None and plugin.lean_replay)
with open(spec["out"], "w") as f:
    json.dump(result, f)
print("ENGINE_DONE", result["config"], flush=True)
"""
