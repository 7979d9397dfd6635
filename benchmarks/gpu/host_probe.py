"""Why is a process with the plugin loaded slower on the host?  (diagnostic, GPU machine)

    python3 benchmarks/gpu/host_probe.py            # orchestrates the variants below
    python3 benchmarks/gpu/host_probe.py VARIANT    # one variant, in this process
    python3 benchmarks/gpu/host_probe.py --fastest N   # the N fastest CPUs, e.g. "2,3,8,9"

Each variant starts one in-process engine (Qwen3-0.6B shape, dummy weights, FULL decode graphs
or the plugin's) and prints, at each stage (fresh, vLLM imported, engine ready, after decoding):
a pure-Python loop's speed on whatever CPU the thread is on and pinned to CPU 0, the CPU the
main thread is on, profile/trace/monitoring hooks, the dynamo frame callback, threads, and
the environment keys that changed. Then decode TPOT at batch 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

SHAPE = os.path.join(os.path.dirname(__file__), "..", "..", "vllm_moe_graphs", "model_configs",
                     "qwen3-0.6b")
COMMON = dict(load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024,
              max_num_seqs=8, enable_prefix_caching=False, gpu_memory_utilization=0.5, seed=0)
FULL_NC = {"mode": "NONE", "cudagraph_mode": "FULL_DECODE_ONLY"}
VARIANTS = {
    # name: (env, extra LLM kwargs)
    "stock_v1": ({"VLLM_PLUGINS": "", "VLLM_USE_V2_MODEL_RUNNER": "0"},
                 {"attention_config": {"backend": "TRITON_ATTN"}, "compilation_config": FULL_NC}),
    "plugin_loaded_stock_v1": ({"VLLM_USE_V2_MODEL_RUNNER": "0"},
                               {"attention_config": {"backend": "TRITON_ATTN"},
                                "compilation_config": FULL_NC}),
    "plugin_disabled_env": ({"MOE_GRAPHS_DISABLE": "1", "VLLM_USE_V2_MODEL_RUNNER": "0"},
                            {"attention_config": {"backend": "TRITON_ATTN"},
                             "compilation_config": FULL_NC}),
    "plugin_backend_v1": ({"VLLM_USE_V2_MODEL_RUNNER": "0"},
                          {"attention_config": {"backend": "CUSTOM"},
                           "additional_config": {"moe_graphs": {"enabled": False}},
                           "compilation_config": FULL_NC}),
    "plugin_graphs": ({}, {"attention_config": {"backend": "CUSTOM"},
                           "additional_config": {"moe_graphs": {}}}),
}


def loop_us(reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        acc = 0
        for i in range(100_000):
            acc += i & 7
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e6)


def on_cpu() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


def pinned_loop_us(cpu: int = 0) -> float:
    allowed = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {cpu})
        return loop_us()
    finally:
        os.sched_setaffinity(0, allowed)


def hooks() -> dict:
    out = {"profile": repr(sys.getprofile()), "trace": repr(sys.gettrace())}
    mon = getattr(sys, "monitoring", None)
    if mon is not None:
        out["monitoring"] = {i: mon.get_tool(i) for i in range(6) if mon.get_tool(i)}
    try:
        import torch._C._dynamo.eval_frame as ef  # noqa: PLC0415

        out["dynamo_callback"] = repr(ef.get_eval_frame_callback())
    except Exception as exc:  # noqa: BLE001
        out["dynamo_callback"] = f"? {type(exc).__name__}"
    import threading

    out["threads"] = len(threading.enumerate())
    import gc

    out["gc"] = [gc.get_count(), gc.get_threshold(), gc.isenabled(), gc.get_freeze_count()]
    out["switchinterval"] = sys.getswitchinterval()
    return out


def stage(name: str, env0: dict) -> None:
    changed = sorted(k for k in set(os.environ) | set(env0)
                     if os.environ.get(k) != env0.get(k))
    line = {"stage": name, "loop_us": loop_us(), "loop_us_cpu0": pinned_loop_us(0),
            "cpu": on_cpu(), "env_changed": changed, **hooks()}
    print("PROBE " + json.dumps(line), flush=True)


def one(variant: str) -> None:
    env0 = dict(os.environ)
    stage("fresh", env0)
    import vllm  # noqa: F401

    stage("vllm imported", env0)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    _, kwargs = VARIANTS[variant]
    llm = LLM(model=os.path.abspath(SHAPE), **COMMON, **kwargs)
    stage("engine ready", env0)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=200, detokenize=False)
    for rep in range(2):
        prompt = llm._preprocess_cmpl([TokensPrompt(prompt_token_ids=list(range(512)))])[0]
        engine.add_request(f"r{rep}", prompt, params)
        times = []
        while engine.has_unfinished_requests():
            engine.step()
            times.append(time.perf_counter())
        gaps = sorted((b - a) * 1e3 for a, b in zip(times[20:], times[21:]))
        print(f"PROBE {variant} rep {rep}: TPOT p50 {gaps[len(gaps) // 2]:.3f} ms "
              f"({len(gaps)} steps)", flush=True)
    stage("after decoding", env0)


def fastest_cpus(n: int, rounds: int = 3) -> list[int]:
    """The `n` CPUs whose slowest of `rounds` pure-Python loop timings is lowest (this VM's
    vCPUs differ by up to 2x, and the slow ones move over time)."""
    worst: dict[int, float] = {}
    for _ in range(rounds):
        for cpu in sorted(os.sched_getaffinity(0)):
            worst[cpu] = max(worst.get(cpu, 0.0), pinned_loop_us(cpu))
    ranked = sorted(worst, key=worst.get)
    print("per-CPU slowest loop us: " + json.dumps({c: worst[c] for c in sorted(worst)}),
          file=sys.stderr, flush=True)
    return sorted(ranked[:n])


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--fastest":
        print(",".join(str(c) for c in fastest_cpus(int(sys.argv[2]))))
        return 0
    if len(sys.argv) > 1:
        one(sys.argv[1])
        return 0
    per_cpu = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        per_cpu[cpu] = pinned_loop_us(cpu)
    print("PROBE per-CPU loop us: " + json.dumps(per_cpu), flush=True)
    for variant, (env, _) in VARIANTS.items():
        t0 = time.time()
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env}
        proc = subprocess.run([sys.executable, __file__, variant], env=env,
                              capture_output=True, text=True, timeout=240)
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines()
                 if ln.startswith("PROBE") or "Error" in ln or "moe_graphs" in ln]
        print(f"== {variant} (exit {proc.returncode}, {time.time() - t0:.0f} s)")
        print("\n".join(lines[-40:]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
