"""Run one model x one mode of the decode benchmark in this process.

    python -m benchmarks.harness.mode_worker SPEC.json             # measure (needs a GPU)
    python -m benchmarks.harness.mode_worker SPEC.json --validate  # check the kwargs (CPU)

Started by `benchmarks.decode`, one process per mode, so modes never share an engine, a CUDA
context or compile state. The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`):
we attach a handler to vLLM's logger and drive `llm.llm_engine.step()` ourselves, timing every
step. TPOT samples are the gaps between consecutive steps in which every one of the B requests
got exactly one new token and all of them had finished prefill before: decode-only steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from benchmarks.harness.protocol import (
    DONE,
    READY,
    SLACK_STEPS,
    WorkerResult,
    WorkerSpec,
    result_to_json,
    spec_from_json,
    write_json_atomic,
)
from benchmarks.harness.startup_trace import maybe_trace_startup
from benchmarks.harness.vllm_facts import VllmLogTap, check_config_dicts, describe_engine, validate

MAX_CONSECUTIVE_FAILURES = 2


def say(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


def format_error(exc: BaseException, limit: int = 2500) -> str:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    head = f"{type(exc).__name__}: {exc}"
    tail = tb[-limit:]
    return head if head in tail else f"{head}\n...{tail}"


def decode_intervals(chains: list[list[float]]) -> list[float]:
    """Gaps (ms) between consecutive decode-only step returns, chain by chain."""
    out: list[float] = []
    for chain in chains:
        out += [(b - a) * 1e3 for a, b in zip(chain, chain[1:])]
    return out


def run_point(
    llm: Any,
    spec: WorkerSpec,
    batch: int,
    context: int,
    tag: str,
    rng: random.Random,
    resolved: dict[str, Any],
    make_params: Callable[[int], Any],
    make_prompt: Callable[[list[int]], Any],
) -> tuple[list[float], float]:
    """One repeat of one (batch, context) point: returns (decode step ms, prefill seconds)."""
    engine = llm.llm_engine
    mbt = int(resolved.get("max_num_batched_tokens") or 8192)
    prefill_steps = math.ceil(batch * context / max(1, mbt - batch)) + 1
    wanted = spec.warmup_steps + spec.decode_tokens
    room = int(resolved.get("max_model_len") or 0) - context
    max_tokens = min(wanted + prefill_steps + SLACK_STEPS, room)
    if max_tokens < wanted + 2:
        raise ValueError(
            f"max_model_len leaves {room} new tokens at context {context}; need {wanted + 2}"
        )
    blocks, block = resolved.get("num_gpu_blocks"), resolved.get("block_size")
    if blocks and block:
        need = batch * math.ceil((context + max_tokens) / block) * block
        if need > blocks * block:
            raise RuntimeError(
                f"KV cache holds {blocks * block} tokens, batch {batch} x "
                f"{context + max_tokens} needs {need}: the batch would not run concurrently "
                f"(raise --gpu-memory-utilization or lower --num-layers)"
            )
    params = make_params(max_tokens)
    prompts = [
        make_prompt([rng.randrange(spec.vocab_size) for _ in range(context)]) for _ in range(batch)
    ]
    engine_inputs = llm._preprocess_cmpl(prompts)  # what LLM.generate does with token prompts
    ids = [f"{tag}-{i}" for i in range(batch)]
    counts = dict.fromkeys(ids, 0)
    chains: list[list[float]] = [[]]
    t_start, t_ready = time.perf_counter(), None
    try:
        for rid, engine_input in zip(ids, engine_inputs):
            engine.add_request(rid, engine_input, params)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            if not outputs:
                continue
            was_ready = t_ready is not None
            new: dict[str, int] = {}
            finished = False
            for out in outputs:
                n = sum(len(c.token_ids) for c in out.outputs)
                new[out.request_id] = new.get(out.request_id, 0) + n
                finished = finished or out.finished
            for rid, n in new.items():
                counts[rid] = counts.get(rid, 0) + n
            decode_only = (
                was_ready
                and not finished
                and len(new) == batch
                and all(n == 1 for n in new.values())
            )
            if decode_only:
                chains[-1].append(now)
            elif chains[-1]:
                chains.append([])
            if t_ready is None and all(c >= 1 for c in counts.values()):
                t_ready = now
    finally:
        if engine.has_unfinished_requests():
            engine.abort_request(ids)
    steps = decode_intervals(chains)[spec.warmup_steps :][: spec.decode_tokens]
    if len(steps) < max(1, spec.decode_tokens // 2):
        raise RuntimeError(
            f"only {len(steps)} decode-only steps at batch {batch} context {context} (wanted "
            f"{spec.decode_tokens}); tokens per request: {sorted(set(counts.values()))}"
        )
    prefill_s = (t_ready or time.perf_counter()) - t_start
    return steps, prefill_s


def measure_bandwidth(torch: Any) -> float | None:
    """HBM bandwidth in GB/s: median of 10 timed device-to-device copies, 2 * bytes / time."""
    for nbytes in (1 << 30, 1 << 28):
        try:
            src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
        except RuntimeError:  # torch.OutOfMemoryError is a RuntimeError
            torch.cuda.empty_cache()
            continue
        for _ in range(3):
            dst.copy_(src)
        torch.cuda.synchronize()
        times = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        del src, dst
        torch.cuda.empty_cache()
        return 2 * nbytes / (statistics.median(times) / 1e3) / 1e9
    return None


def run(
    spec: WorkerSpec, result: WorkerResult, save: Callable[[], None], allow_cpu: bool = False
) -> None:
    os.environ.update(spec.env)  # before vLLM reads its environment
    prefill_counts, prefill_dir = None, os.environ.get("BENCH_PREFILL_PROFILE_DIR")
    if os.environ.get("BENCH_PROFILE_PREFILL") and prefill_dir:
        from benchmarks.harness.profile_steps import prefill_token_counts

        prefill_counts = prefill_token_counts(os.environ["BENCH_PROFILE_PREFILL"])  # fail early
    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu and not allow_cpu:
        raise RuntimeError(
            "CUDA is not available in the mode worker (torch.cuda.is_available() "
            "is False): run the benchmark on a machine with an NVIDIA GPU"
        )
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    result.import_s = time.perf_counter() - t0
    try:
        import triton

        triton_version = str(triton.__version__)
    except Exception:  # noqa: BLE001 - only a version string
        triton_version = "unknown"

    result.versions = {
        "torch": torch.__version__,
        "vllm": vllm.__version__,
        "triton": triton_version,
        "cuda": str(torch.version.cuda),
        "python": sys.version.split()[0],
    }
    tap = VllmLogTap()
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.addHandler(tap)
    if vllm_logger.getEffectiveLevel() > logging.INFO:
        vllm_logger.setLevel(logging.INFO)  # the capture record is INFO
    check_config_dicts(spec.llm_kwargs)
    say(f"{spec.model} {spec.mode}: starting vllm.LLM")
    t0 = time.perf_counter()
    with maybe_trace_startup(spec):  # BENCH_STARTUP_PROFILE_DIR
        llm = LLM(**spec.llm_kwargs)
    result.startup_s = time.perf_counter() - t0
    # Device name only now: vLLM initialises CUDA itself.
    result.versions["gpu"] = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    result.capture_s = tap.capture_s
    result.graph_mem_mib = None if tap.graph_mem_gib is None else tap.graph_mem_gib * 1024
    result.resolved, result.runner, result.compile_s = describe_engine(llm)
    result.resolved["init_engine_s"] = tap.init_engine_s
    result.resolved["capture_records"] = tap.captures
    result.status = "running"
    save()
    say(
        f"{spec.model} {spec.mode}: ready in {result.startup_s:.1f} s (capture "
        f"{_fmt(result.capture_s)} s, graphs {_fmt(result.graph_mem_mib)} MiB, runner "
        f"{result.runner}, cudagraph_mode {result.resolved['cudagraph_mode']})"
    )

    def make_params(max_tokens: int) -> Any:
        # NOTE: no min_tokens: it adds a per-step logits processor; ignore_eos is enough.
        return SamplingParams(
            temperature=0.0,
            ignore_eos=True,
            max_tokens=max_tokens,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )

    def make_prompt(ids: list[int]) -> Any:
        return TokensPrompt(prompt_token_ids=ids)

    bench = Bench(llm, spec, result, save, make_params, make_prompt)
    if spec.interleaved:
        serve_commands(bench)
    else:
        measure_points(bench)
    if os.environ.get("BENCH_PROFILE_DIR") and on_gpu:
        from benchmarks.harness.profile_steps import profile_run

        profile_run(llm, spec, make_params, make_prompt, os.environ["BENCH_PROFILE_DIR"])
    if prefill_counts and on_gpu:
        from benchmarks.harness.profile_steps import profile_prefill_run

        profile_prefill_run(llm, spec, prefill_counts, make_params, make_prompt, prefill_dir)
    plugin = plugin_counters()
    if plugin is not None:
        # Lazy capture: the plugin's pool and capture time exist only after the points ran.
        result.resolved["moe_graphs"] = plugin
        result.graph_mem_mib = plugin["pool_bytes"] / 2**20
        result.capture_s = plugin["capture_seconds"]
        save()
        say(f"{spec.model} {spec.mode}: plugin {plugin}")
    try:
        result.bandwidth_gbps = measure_bandwidth(torch) if on_gpu else None
    except Exception as exc:  # noqa: BLE001 - the floor is optional; the TPOT rows are not
        result.resolved["bandwidth_error"] = format_error(exc, limit=500)
    say(f"{spec.model} {spec.mode}: copy bandwidth {_fmt(result.bandwidth_gbps)} GB/s")


def plugin_counters() -> dict[str, Any] | None:
    """The plugin's own counters (replays, fallbacks by reason, captures, pool) when it is
    loaded in this process and took decode graphs over; None otherwise."""
    if "vllm_moe_graphs.metrics" not in sys.modules:
        return None
    from vllm_moe_graphs.metrics_transport import collect_text

    text = collect_text()
    if 'moe_graphs_info{' not in text:
        return None
    out: dict[str, Any] = {"fallbacks": {}}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        v = float(value)
        if name == "moe_graphs_eager_fallbacks_total" and v:
            reason = name_labels.split('reason="', 1)[1].split('"', 1)[0]
            out["fallbacks"][reason] = out["fallbacks"].get(reason, 0) + v
        elif name == "moe_graphs_info" and v:
            out["mode"] = name_labels.split('mode="', 1)[1].split('"', 1)[0]
        else:
            key = {"moe_graphs_replays_total": "replays",
                   "moe_graphs_captures_total": "captures",
                   "moe_graphs_capture_failures_total": "capture_failures",
                   "moe_graphs_capture_seconds_sum": "capture_seconds",
                   "moe_graphs_pool_bytes": "pool_bytes",
                   "moe_graphs_scratch_bytes": "scratch_bytes"}.get(name)
            if key:
                out[key] = out.get(key, 0) + v
    for key in ("replays", "captures", "capture_failures", "capture_seconds", "pool_bytes",
                "scratch_bytes"):
        out.setdefault(key, 0)
    return out


@dataclasses.dataclass(slots=True)
class Bench:
    """What measuring needs: the engine, the spec, the result it fills and how to save it, and
    the vLLM request builders."""

    llm: Any
    spec: WorkerSpec
    result: WorkerResult
    save: Callable[[], None]
    make_params: Callable[[int], Any]
    make_prompt: Callable[[list[int]], Any]


def measure_points(bench: Bench) -> None:
    spec, result = bench.spec, bench.result
    rng = random.Random(spec.seed)
    durations: dict[tuple[int, int], float] = {}
    skipped: dict[tuple[int, int], int] = {}
    failures_in_row = 0
    for rep in range(spec.repeats):
        for batch, context in spec.points():
            point = result.point(batch, context)
            if point.error is not None:
                continue
            # A started engine measures at least one point if the run's end allows: its start-up
            # time is already spent. Then repeat 1 keeps to its deadline, repeats 2.. to theirs.
            deadline = (
                spec.hard_deadline
                if not durations
                else spec.first_pass_deadline
                if rep == 0
                else spec.soft_deadline
            )
            est = durations.get((batch, context)) or max(
                [5.0, *(2 * d for d in durations.values())]
            )
            if deadline is not None and time.time() + est > deadline:
                skipped[(batch, context)] = skipped.get((batch, context), 0) + 1
                continue
            t0 = time.perf_counter()
            ok = measure_one(bench, rng, batch, context, rep, f"r{rep}b{batch}c{context}")
            if not ok:
                failures_in_row += 1
                if failures_in_row >= MAX_CONSECUTIVE_FAILURES:
                    raise RuntimeError(
                        f"{failures_in_row} points failed in a row; giving up on mode {spec.mode}"
                    )
                continue
            failures_in_row = 0
            durations[(batch, context)] = time.perf_counter() - t0
    result.skipped = [
        {"batch": b, "context": c, "repeats_skipped": n, "reason": "time budget"}
        for (b, c), n in sorted(skipped.items())
    ]


def measure_one(
    bench: Bench,
    rng: random.Random,
    batch: int,
    context: int,
    rep: int,
    tag: str,
    record: bool = True,
) -> bool:
    """One repeat of one point: recorded in `result` (unless `record` is False: a warm-up) and
    saved. False when it failed (the error is recorded on the point)."""
    spec, result, save = bench.spec, bench.result, bench.save
    point = result.point(batch, context)
    t0 = time.perf_counter()
    try:
        steps, prefill_s = run_point(bench.llm, spec, batch, context, tag, rng, result.resolved,
                                     bench.make_params, bench.make_prompt)
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        point.error = format_error(exc)
        say(f"{spec.model} {spec.mode} b={batch} c={context}: FAILED {type(exc).__name__}: {exc}")
        save()
        return False
    p50 = statistics.median(steps)
    if record:
        point.step_ms += [round(s, 4) for s in steps]
        point.repeat_p50_ms.append(round(p50, 4))
        point.prefill_s.append(round(prefill_s, 3))
        point.point_s.append(round(time.perf_counter() - t0, 3))
        point.repeats_done += 1
        save()
    what = f"rep {rep + 1}/{spec.repeats}" if record else "warm-up"
    say(
        f"{spec.model} {spec.mode} {what} b={batch} c={context}: p50 {p50:.3f} ms over "
        f"{len(steps)} steps, prefill {prefill_s:.2f} s, point {time.perf_counter() - t0:.1f} s"
    )
    return True


def serve_commands(bench: Bench, commands: Any = None) -> None:
    """Interleaved runs (`benchmarks.decode --interleave`): the parent keeps every mode's engine
    up and sends one line per repeat of a point, mode after mode, so that every mode samples the
    host at the same moments. Commands: `point BATCH CONTEXT REP` (REP -1: a warm-up, not
    recorded) and `quit`; each gets a DONE line back. Ends at `quit` or end of input."""
    commands = sys.stdin if commands is None else commands
    rng = random.Random(bench.spec.seed)
    print(READY, flush=True)
    for line in commands:
        words = line.split()
        if not words:
            continue
        if words == ["quit"]:
            break
        try:
            if words[0] != "point" or len(words) != 4:
                raise ValueError(f"unknown command {line.strip()!r}")
            batch, context, rep = (int(w) for w in words[1:])
        except ValueError as exc:
            print(f"{DONE} error {exc}", flush=True)
            continue
        ok = measure_one(bench, rng, batch, context, max(rep, 0), f"i{rep}b{batch}c{context}",
                         record=rep >= 0)
        print(f"{DONE} {'ok' if ok else 'error'}", flush=True)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def validate_all(specs: list[WorkerSpec]) -> int:
    rejected = 0
    for spec in specs:
        try:
            line = validate(spec)
        except (TypeError, ValueError) as exc:  # EngineArgs / pydantic / our key check
            rejected += 1
            line = {"mode": spec.mode, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(line), flush=True)
    return 1 if rejected else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.harness.mode_worker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("spec", nargs="+", help="WorkerSpec JSON written by benchmarks.decode")
    ap.add_argument(
        "--validate",
        action="store_true",
        help="only check each spec's vLLM kwargs with EngineArgs (no GPU, no engine); "
        "prints one JSON line per spec, exit 1 if any is rejected",
    )
    ap.add_argument(
        "--allow-cpu",
        action="store_true",
        help="harness self-test only: run on vLLM's CPU platform (no bandwidth, no graphs)",
    )
    args = ap.parse_args(argv)
    specs = []
    for path in args.spec:
        with open(path) as f:
            specs.append(spec_from_json(json.load(f)))
    if args.validate:
        return validate_all(specs)
    if len(specs) != 1:
        ap.error("measuring takes exactly one spec")
    spec = specs[0]
    result = WorkerResult(model=spec.model, mode=spec.mode)

    def save() -> None:
        write_json_atomic(spec.result_path, result_to_json(result))

    save()
    t0 = time.perf_counter()
    try:
        run(spec, result, save, allow_cpu=args.allow_cpu)
        done = [p for p in result.points if p.repeats_done]
        errors = [p for p in result.points if p.error]
        result.status = "failed" if errors and not done else "ok"
        if result.status == "failed":
            result.error = "no point measured: " + "; ".join(
                f"b{p.batch}/c{p.context}: {(p.error or '').splitlines()[0]}" for p in errors
            )
    except BaseException as exc:  # noqa: BLE001 - everything, OOM included, goes to the result
        result.status = "failed"
        result.error = format_error(exc)
        say(f"{spec.model} {spec.mode}: FAILED {type(exc).__name__}: {exc}")
    result.wall_s = time.perf_counter() - t0
    save()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: engine shutdown hooks can hang and results are saved


if __name__ == "__main__":
    sys.exit(main())
