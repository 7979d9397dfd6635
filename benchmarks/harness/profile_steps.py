"""Where a step's time goes: GPU kernels vs host work, one engine, one batch.

Used by the mode worker when `BENCH_PROFILE_DIR` is set (`benchmarks/gpu/run.sh` sets it with
`BENCH_PROFILE=1`): after the timed points, for each batch of the run and each sampling preset
of `--sampling` (a sampled step beside a greedy one) it

1. adds `batch` requests, steps the engine until every request decodes, then times
   `steps` decode-only steps with no profiler (the baseline wall time per step);
2. runs `steps` more under `torch.profiler` (CPU + CUDA): GPU kernel time per step (kernels
   replayed from CUDA graphs included), the top kernels, the top host ranges;
3. runs `steps` more under `cProfile`: the Python functions of this thread by own and
   cumulative time (the host side of a step: scheduler, runner, sampler, our hooks); the raw
   stats go to `<dir>/profile-<model>-<mode>-b<batch>[-<preset>].pstats` (callers and
   callees, offline; no preset for greedy);
4. runs `steps` more with a perf_counter wrapped around the engine's and runner's phase methods
   (`PHASES`): inclusive wall time per step of each, cheap enough to leave the step's shape
   intact, and the time the host spent blocked on the GPU (CUDA event waits).

and writes everything to `<dir>/profile-<model>-<mode>.txt`. The profilers slow the host down;
the GPU kernel times and the relative host breakdown are what to read, the baseline is the
comparable wall time.

The prefill profile (`BENCH_PROFILE_PREFILL`): `profile_prefill`.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks.harness.sampling import GREEDY

TOP_KERNELS = 25
TOP_HOST_RANGES = 30
TOP_FUNCTIONS = 45

# (owner, method) pairs timed by phase 4; owners: "engine" (LLMEngine), "core" (EngineCore),
# "scheduler", "executor", "runner" (the model runner, V1 or V2), "model" (the runner's model);
# a missing one is skipped.
PHASES = (
    ("engine", "step"),
    ("core", "step_with_batch_queue"),
    ("core", "step"),
    ("scheduler", "schedule"),
    ("scheduler", "update_from_output"),
    ("output_processor", "process_outputs"),
    ("executor", "execute_model"),
    ("executor", "sample_tokens"),
    ("runner", "execute_model"),
    ("runner", "sample_tokens"),
    ("runner", "_update_states"),
    ("runner", "_prepare_inputs"),
    ("runner", "_prepare_input_ids"),
    ("runner", "_determine_batch_execution_and_padding"),
    ("runner", "_get_slot_mappings"),
    ("runner", "_build_attention_metadata"),
    ("runner", "_preprocess"),
    ("runner", "_model_forward"),
    ("runner", "_sample"),
    ("runner", "_bookkeeping_sync"),
    ("runner", "update_requests"),
    ("runner", "prepare_inputs"),
    ("runner", "prepare_attn"),
    ("runner", "sample"),
    ("runner", "postprocess_sampled"),
    ("model", "compute_logits"),
)


class _Decoding:
    """`batch` requests kept in decode, sampling under preset `sampling`
    (`make_params(max_tokens, sampling, request index)`): `step()` returns True for a
    decode-only engine step."""

    def __init__(self, llm: Any, batch: int, context: int, max_tokens: int, vocab: int,
                 make_params: Callable[[int, str, int], Any],
                 make_prompt: Callable[[list[int]], Any], tag: str,
                 sampling: str = GREEDY) -> None:
        import random

        rng = random.Random(0)
        self.engine = llm.llm_engine
        prompts = [make_prompt([rng.randrange(vocab) for _ in range(context)])
                   for _ in range(batch)]
        self.ids = [f"{tag}-{i}" for i in range(batch)]
        for i, (rid, engine_input) in enumerate(zip(self.ids, llm._preprocess_cmpl(prompts))):
            self.engine.add_request(rid, engine_input, make_params(max_tokens, sampling, i))
        self.batch = batch
        self.counts = dict.fromkeys(self.ids, 0)

    def step(self) -> bool:
        outputs = self.engine.step()
        new = {}
        for out in outputs or ():
            new[out.request_id] = new.get(out.request_id, 0) + sum(
                len(c.token_ids) for c in out.outputs)
        ready = all(c >= 1 for c in self.counts.values())
        for rid, n in new.items():
            self.counts[rid] += n
        return ready and len(new) == self.batch and all(n == 1 for n in new.values())

    def until_decoding(self, limit: int = 10_000) -> None:
        for _ in range(limit):
            if self.step():
                return
        raise RuntimeError(f"batch {self.batch} never reached a decode-only step")

    def close(self) -> None:
        if self.engine.has_unfinished_requests():
            self.engine.abort_request(self.ids)


def _task_stats() -> dict[int, tuple[str, int, int]]:
    """tid -> (thread name, ns on a CPU, ns runnable but waiting for one), from /proc."""
    import os

    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run_ns, wait_ns = (int(x) for x in f.read().split()[:2])
        except (OSError, ValueError):
            continue
        out[int(tid)] = (name, run_ns, wait_ns)
    return out


def _thread_report(before: dict[int, tuple[str, int, int]],
                   after: dict[int, tuple[str, int, int]], steps: int) -> list[str]:
    """Per-thread CPU and run-queue wait per step over a window, busiest first."""
    import os
    import threading

    main = threading.main_thread().native_id
    rows = []
    for tid, (name, run, wait) in after.items():
        _, run0, wait0 = before.get(tid, (name, 0, 0))
        rows.append(((run - run0) / 1e3 / steps, (wait - wait0) / 1e3 / steps, tid, name))
    rows.sort(reverse=True)
    lines = [f"threads: {len(after)}, CPUs allowed {len(os.sched_getaffinity(0))}; "
             "busiest (us on CPU per step, us waiting for a CPU per step):"]
    for run, wait, tid, name in rows[:8]:
        lines.append(f"  {run:9.1f}  {wait:8.1f}  {name}{' (main)' if tid == main else ''}")
    return lines


def _python_speed_us() -> float:
    """A fixed pure-Python loop, best of 5 (us): the host's speed for interpreter work."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        acc = 0
        for i in range(100_000):
            acc += i & 7
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def _timed(d: _Decoding, steps: int) -> list[float]:
    out, last = [], time.perf_counter()
    for _ in range(steps):
        d.step()
        now = time.perf_counter()
        out.append((now - last) * 1e3)
        last = now
    return out


