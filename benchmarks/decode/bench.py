"""Side-by-side decode benchmark: vLLM 0.26 modes on Qwen3 / Qwen3-MoE shapes (dummy weights).

  python -m benchmarks.decode [options]                      run a sweep (needs an NVIDIA GPU)
  python -m benchmarks.decode merge A.json B.json --name X   merge; redo ratios, plot, table

Every model x mode runs in its own process (benchmarks.harness.mode_worker) holding one engine
for all (batch, context) points. Output: <results-dir>/<name>.json and <name>.png. See
docs/benchmarking.md for what each mode, column and ratio means.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.decode import report
from benchmarks.decode.sampling_cost import format_sampling_cost
from benchmarks.harness import machine, plot, sweep
from benchmarks.harness.modes import DEFAULT_MODES, MODES, parse_modes
from benchmarks.harness.profile_prefill import prefill_token_counts
from benchmarks.harness.protocol import (
    merge_rounds,
    spec_to_json,
)
from benchmarks.harness.sampling import GREEDY, PRESETS, parse_presets
from benchmarks.harness.shapes import MODELS, REPO_ROOT, SHAPES

EXIT_NO_ROWS, EXIT_USAGE, EXIT_NO_GPU = 1, 2, 3


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from exc
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return sorted(set(values))


def _str_list(text: str) -> list[str]:
    return [v for v in text.replace(" ", "").split(",") if v]


_EPILOG = "\n".join(
    [
        "modes:",
        *(f"  {name:<22}{mode.description}" for name, mode in MODES.items()),
        "",
        "sampling presets:",
        *(f"  {name:<22}{p.description}" for name, p in PRESETS.items()),
        "",
        "merge: python -m benchmarks.decode merge FILE.json [FILE.json ...] --name NAME",
        "       [--results-dir DIR] [--no-plot]: rows of later files win on the same",
        "       model/batch/context/mode; ratios, plot and table are recomputed.",
        "",
        "environment: BENCH_GIT_COMMIT names the commit where the checkout has no .git.",
        "exit codes: 0 rows measured, 1 none measured (JSON still written), 2 usage, 3 no GPU.",
    ]
)


def run_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.decode",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EPILOG,
    )
    ap.add_argument(
        "--models",
        type=_str_list,
        default=list(MODELS),
        help=f"comma-separated shapes of {','.join(SHAPES)} (default: {','.join(MODELS)})",
    )
    ap.add_argument(
        "--modes",
        type=_str_list,
        default=list(DEFAULT_MODES),
        help=f"comma-separated modes, run in this order (default: {','.join(DEFAULT_MODES)}; "
        f"diagnostic, on request: {','.join(m for m in MODES if m not in DEFAULT_MODES)})",
    )
    ap.add_argument(
        "--batches",
        type=_int_list,
        default=[1, 8, 32, 64],
        help="comma-separated decode batch sizes (default: 1,8,32,64); max_num_seqs = the largest",
    )
    ap.add_argument(
        "--sampling",
        type=_str_list,
        default=[GREEDY],
        help="comma-separated sampling presets: every point is measured under each, back to "
        f"back (default: {GREEDY}; valid: {', '.join(PRESETS)}; see below)",
    )
    ap.add_argument(
        "--contexts",
        type=_int_list,
        default=[512, 4096],
        help="comma-separated prompt lengths in tokens (default: 512,4096)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="measurements of every point, each with fresh requests (default: 3)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="start every mode's engine this many times, in alternating mode order, and pool "
        "the rounds' steps: on a host whose speed shifts over time each mode then samples it "
        "at several moments (default: 1)",
    )
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="keep every mode's engine up at once (a fixed KV cache each) and measure point "
        "by point with the modes taking turns, after one untimed warm-up pass: host speed "
        "shifts then hit every mode alike (one model at a time; not with --rounds)",
    )
    ap.add_argument(
        "--decode-tokens",
        type=int,
        default=128,
        help="timed decode steps per point and repeat (default: 128)",
    )
    ap.add_argument(
        "--warmup-steps",
        type=int,
        default=4,
        help="decode-only steps discarded before timing, per repeat (default: 4)",
    )
    ap.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help="cut every model to this many layers (writes a temp config dir; "
        "default: the shape's full depth)",
    )
    ap.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.85,
        help="vLLM gpu_memory_utilization for every mode (default: 0.85)",
    )
    ap.add_argument(
        "--seed", type=int, default=0,
        help="vLLM seed, prompt RNG seed and first request seed of a seeded --sampling preset "
        "(request i of a point: seed + i) (default: 0)"
    )
    ap.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="wall-clock budget of the whole run; no new mode or point starts when "
        "too little is left, the rest is reported as skipped (default: none)",
    )
    ap.add_argument(
        "--mode-timeout-s",
        type=float,
        default=1800.0,
        help="kill one mode's worker after this many seconds (default: 1800)",
    )
    ap.add_argument(
        "--name",
        default="decode",
        help="result name: writes <results-dir>/<name>.json and .png (default: decode)",
    )
    ap.add_argument(
        "--results-dir",
        type=Path,
        default=REPO_ROOT / "benchmarks" / "results",
        help="where the JSON and PNG go (default: benchmarks/results)",
    )
    ap.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="worker logs, specs, results and temp configs (default: a new temp dir)",
    )
    ap.add_argument("--no-plot", action="store_true", help="do not render the PNG")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (worker specs with vLLM kwargs) as JSON and exit; no GPU",
    )
    return ap


def merge_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.decode merge",
        description="Merge benchmark JSONs; recompute ratios, plot, table.",
    )
    ap.add_argument("files", nargs="+", type=Path, help="benchmark JSON files, in order")
    ap.add_argument("--name", required=True, help="name of the merged result")
    ap.add_argument(
        "--results-dir",
        type=Path,
        default=REPO_ROOT / "benchmarks" / "results",
        help="where the merged JSON and PNG go (default: benchmarks/results)",
    )
    ap.add_argument("--no-plot", action="store_true", help="do not render the PNG")
    return ap


def validate_args(args: argparse.Namespace) -> None:
    """Option errors (ValueError) before anything else runs, GPU check included."""
    parse_modes(args.modes)
    parse_presets(args.sampling)
    unknown = [m for m in args.models if m not in SHAPES]
    if unknown or not args.models:
        raise ValueError(
            f"unknown model(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(SHAPES)}"
        )
    for flag, value in (("--repeats", args.repeats), ("--rounds", args.rounds),
                        ("--decode-tokens", args.decode_tokens)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.interleave and args.rounds > 1:
        raise ValueError(
            f"--interleave and --rounds {args.rounds} do not combine: interleaving already "
            "spreads every mode over the whole run; drop one of them"
        )
    if args.warmup_steps < 0:
        raise ValueError(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(
            f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}"
        )
    if args.num_layers is not None and args.num_layers < 1:
        raise ValueError(f"--num-layers must be >= 1, got {args.num_layers}")
    if os.environ.get("BENCH_PROFILE_PREFILL"):
        prefill_token_counts(os.environ["BENCH_PROFILE_PREFILL"], args.contexts[0],
                             max(args.batches))
    if args.time_budget_s is not None and args.time_budget_s <= sweep.RESERVE_S:
        raise ValueError(
            f"--time-budget-s must exceed {sweep.RESERVE_S:.0f} s, got {args.time_budget_s}"
        )


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
    for text in (report.format_repeat_summary(doc), format_sampling_cost(doc)):
        if text:
            print(text, flush=True)
    return 0 if doc["rows"] else EXIT_NO_ROWS


def run(args: argparse.Namespace) -> int:
    t_start = time.time()
    validate_args(args)
    if not args.dry_run:
        problem = machine.gpu_problem()
        if problem:
            print(
                f"error: this benchmark needs an NVIDIA GPU: {problem}. Run it on a GPU machine "
                f"(see docs/benchmarking.md: benchmarks/gpu/run.sh).",
                file=sys.stderr,
                flush=True,
            )
            return EXIT_NO_GPU
    work_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="decode-bench-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    specs, absent, layers, shapes = sweep.plan(args, work_dir)
    if args.dry_run:
        plan = {"absent": absent, "layers": layers,
                "sampling": {s: PRESETS[s].record() for s in parse_presets(args.sampling)},
                "workers": [spec_to_json(s) for s in specs]}
        print(json.dumps(plan, indent=1), flush=True)
        return 0
    if args.interleave and (gpu_bytes := machine.gpu_memory_bytes()):
        for model in dict.fromkeys(s.model for s in specs):
            mine = [s for s in specs if s.model == model]
            why = sweep.interleave_overflow(model, shapes[model],
                                            mine[0].llm_kwargs["kv_cache_memory_bytes"],
                                            len(mine), gpu_bytes)
            if why:
                print(f"decode benchmark: {why}", file=sys.stderr, flush=True)
                return 2
    print(f"decode benchmark: {len(specs)} worker(s), logs in {work_dir}", flush=True)
    if specs:
        s = specs[0]
        print(f"  each: {len(s.points())} point(s) x {len(s.sampling)} sampling preset(s) "
              f"({', '.join(s.sampling)}) x {s.repeats} repeat(s)"
              f"{' after a warm-up pass' if s.interleaved else ''}", flush=True)
    for mode, why in absent.items():
        print(f"  absent {mode}: {why}", flush=True)
    t_end = None if args.time_budget_s is None else t_start + args.time_budget_s - sweep.RESERVE_S
    if args.interleave:
        results, failures, skipped = [], [], []
        models = list(dict.fromkeys(s.model for s in specs))
        for i, model in enumerate(models):  # one model's engines at a time, budget split evenly
            share = None if t_end is None else time.time() + (t_end - time.time()) / (
                len(models) - i)
            out = sweep.execute_interleaved([s for s in specs if s.model == model], work_dir,
                                            share, args.mode_timeout_s)
            for acc, part in zip((results, failures, skipped), out):
                acc += part
    else:
        results, failures, skipped = sweep.execute(specs, work_dir, t_end, args.mode_timeout_s)
    bandwidths = [r.bandwidth_gbps for r in results if r.bandwidth_gbps]
    results = merge_rounds(results)
    bw = statistics.median(bandwidths) if bandwidths else None
    rows = []
    for result in results:
        rows += [dataclasses.asdict(r) for r in report.build_rows(result, shapes[result.model], bw)]
    env = machine.environment(args, results, layers, bandwidths)
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

