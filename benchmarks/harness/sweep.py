"""The sweep behind `benchmarks.decode`: plan the workers, run them one by one (or all up at once,
taking turns: `--interleave`) within the time budget. Each worker is a child process
(`worker_process`); the machine and the environment record: `machine`. No torch, no vLLM here:
those live in the worker processes.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.modes import MODES, Family, Mode, common_llm_kwargs, parse_modes
from benchmarks.harness.protocol import READY, SLACK_STEPS, WorkerResult, WorkerSpec
from benchmarks.harness.sampling import GREEDY, parse_presets
from benchmarks.harness.shapes import ModelShape, prepare_config_dir, read_config, \
    resident_weight_bytes, shape
from benchmarks.harness.worker_process import EXITED, KILL_GRACE_S, WorkerProcess, run_worker, \
    stop_group

RESERVE_S = 15.0  # kept back from --time-budget-s for writing the JSON, plot and table
MIN_MEASURE_S = 10.0  # a mode starts only if its start-up estimate plus this fits the budget


def max_model_len(contexts: list[int], batches: list[int], decode: int, warmup: int) -> int:
    """Longest prompt + timed and warm-up steps + the decode tokens early requests get while the
    batch is still prefilling (chunks of >= 8192 tokens) + margin, rounded up to 16."""
    prefill_steps = math.ceil(max(batches) * max(contexts) / 8192) + 1
    need = max(contexts) + warmup + decode + prefill_steps + SLACK_STEPS + 16
    return -(-need // 16) * 16


INTERLEAVE_GPU_MEMORY_UTILIZATION = 0.05  # only vLLM's start-up check reads it then
KV_HEADROOM = 1.25  # block rounding and the async-scheduling slack
INTERLEAVE_ENGINE_SLACK = 3 * 2**30  # an engine's CUDA context, activations and graph pool


def interleave_overflow(model: str, shape: ModelShape, kv_bytes: int, engines: int,
                        gpu_bytes: int) -> str | None:
    """Why `engines` engines of `model`, all up at once under `--interleave`, cannot fit a GPU
    of `gpu_bytes`, or None."""
    weights = resident_weight_bytes(shape)
    each = weights + kv_bytes + INTERLEAVE_ENGINE_SLACK
    fit = int(gpu_bytes // each)
    if engines <= fit:
        return None
    gib = 2**30
    return (f"--interleave keeps {engines} engines of {model} up at once, each about "
            f"{each / gib:.1f} GiB (weights {weights / gib:.1f}, KV {kv_bytes / gib:.1f}, "
            f"slack {INTERLEAVE_ENGINE_SLACK / gib:.0f}): {engines * each / gib:.0f} GiB, and "
            f"this GPU has {gpu_bytes / gib:.0f} GiB. Pass at most {fit} mode(s) per run "
            f"(several runs), or cut the model with --num-layers")



def interleave_kv_bytes(shape: ModelShape, max_batch: int, max_len: int) -> int:
    """KV cache bytes for `max_batch` sequences of `max_len` tokens, with headroom, rounded up
    to 256 MiB."""
    need = shape.kv_bytes_per_token() * max_batch * max_len * KV_HEADROOM
    step = 256 * 2**20
    return int(-(-need // step) * step)


def plan(
    args: argparse.Namespace, work_dir: Path
) -> tuple[list[WorkerSpec], dict[str, str], dict[str, int], dict[str, ModelShape]]:
    modes = parse_modes(args.modes)
    absent = {m.name: m.available().text() for m in modes if not m.available().ok}
    runnable: list[Mode] = [m for m in modes if m.name not in absent]
    specs, layers, shapes, configs = [], {}, {}, {}
    mml = max_model_len(args.contexts, args.batches, args.decode_tokens, args.warmup_steps)
    for model in args.models:
        config_dir, layers[model] = prepare_config_dir(model, args.num_layers, work_dir)
        cfg = read_config(config_dir)
        shapes[model] = ModelShape.from_config(cfg, fp8_kv=shape(model).fp8_kv)
        configs[model] = (config_dir, cfg)
    interleave = getattr(args, "interleave", False)
    sampling = parse_presets(getattr(args, "sampling", [GREEDY]))
    for rnd in range(args.rounds):
        # Odd rounds run the modes in reverse order, so that no mode always goes first (cold
        # machine) or last; every round starts fresh engines, so each mode samples the host at
        # several moments (this VM's vCPU speed shifts over tens of seconds).
        for model in args.models:
            config_dir, cfg = configs[model]
            common = common_llm_kwargs(
                config_dir=str(config_dir),
                max_num_seqs=max(args.batches),
                max_model_len=mml,
                seed=args.seed,
                gpu_memory_utilization=args.gpu_memory_utilization,
            )
            common.update(shape(model).llm_kwargs)  # every mode on the shape's flags
            if interleave:
                # Every mode's engine stays up at once: a fixed KV cache each, sized for the
                # plan, instead of a share of the GPU (vLLM's profiling accounting assumes no
                # other process on the GPU; with kv_cache_memory_bytes it is skipped).
                common.update(gpu_memory_utilization=INTERLEAVE_GPU_MEMORY_UTILIZATION,
                              kv_cache_memory_bytes=interleave_kv_bytes(
                                  shapes[model], max(args.batches), mml))
            suffix = f"-r{rnd}" if rnd else ""
            for mode in runnable if rnd % 2 == 0 else runnable[::-1]:
                specs.append(
                    WorkerSpec(
                        model=model,
                        config_dir=str(config_dir),
                        mode=mode.name,
                        llm_kwargs=mode.llm_kwargs(common),
                        env={**mode.worker_env(),
                             **shape(model).plugin_env(mode.family is Family.PLUGIN)},
                        batches=args.batches,
                        contexts=args.contexts,
                        repeats=args.repeats,
                        decode_tokens=args.decode_tokens,
                        warmup_steps=args.warmup_steps,
                        vocab_size=int(cfg["vocab_size"]),
                        seed=args.seed,
                        result_path=str(work_dir / f"result-{model}-{mode.name}{suffix}.json"),
                        round=rnd,
                        interleaved=interleave,
                        sampling=sampling,
                    )
                )
    return specs, absent, layers, shapes



def deadlines(
    now: float, t_end: float, mode: Mode, later: list[Mode], presets: int = 1
) -> tuple[float, float, float] | str:
    """(hard, first_pass, soft) deadlines of a worker started `now`, or why it must not start.

    soft: its weighted share of what is left (start-up + measuring `presets` sampling presets,
    see Mode.budget_weight) ends repeats 2 and up; first_pass: repeat 1 may run until only the
    later modes' start-up estimates remain; hard: the run's end (the worker always tries one
    point before it)."""
    left = t_end - now
    if left < mode.startup_estimate_s + MIN_MEASURE_S:
        return (
            f"time budget: {left:.0f} s left < start-up estimate {mode.startup_estimate_s:.0f} s "
            f"+ {MIN_MEASURE_S:.0f} s"
        )
    weights = [m.budget_weight(presets) for m in [mode, *later]]
    soft = now + left * weights[0] / sum(weights)
    first_pass = max(soft, t_end - sum(m.startup_estimate_s for m in later))
    return t_end, first_pass, soft


def execute(
    specs: list[WorkerSpec], work_dir: Path, t_end: float | None, mode_timeout_s: float
) -> tuple[list[WorkerResult], list[dict[str, Any]], list[dict[str, Any]]]:
    """Run every worker in order; returns (results, failures, skipped)."""
    results: list[WorkerResult] = []
    failures: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for i, spec in enumerate(specs):
        now = time.time()
        later = specs[i + 1 :]
        if t_end is not None:
            budget = deadlines(now, t_end, MODES[spec.mode], [MODES[s.mode] for s in later],
                               len(spec.sampling))
            if isinstance(budget, str):
                print(f"[decode] skip {spec.model} {spec.mode}: {budget}", flush=True)
                skipped.append(
                    {"model": spec.model, "mode": spec.mode, "points": "all", "reason": budget}
                )
                continue
            spec.hard_deadline, spec.first_pass_deadline, spec.soft_deadline = budget
        limit = mode_timeout_s if t_end is None else min(mode_timeout_s, t_end - now + KILL_GRACE_S)
        left_txt = "" if t_end is None else f", {t_end - now:.0f} s of budget left"
        rnd = f" round {spec.round + 1}" if spec.round else ""
        print(f"[decode] {i + 1}/{len(specs)} {spec.model} {spec.mode}{rnd}{left_txt}",
              flush=True)
        result, error = run_worker(spec, work_dir, limit)
        results.append(result)
        if error:
            failures.append(
                {
                    "model": spec.model,
                    "mode": spec.mode,
                    "error": error,
                    "log": str(work_dir / f"log-{spec.model}-{spec.mode}.txt"),
                }
            )
        for p in result.points:
            if p.error:
                failures.append(
                    {
                        "model": spec.model,
                        "mode": spec.mode,
                        "batch": p.batch,
                        "context": p.context,
                        "sampling": p.sampling,
                        "error": p.error,
                    }
                )
        skipped += [{"model": spec.model, "mode": spec.mode, **s} for s in result.skipped]
        print(
            f"[decode] {spec.model} {spec.mode}: {result.status}, "
            f"{sum(1 for p in result.points if p.repeats_done)} point(s) measured",
            flush=True,
        )
    return results, failures, skipped


def rotation(items: list[Any], k: int) -> list[Any]:
    """`items` rotated left by k: pass k of an interleaved run starts with a different mode."""
    if not items:
        return []
    k %= len(items)
    return items[k:] + items[:k]


def _measure_in_turns(workers: list[WorkerProcess], specs: list[WorkerSpec],
                      t_end: float | None, cut: dict[tuple[str, int, int, str], int]) -> None:
    """The measuring passes of `execute_interleaved`: a warm-up pass, then the repeats; within a
    pass point by point (each under every sampling preset in turn), every live worker in turn,
    the first one rotating. Passes the budget cannot hold are counted into `cut`."""
    runs = specs[0].runs() if specs else []
    durations: dict[tuple[int, int, str], float] = {}
    passes = [-1, *range(max((s.repeats for s in specs), default=0))]
    for n, rep in enumerate(passes):
        for j, (batch, context, sampling) in enumerate(runs):
            live = [w for w in workers if w.error is None]
            if not live:
                return
            est = durations.get((batch, context, sampling), 5.0 * len(live))
            if t_end is not None and time.time() + est > t_end:
                for w in live if rep >= 0 else ():
                    key = (w.spec.mode, batch, context, sampling)
                    cut[key] = cut.get(key, 0) + 1
                continue
            order = rotation(live, n + j)
            what = "warm-up" if rep < 0 else f"repeat {rep + 1}"
            preset = "" if sampling == GREEDY else f" {sampling}"
            print(f"[decode] {what} b={batch} c={context}{preset}: "
                  f"{', '.join(w.spec.mode for w in order)}", flush=True)
            t0 = time.monotonic()
            for w in order:
                # a warm-up may compile (a preset's first sampled step: the sampler's kernels)
                limit = max(60.0 if rep >= 0 else 180.0, 10 * est)
                if t_end is not None:
                    limit = min(limit, t_end - time.time() + KILL_GRACE_S)
                if not w.send(f"point {batch} {context} {rep}{preset}"):
                    w.error = "worker closed its input (it exited)"
                    continue
                line = w.wait_line(limit)
                if line is None or line == EXITED:
                    w.error = (f"no answer to point b={batch} c={context}{preset} within "
                               f"{limit:.0f} s"
                               if line is None else "worker exited while measuring")
                    stop_group(w.proc)  # a hung worker must not run next to the others
            durations[(batch, context, sampling)] = time.monotonic() - t0


def execute_interleaved(
    specs: list[WorkerSpec], work_dir: Path, t_end: float | None, mode_timeout_s: float
) -> tuple[list[WorkerResult], list[dict[str, Any]], list[dict[str, Any]]]:
    """`--interleave`: start every worker's engine (one after the other, so start-ups and
    vLLM's memory profiling never overlap), then measure point by point with the modes taking
    turns: for each repeat (after one untimed warm-up pass) and each point, every mode runs that
    repeat back to back, the first mode rotating. A host whose speed drifts over tens of seconds
    then shifts every mode alike. Stops starting passes when the budget cannot hold one.
    Returns (results, failures, skipped) like `execute`."""
    started: list[WorkerProcess] = []  # every worker ever started: all are finished, come what may
    done: list[tuple[WorkerSpec, WorkerResult, str | None]] = []
    skipped: list[dict[str, Any]] = []
    cut: dict[tuple[str, int, int, str], int] = {}  # (mode, batch, context, sampling) -> repeats
    # cut by the budget
    try:
        for i, spec in enumerate(specs):
            now = time.time()
            need = MODES[spec.mode].startup_estimate_s + MIN_MEASURE_S
            if t_end is not None and t_end - now < need:
                why = f"time budget: {t_end - now:.0f} s left < start-up estimate {need:.0f} s"
                print(f"[decode] skip {spec.model} {spec.mode}: {why}", flush=True)
                skipped.append({"model": spec.model, "mode": spec.mode, "points": "all",
                                "reason": why})
                continue
            limit = mode_timeout_s if t_end is None else min(mode_timeout_s, t_end - now)
            print(f"[decode] start {i + 1}/{len(specs)} {spec.model} {spec.mode}", flush=True)
            worker = WorkerProcess(spec, work_dir, interactive=True)
            started.append(worker)
            line = worker.wait_line(limit)
            if line != READY:  # ended now: a hung start must not hold the GPU while others run
                worker.error = ("engine never became ready" if line is None
                                else "worker exited before its engine was ready")
                started.remove(worker)
                done.append((spec, *worker.finish(KILL_GRACE_S)))
        _measure_in_turns(started, specs, t_end, cut)
    finally:
        for w in started:
            if w.error is None:
                w.send("quit")
            # after `quit` a worker may profile (BENCH_PROFILE): every batch under every preset
            done.append((w.spec, *w.finish(120.0 * len(w.spec.sampling) if w.error is None
                                           else KILL_GRACE_S)))
    model = specs[0].model if specs else ""
    skipped += [{"model": model, "mode": m, "batch": b, "context": c, "sampling": s,
                 "repeats_skipped": n, "reason": "time budget"} for (m, b, c, s), n in cut.items()]

    results: list[WorkerResult] = []
    failures: list[dict[str, Any]] = []
    for spec, result, error in done:
        results.append(result)
        if error:
            failures.append({"model": spec.model, "mode": spec.mode, "error": error,
                             "log": str(work_dir / f"log-{spec.model}-{spec.mode}.txt")})
        failures += [{"model": spec.model, "mode": spec.mode, "batch": p.batch,
                      "context": p.context, "sampling": p.sampling, "error": p.error}
                     for p in result.points if p.error]
        print(f"[decode] {spec.model} {spec.mode}: {result.status}, "
              f"{sum(1 for p in result.points if p.repeats_done)} point(s) measured", flush=True)
    return results, failures, skipped