def _owners(llm: Any) -> dict[str, Any]:
    """The objects behind `PHASES` owners in an in-process engine (missing ones left out)."""
    engine = llm.llm_engine
    out: dict[str, Any] = {"engine": engine,
                           "output_processor": getattr(engine, "output_processor", None)}
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    out["core"] = core
    out["scheduler"] = getattr(core, "scheduler", None)
    executor = getattr(core, "model_executor", None)
    out["executor"] = executor
    worker = getattr(getattr(executor, "driver_worker", None), "worker", None)
    out["runner"] = runner = getattr(worker, "model_runner", None)
    out["model"] = getattr(runner, "model", None)
    return {k: v for k, v in out.items() if v is not None}


class _PhaseTimers:
    """perf_counter around `PHASES` (instance attributes, removed on exit) and around CUDA event
    waits (torch.cuda.Event.synchronize, class attribute, restored on exit)."""

    def __init__(self, llm: Any) -> None:
        self.owners = _owners(llm)
        self.totals: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo: list[Callable[[], None]] = []

    def _wrap(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        totals, calls, clock = self.totals, self.calls, time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[label] = totals.get(label, 0.0) + clock() - t0
                calls[label] = calls.get(label, 0) + 1
        return timed

    def __enter__(self) -> _PhaseTimers:
        import torch

        for owner, name in PHASES:
            obj = self.owners.get(owner)
            fn = getattr(obj, name, None) if obj is not None else None
            if fn is None or name in vars(obj):
                continue
            setattr(obj, name, self._wrap(fn, f"{owner}.{name}"))
            self._undo.append(lambda obj=obj, name=name: delattr(obj, name))
        sync = getattr(torch.cuda.Event, "synchronize", None)  # None: a CPU-only build
        if sync is not None:
            torch.cuda.Event.synchronize = self._wrap(sync, "cuda Event.synchronize (GPU wait)")
            self._undo.append(lambda: setattr(torch.cuda.Event, "synchronize", sync))
        return self

    def __exit__(self, *exc: Any) -> None:
        for undo in reversed(self._undo):
            undo()

    def report(self, steps: int) -> list[str]:
        lines = ["phase timers (inclusive us per step, calls per step):"]
        for label in sorted(self.totals, key=lambda k: -self.totals[k]):
            lines.append(f"  {self.totals[label] * 1e6 / steps:9.1f}  "
                         f"{self.calls[label] / steps:5.1f}  {label}")
        return lines


def kernel_lines(avgs: Any, wall_ms: float, n: int, unit: str) -> list[str]:
    """torch.profiler's GPU kernels over `n` steps or rounds taking `wall_ms` in all: the total
    per `unit` and the top kernels."""
    from torch.autograd import DeviceType

    kernels = [e for e in avgs if e.device_type == DeviceType.CUDA]
    gpu_us = sum(e.self_device_time_total for e in kernels)
    launches = sum(e.count for e in kernels)
    lines = [f"torch.profiler: wall {wall_ms / n:.3f} ms/{unit}, GPU kernels "
             f"{gpu_us / 1e3 / n:.3f} ms/{unit} ({launches / n:.0f} kernels/{unit}), "
             f"GPU busy {100 * gpu_us / 1e3 / max(wall_ms, 1e-9):.0f}%",
             f"top kernels (us per {unit}, count per {unit}):"]
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:TOP_KERNELS]:
        lines.append(f"  {e.self_device_time_total / n:9.1f}  {e.count / n:6.1f}  {e.key[:110]}")
    return lines


