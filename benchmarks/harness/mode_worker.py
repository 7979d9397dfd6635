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
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.harness.decode_points import Bench, format_error, measure_points, say, \
    serve_commands
from benchmarks.harness.protocol import (
    WorkerResult,
    WorkerSpec,
    result_to_json,
    spec_from_json,
    write_json_atomic,
)
from benchmarks.harness.sampling import GREEDY, PRESETS, key_suffix
from benchmarks.harness.startup_trace import maybe_trace_startup
from benchmarks.harness.vllm_facts import VllmLogTap, check_config_dicts, describe_engine, validate


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
        from benchmarks.harness.profile_prefill import prefill_token_counts

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
    from vllm import LLM
    from vllm.inputs import TokensPrompt

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

    def make_params(max_tokens: int, sampling: str = GREEDY, index: int = 0) -> Any:
        return request_params(max_tokens, sampling, spec.seed, index)

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
        from benchmarks.harness.profile_prefill import profile_prefill_run

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


def request_params(max_tokens: int, sampling: str, seed: int, index: int) -> Any:
    """Request `index` of a point: `vllm.SamplingParams` that sample under preset `sampling`
    (harness/sampling.py; seeded presets: `seed` + index) and produce exactly `max_tokens`
    tokens, as token ids only, each step's new ones."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    # NOTE: no min_tokens: it adds a per-step logits processor; ignore_eos is enough.
    return SamplingParams(
        **PRESETS[sampling].kwargs(seed, index),
        ignore_eos=True,
        max_tokens=max_tokens,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )


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
                f"b{p.batch}/c{p.context}{key_suffix(p.sampling)}: "
                f"{(p.error or '').splitlines()[0]}" for p in errors
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
