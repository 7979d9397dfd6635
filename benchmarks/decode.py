"""Side-by-side decode benchmark: vLLM 0.26 modes on Qwen3 / Qwen3-MoE shapes (dummy weights).

  python -m benchmarks.decode [options]                       run a sweep (needs an NVIDIA GPU)
  python -m benchmarks.decode merge A.json B.json --name X    merge results; redo ratios, plot, table

Every model x mode runs in its own process (benchmarks._mode_worker) holding one engine for all
(batch, context) points. Output: <results-dir>/<name>.json and <name>.png. See
docs/benchmarking.md for what each mode, column and ratio means.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import glob
import importlib.metadata
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from benchmarks import plot, report
from benchmarks.modes import MODES, Mode, common_llm_kwargs, parse_modes
from benchmarks.protocol import (
    SLACK_STEPS, WorkerResult, WorkerSpec, result_from_json, spec_to_json, write_json_atomic,
)
from benchmarks.shapes import MODELS, REPO_ROOT, ModelShape, prepare_config_dir, read_config

EXIT_NO_ROWS, EXIT_USAGE, EXIT_NO_GPU = 1, 2, 3
RESERVE_S = 15.0  # kept back from --time-budget-s for writing the JSON, plot and table
KILL_GRACE_S = 5.0
MIN_MEASURE_S = 10.0  # a mode starts only if its start-up estimate plus this fits the budget


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return sorted(set(values))


def _str_list(text: str) -> list[str]:
    return [v for v in text.replace(" ", "").split(",") if v]


def run_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.decode", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="merge: python -m benchmarks.decode merge FILE.json [FILE.json ...] --name NAME "
               "[--results-dir DIR] [--no-plot]  (rows of later files win on the same "
               "model/batch/context/mode; ratios, plot and table are recomputed). Exit codes: 0 "
               "rows measured, 1 none measured, 2 usage, 3 no GPU.")
    ap.add_argument("--models", type=_str_list, default=list(MODELS),
                    help=f"comma-separated shapes (default: {','.join(MODELS)})")
    ap.add_argument("--modes", type=_str_list, default=list(MODES),
                    help=f"comma-separated modes, run in this order (default: {','.join(MODES)})")
    ap.add_argument("--batches", type=_int_list, default=[1, 8, 32, 64],
                    help="comma-separated decode batch sizes (default: 1,8,32,64); "
                         "max_num_seqs = the largest")
    ap.add_argument("--contexts", type=_int_list, default=[512, 4096],
                    help="comma-separated prompt lengths in tokens (default: 512,4096)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="measurements of every point, each with fresh requests (default: 3)")
    ap.add_argument("--decode-tokens", type=int, default=128,
                    help="timed decode steps per point and repeat (default: 128)")
    ap.add_argument("--warmup-steps", type=int, default=4,
                    help="decode-only steps discarded before timing, per repeat (default: 4)")
    ap.add_argument("--num-layers", type=int, default=None,
                    help="cut every model to this many layers (writes a temp config dir; "
                         "default: the shape's full depth)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                    help="vLLM gpu_memory_utilization for every mode (default: 0.85)")
    ap.add_argument("--seed", type=int, default=0, help="vLLM seed and prompt RNG seed (default: 0)")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="wall-clock budget of the whole run; no new mode or point starts when "
                         "too little is left, the rest is reported as skipped (default: none)")
    ap.add_argument("--mode-timeout-s", type=float, default=1800.0,
                    help="kill one mode's worker after this many seconds (default: 1800)")
    ap.add_argument("--name", default="decode",
                    help="result name: writes <results-dir>/<name>.json and .png (default: decode)")
    ap.add_argument("--results-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results",
                    help="where the JSON and PNG go (default: benchmarks/results)")
    ap.add_argument("--log-dir", type=Path, default=None,
                    help="worker logs, specs, results and temp configs (default: a new temp dir)")
    ap.add_argument("--no-plot", action="store_true", help="do not render the PNG")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the plan (worker specs with vLLM kwargs) as JSON and exit; no GPU")
    return ap


def merge_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.decode merge",
                                 description="Merge benchmark JSONs; recompute ratios, plot, table.")
    ap.add_argument("files", nargs="+", type=Path, help="benchmark JSON files, in order")
    ap.add_argument("--name", required=True, help="name of the merged result")
    ap.add_argument("--results-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results",
                    help="where the merged JSON and PNG go (default: benchmarks/results)")
    ap.add_argument("--no-plot", action="store_true", help="do not render the PNG")
    return ap


def gpu_problem() -> str | None:
    """Why no NVIDIA GPU is usable here, or None. Cheap: no torch, no vLLM, no CUDA init."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    if glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/proc/driver/nvidia/version"):
        return None
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
            if out.returncode == 0 and "GPU" in out.stdout:
                return None
        except (OSError, subprocess.TimeoutExpired):
            pass
    return "no NVIDIA GPU found (no /dev/nvidia*, no /proc/driver/nvidia, no working nvidia-smi)"