def profile_batch(llm: Any, batch: int, context: int, steps: int, vocab: int,
                  make_params: Callable[[int, str, int], Any],
                  make_prompt: Callable[[list[int]], Any], label: str,
                  pstats_path: str | None = None, sampling: str = GREEDY) -> str:
    """The report for one batch under sampling preset `sampling` (text)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    lines = [f"## {label} batch {batch} context {context} sampling {sampling}: {steps} steps "
             "per phase"]
    d = _Decoding(llm, batch, context, 4 * steps + 32, vocab, make_params, make_prompt,
                  f"prof-b{batch}-{sampling}", sampling)
    try:
        d.until_decoding()
        _timed(d, 8)  # past any lazy warm-up/capture of this bucket
        torch.cuda.synchronize()
        idle_py = _python_speed_us()
        before = _task_stats()
        base = _timed(d, steps)
        after = _task_stats()
        lines.append(f"baseline step ms: p50 {statistics.median(base):.3f}  mean "
                     f"{statistics.fmean(base):.3f}  min {min(base):.3f}")
        lines.append(f"python loop (idle engine): {idle_py:.0f} us")
        lines += _thread_report(before, after, steps)

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            _timed(d, steps)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
        avgs = prof.key_averages()
        lines += kernel_lines(avgs, wall, steps, "step")
        cpu = [e for e in avgs if e.device_type == DeviceType.CPU]
        lines.append("top host ranges/ops by CPU total (us per step, count per step):")
        for e in sorted(cpu, key=lambda e: -e.cpu_time_total)[:TOP_HOST_RANGES]:
            lines.append(f"  {e.cpu_time_total / steps:9.1f}  {e.count / steps:6.1f}  "
                         f"{e.key[:110]}")

        pr = cProfile.Profile()
        pr.enable()
        t0 = time.perf_counter()
        _timed(d, steps)
        wall = (time.perf_counter() - t0) * 1e3
        pr.disable()
        if pstats_path:
            pr.dump_stats(pstats_path)
        lines.append(f"cProfile: wall {wall / steps:.3f} ms/step (profiled thread only)")
        for order in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).strip_dirs().sort_stats(order).print_stats(
                TOP_FUNCTIONS)
            body = buf.getvalue()
            start = body.find("   ncalls")
            lines.append(f"-- by {order} (totals over {steps} steps)")
            lines.append(body[start:].rstrip() if start >= 0 else body.rstrip())

        with _PhaseTimers(llm) as timers:
            timed = _timed(d, steps)
        lines.append(f"phase-timed steps: p50 {statistics.median(timed):.3f} ms")
        lines += timers.report(steps)
    finally:
        d.close()
    return "\n".join(lines) + "\n"


def profile_run(llm: Any, spec: Any, make_params: Callable[[int, str, int], Any],
                make_prompt: Callable[[list[int]], Any], out_dir: str,
                steps: int = 30) -> str:
    """Profile every batch of `spec` at its first context under each of its sampling presets,
    a batch's presets back to back; returns the report's path."""
    import os

    path = os.path.join(out_dir, f"profile-{spec.model}-{spec.mode}.txt")
    context = spec.contexts[0]
    # Every phase needs live requests: 4 phases of `steps`, the warm-up and the async lag must
    # fit in max_model_len, or the last phases would time an idle engine.
    room = int(llm.llm_engine.model_config.max_model_len) - context - 40
    if room // 4 < steps:
        print(f"[bench] profile: max_model_len leaves room for {max(room // 4, 0)} steps per "
              f"phase, not {steps}: raise --decode-tokens for full phases", flush=True)
        steps = max(room // 4, 1)
    with open(path, "w") as f:
        for batch, sampling in ((b, s) for b in spec.batches for s in spec.sampling):
            suffix = "" if sampling == GREEDY else f"-{sampling}"
            try:
                text = profile_batch(
                    llm, batch, context, steps, spec.vocab_size, make_params, make_prompt,
                    f"{spec.model} {spec.mode}",
                    os.path.join(out_dir,
                                 f"profile-{spec.model}-{spec.mode}-b{batch}{suffix}.pstats"),
                    sampling)
            except Exception as exc:  # noqa: BLE001 - a report line, the run goes on
                text = (f"## batch {batch} sampling {sampling}: profiling failed: "
                        f"{type(exc).__name__}: {exc}\n")
            f.write(text)
            f.flush()
            print(f"[bench] profile {spec.model} {spec.mode} b={batch} {sampling}: written",
                  flush=True)
    return path