def max_model_len(contexts: list[int], batches: list[int], decode: int, warmup: int) -> int:
    """Longest prompt + timed and warm-up steps + the decode tokens early requests get while the
    batch is still prefilling (chunks of >= 8192 tokens) + margin, rounded up to 16."""
    prefill_steps = math.ceil(max(batches) * max(contexts) / 8192) + 1
    need = max(contexts) + warmup + decode + prefill_steps + SLACK_STEPS + 16
    return -(-need // 16) * 16


def validate_args(args: argparse.Namespace) -> None:
    """Option errors (ValueError) before anything else runs, GPU check included."""
    parse_modes(args.modes)
    unknown = [m for m in args.models if m not in MODELS]
    if unknown or not args.models:
        raise ValueError(f"unknown model(s) {', '.join(unknown) or '(none given)'}; "
                         f"known: {', '.join(MODELS)}")
    for flag, value in (("--repeats", args.repeats), ("--decode-tokens", args.decode_tokens)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.warmup_steps < 0:
        raise ValueError(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if args.num_layers is not None and args.num_layers < 1:
        raise ValueError(f"--num-layers must be >= 1, got {args.num_layers}")
    if args.time_budget_s is not None and args.time_budget_s <= RESERVE_S:
        raise ValueError(f"--time-budget-s must exceed {RESERVE_S:.0f} s, got {args.time_budget_s}")


def plan(args: argparse.Namespace, work_dir: Path) -> tuple[list[WorkerSpec], dict[str, str],
                                                             dict[str, int], dict[str, ModelShape]]:
    modes = parse_modes(args.modes)
    absent = {m.name: m.available().text() for m in modes if not m.available().ok}
    runnable: list[Mode] = [m for m in modes if m.name not in absent]
    specs, layers, shapes = [], {}, {}
    mml = max_model_len(args.contexts, args.batches, args.decode_tokens, args.warmup_steps)
    for model in args.models:
        config_dir, layers[model] = prepare_config_dir(model, args.num_layers, work_dir)
        cfg = read_config(config_dir)
        shapes[model] = ModelShape.from_config(cfg)
        common = common_llm_kwargs(config_dir=str(config_dir), max_num_seqs=max(args.batches),
                                   max_model_len=mml, seed=args.seed,
                                   gpu_memory_utilization=args.gpu_memory_utilization)
        for mode in runnable:
            specs.append(WorkerSpec(
                model=model, config_dir=str(config_dir), mode=mode.name,
                llm_kwargs=mode.llm_kwargs(common), env=mode.worker_env(),
                batches=args.batches, contexts=args.contexts, repeats=args.repeats,
                decode_tokens=args.decode_tokens, warmup_steps=args.warmup_steps,
                vocab_size=int(cfg["vocab_size"]), seed=args.seed,
                result_path=str(work_dir / f"result-{model}-{mode.name}.json"),
            ))
    return specs, absent, layers, shapes


def _pump(stream: TextIO, log: TextIO) -> None:
    for line in stream:
        log.write(line)
        log.flush()
        if line.startswith("[bench]"):
            print("  " + line.rstrip(), flush=True)


def run_worker(spec: WorkerSpec, work_dir: Path, limit_s: float) -> tuple[WorkerResult, str | None]:
    """Run one worker to completion or `limit_s`; returns its result and a run-level error."""
    stem = f"{spec.model}-{spec.mode}"
    spec_path, log_path = work_dir / f"spec-{stem}.json", work_dir / f"log-{stem}.txt"
    write_json_atomic(spec_path, spec_to_json(spec))
    env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks._mode_worker", str(spec_path)],
                                cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace")
        assert proc.stdout is not None, "Popen with stdout=PIPE has a stdout"
        pump = threading.Thread(target=_pump, args=(proc.stdout, log), daemon=True)
        pump.start()
        killed = False
        try:
            proc.wait(timeout=max(1.0, limit_s))
        except subprocess.TimeoutExpired:
            killed = True
            proc.terminate()
            try:
                proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        pump.join(timeout=5)
    elapsed = time.monotonic() - t0
    try:
        result = result_from_json(json.loads(Path(spec.result_path).read_text()))
    except (OSError, json.JSONDecodeError, TypeError) as exc:
        result = WorkerResult(model=spec.model, mode=spec.mode, status="failed",
                              error=f"no result file ({exc})")
    error = None
    if killed:
        error = (f"killed at its time limit after {elapsed:.0f} s (worker status was "
                 f"{result.status!r}); points measured before are kept")
    elif result.status in ("starting", "running"):
        error = f"worker exited with code {proc.returncode} before finishing (status {result.status!r})"
    elif result.status == "failed":
        error = result.error or "failed"
    if error:
        tail = log_path.read_text(errors="replace").splitlines()[-25:]
        print(f"  worker log tail ({log_path}):\n    " + "\n    ".join(tail), flush=True)
    return result, error


def environment(args: argparse.Namespace, results: list[WorkerResult],
                layers: dict[str, int], bandwidths: list[float]) -> dict[str, Any]:
    versions = next((r.versions for r in results if r.versions), {})

    def version(pkg: str) -> str:
        if pkg in versions:
            return versions[pkg]
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return "unknown"

    gpu, driver = versions.get("gpu", "unknown"), "unknown"
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
            if out.returncode == 0 and out.stdout.strip():
                gpu, driver = (s.strip() for s in out.stdout.splitlines()[0].split(",", 1))
        except (OSError, subprocess.TimeoutExpired, ValueError):
            pass
    return {
        "gpu_name": gpu, "driver": driver, "cuda": versions.get("cuda", "unknown"),
        "torch": version("torch"), "vllm": version("vllm"), "triton": version("triton"),
        "python": versions.get("python", platform.python_version()),
        "git_commit": _git_commit(), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "layers": layers,
        "hbm_bandwidth_gbps": round(statistics.median(bandwidths), 1) if bandwidths else None,
        "hbm_bandwidth_samples_gbps": [round(b, 1) for b in bandwidths],
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        if out.returncode != 0:
            return "unknown (not a git checkout, or no commit yet)"
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (git not available)"


def finish(doc: dict[str, Any], results_dir: Path, no_plot: bool) -> int:
    path = report.write(doc, results_dir)
    print(f"wrote {path}", flush=True)
    if not no_plot:
        png = plot.render(doc, path.with_suffix(".png"))
        if png:
            print(f"wrote {png}", flush=True)
    summary = report.format_ratio_summary(doc)
    if summary:
        print(summary, flush=True)
    print(report.format_table(doc), flush=True)
    return 0 if doc["rows"] else EXIT_NO_ROWS


def run(args: argparse.Namespace) -> int:
    t_start = time.time()
    validate_args(args)
    if not args.dry_run:
        problem = gpu_problem()
        if problem:
            print(f"error: this benchmark needs an NVIDIA GPU: {problem}. Run it on a GPU machine "
                  f"(see docs/benchmarking.md: benchmarks/gpu/run.sh).", file=sys.stderr, flush=True)
            return EXIT_NO_GPU
    work_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="decode-bench-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    specs, absent, layers, shapes = plan(args, work_dir)
    if args.dry_run:
        print(json.dumps({"absent": absent, "layers": layers,
                          "workers": [spec_to_json(s) for s in specs]}, indent=1), flush=True)
        return 0
    print(f"decode benchmark: {len(specs)} worker(s), logs in {work_dir}", flush=True)
    for mode, why in absent.items():
        print(f"  absent {mode}: {why}", flush=True)
    t_end = None if args.time_budget_s is None else t_start + args.time_budget_s - RESERVE_S
    results: list[WorkerResult] = []
    rows, failures, skipped = [], [], []
    for i, spec in enumerate(specs):
        now = time.time()
        later = specs[i + 1:]
        estimate = MODES[spec.mode].startup_estimate_s
        if t_end is not None:
            left = t_end - now
            if left < estimate + MIN_MEASURE_S:
                why = (f"time budget: {left:.0f} s left < start-up estimate {estimate:.0f} s "
                       f"+ {MIN_MEASURE_S:.0f} s")
                print(f"[decode] skip {spec.model} {spec.mode}: {why}", flush=True)
                skipped.append({"model": spec.model, "mode": spec.mode, "points": "all", "reason": why})
                continue
            spec.hard_deadline = t_end
            spec.soft_deadline = now + left / (len(later) + 1)
            reserve_later = sum(MODES[s.mode].startup_estimate_s for s in later)
            spec.first_pass_deadline = max(spec.soft_deadline, t_end - reserve_later)
        limit = args.mode_timeout_s if t_end is None else min(args.mode_timeout_s, t_end - now + KILL_GRACE_S)
        left_txt = "" if t_end is None else f", {t_end - now:.0f} s of budget left"
        print(f"[decode] {i + 1}/{len(specs)} {spec.model} {spec.mode}{left_txt}", flush=True)
        result, error = run_worker(spec, work_dir, limit)
        results.append(result)
        if error:
            failures.append({"model": spec.model, "mode": spec.mode, "error": error,
                             "log": str(work_dir / f"log-{spec.model}-{spec.mode}.txt")})
        for p in result.points:
            if p.error:
                failures.append({"model": spec.model, "mode": spec.mode, "batch": p.batch,
                                 "context": p.context, "error": p.error})
        skipped += [{"model": spec.model, "mode": spec.mode, **s} for s in result.skipped]
        print(f"[decode] {spec.model} {spec.mode}: {result.status}, "
              f"{sum(1 for p in result.points if p.repeats_done)} point(s) measured", flush=True)
    bandwidths = [r.bandwidth_gbps for r in results if r.bandwidth_gbps]
    bw = statistics.median(bandwidths) if bandwidths else None
    for result in results:
        rows += [dataclasses.asdict(r) for r in report.build_rows(result, shapes[result.model], bw)]
    env = environment(args, results, layers, bandwidths)
    doc = report.assemble(args.name, env, rows, absent, failures, skipped)
    return finish(doc, args.results_dir, args.no_plot)


def merge_main(argv: list[str]) -> int:
    args = merge_parser().parse_args(argv)
    try:
        docs = [(str(p), report.load(p)) for p in args.files]
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return finish(report.merge(docs, args.name), args.results_dir, args.no_plot)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["merge"]:
        return merge_main(argv[1:])
    args = run_parser().parse_args(argv)
    try:
        return run(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
