"""Engine start-up benchmark: every mode started cold and warm, each start in a fresh process.

  python -m benchmarks.startup [options]       (needs an NVIDIA GPU; on the lent H200:
                                                BENCH_MODULE=benchmarks.startup benchmarks/gpu/run.sh)

Why a protocol of its own: how long `vllm.LLM(...)` takes to be ready depends mostly on the
caches a start finds (vLLM's torch.compile cache, Triton's kernel cache, TorchInductor's) and on
the machine's one-time costs (the page cache of a first `import vllm`, vLLM's model inspection,
the CUDA driver). `benchmarks.decode` starts its modes one after the other with shared caches, so
the first mode pays what the later ones find done. Here:

1. **prime**: a throwaway process imports torch, vLLM and the plugin, initialises CUDA and
   resolves the model config (vLLM's model inspection) with throwaway caches. The machine's
   one-time costs are paid before anything is timed.
2. **cold rounds** (`--cold-rounds`, default 1): every mode, each start with its own new, empty
   cache directories (`VLLM_CACHE_ROOT`, `TRITON_CACHE_DIR`, `TRITON_HOME`,
   `TORCHINDUCTOR_CACHE_DIR`, `XDG_CACHE_HOME`, `CUDA_CACHE_PATH`): the first start of an
   operator's fresh node or container. The first cold round runs the modes in the order given;
   each further one starts with the next mode, so with as many cold rounds as modes every mode
   is once the first start after the prime (a cold start varies by a few seconds from run to
   run; rotating keeps whatever being first costs from falling on one mode).
3. **warm rounds** (`--warm-rounds`): every mode again, in a fresh process, with the caches its
   own last cold start filled; the first mode rotates from round to round: a restart.

Every start runs the mode worker (`benchmarks.harness.mode_worker`) for one point (`--batch`
requests of `--context` prompt tokens, `--decode-tokens` timed steps, one repeat). Recorded per start:
`startup_s` (`vllm.LLM(...)` until it returns, the issue's "start-up to ready"), `first_point_s`
(the first requests in until all are done: what is left to compile or capture after "ready"
shows here, e.g. lazy graph capture), `import_s`, vLLM's `init_engine_s`, compile and capture.
Output: `<results-dir>/<name>.json` and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import machine, sweep, worker_process
from benchmarks.harness.modes import Family, Mode, common_llm_kwargs, parse_modes
from benchmarks.harness.protocol import WorkerResult, WorkerSpec, write_json_atomic
from benchmarks.harness.shapes import MODELS, REPO_ROOT, prepare_config_dir, read_config

EXIT_NO_ROWS, EXIT_USAGE, EXIT_NO_GPU = 1, 2, 3
DEFAULT_MODES = ("stock_eager", "stock_full_decode_nc", "stock_graphs", "plugin_graphs")
REFERENCE_MODES = ("stock_full_decode_nc", "stock_graphs")  # the start-up targets' references
MEASURE_ESTIMATE_S = 30.0  # import + one point + exit, added to a cold start's estimate
WARM_STARTUP_GUESS_S = 20.0  # a first warm start's start-up, before one was measured
PRIME_TIMEOUT_S = 300.0

PRIME_CODE = """
import json, sys, time
t0 = time.perf_counter()
import torch
cuda = torch.cuda.is_available()
if cuda:
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
t1 = time.perf_counter()
import vllm
from vllm.engine.arg_utils import EngineArgs
try:
    import vllm_moe_graphs.integration.worker  # noqa: F401 - its modules' bytecode, once
except Exception:
    pass
t2 = time.perf_counter()
EngineArgs(model=sys.argv[1], load_format="dummy", skip_tokenizer_init=True,
           dtype="bfloat16").create_model_config()
t3 = time.perf_counter()
print("PRIME " + json.dumps({"torch_cuda_s": t1 - t0, "import_s": t2 - t1,
                             "model_config_s": t3 - t2, "cuda": cuda}), flush=True)
"""


def cache_env(root: Path) -> dict[str, str]:
    """Environment that points every compile / kernel cache a vLLM start reads under `root`."""
    return {
        "VLLM_CACHE_ROOT": str(root / "vllm"),
        "TRITON_CACHE_DIR": str(root / "triton" / "cache"),
        "TRITON_HOME": str(root / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "XDG_CACHE_HOME": str(root / "xdg"),
        "CUDA_CACHE_PATH": str(root / "nv"),
    }


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.startup",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", default="qwen3-0.6b", choices=list(MODELS),
                    help="model shape (default: qwen3-0.6b)")
    ap.add_argument("--modes", type=lambda t: [v for v in t.replace(" ", "").split(",") if v],
                    default=list(DEFAULT_MODES),
                    help=f"comma-separated modes (default: {','.join(DEFAULT_MODES)})")
    ap.add_argument("--cold-rounds", type=int, default=1,
                    help="cold starts per mode, each with new empty caches, the first mode "
                    "rotating from round to round (default: 1)")
    ap.add_argument("--warm-rounds", type=int, default=2,
                    help="warm starts per mode after its cold ones (default: 2)")
    ap.add_argument("--batch", type=int, default=8, help="requests of the first point (default 8)")
    ap.add_argument("--context", type=int, default=512,
                    help="prompt tokens of the first point (default 512)")
    ap.add_argument("--decode-tokens", type=int, default=32,
                    help="timed decode steps of the first point (default 32)")
    ap.add_argument("--warmup-steps", type=int, default=4,
                    help="decode steps before timing (default 4)")
    ap.add_argument("--num-layers", type=int, default=None,
                    help="cut the shape to this many layers (default: full depth)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                    help="vLLM gpu_memory_utilization (default 0.85)")
    ap.add_argument("--seed", type=int, default=0, help="vLLM and prompt seed (default 0)")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="stop starting engines when this would be exceeded (default: none)")
    ap.add_argument("--mode-timeout-s", type=float, default=900.0,
                    help="kill one start's worker after this many seconds (default 900)")
    ap.add_argument("--name", default="startup", help="result name: <results-dir>/<name>.json")
    ap.add_argument("--results-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    ap.add_argument("--log-dir", type=Path, default=None,
                    help="worker logs, specs, caches (default: a new temp dir)")
    ap.add_argument("--allow-cpu", action="store_true",
                    help="harness self-test on vLLM's CPU build: no GPU check, workers get "
                    "--allow-cpu")
    return ap


def validate_args(args: argparse.Namespace) -> list[Mode]:
    modes = parse_modes(args.modes)
    if args.cold_rounds < 1:
        raise ValueError(f"--cold-rounds must be >= 1, got {args.cold_rounds}")
    if args.warm_rounds < 0:
        raise ValueError(f"--warm-rounds must be >= 0, got {args.warm_rounds}")
    for name in ("batch", "context", "decode_tokens"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    absent = {m.name: m.available().text() for m in modes if not m.available().ok}
    if absent:
        raise ValueError("mode(s) not available: "
                         + "; ".join(f"{k}: {v}" for k, v in absent.items()))
    return modes


def schedule(modes: list[Mode], warm_rounds: int, cold_rounds: int = 1
             ) -> list[tuple[int, Mode]]:
    """(round, mode) in start order: rounds 0 .. cold_rounds - 1 are cold, round k starting
    with mode k (modulo their count); then the warm rounds, the first of them starting with
    the second mode, each further one with the next."""
    cold = [(r, m) for r in range(cold_rounds) for m in sweep.rotation(modes, r)]
    return cold + [(cold_rounds - 1 + w, m) for w in range(1, warm_rounds + 1)
                   for m in sweep.rotation(modes, w)]


def cache_dir(work_dir: Path, mode: str, rnd: int, cold_rounds: int) -> Path:
    """The caches of a start: new ones for each cold round, the last cold round's when warm."""
    return work_dir / f"cache-{mode}-c{min(rnd, cold_rounds - 1)}"


def prime(config_dir: Path, work_dir: Path, allow_cpu: bool) -> dict[str, Any]:
    """Pay the machine's one-time costs in a throwaway process (see the module docstring)."""
    env = {**os.environ, **cache_env(work_dir / "cache-prime"), "VLLM_PLUGINS": ""}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    t0 = time.monotonic()
    try:
        out = subprocess.run([sys.executable, "-c", PRIME_CODE, str(config_dir)], cwd=REPO_ROOT,
                             env=env, capture_output=True, text=True, timeout=PRIME_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {PRIME_TIMEOUT_S:.0f} s"}
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("PRIME ")), None)
    if line is None:
        return {"error": f"exit {out.returncode}: {(out.stderr or out.stdout)[-1500:]}"}
    facts = json.loads(line[len("PRIME "):])
    if not allow_cpu and not facts.get("cuda"):
        return {"error": "CUDA not available in the prime process"}
    return {**facts, "wall_s": round(time.monotonic() - t0, 2)}


JIT_RECORD = re.compile(r"Triton kernel JIT compilation during inference: (\w+)")


def jit_in_requests(log_text: str) -> list[str]:
    """Kernels vLLM's JIT monitor saw compiled after the engine was ready (while requests ran):
    work a start left to the first requests."""
    return sorted(set(JIT_RECORD.findall(log_text)))


def run_row(result: WorkerResult, rnd: int, cold: bool, order: int, wall_s: float,
            error: str | None, log_text: str = "") -> dict[str, Any]:
    point = result.points[0] if result.points else None
    first = None
    if point is not None and point.point_s:
        first = {"batch": point.batch, "context": point.context, "wall_s": point.point_s[0],
                 "prefill_s": point.prefill_s[0] if point.prefill_s else None,
                 "tpot_p50_ms": point.repeat_p50_ms[0] if point.repeat_p50_ms else None}
    return {
        "mode": result.mode, "round": rnd, "cache": "cold" if cold else "warm",
        "order": order, "status": result.status, "error": error,
        "import_s": result.import_s, "startup_s": result.startup_s,
        "init_engine_s": result.resolved.get("init_engine_s"), "compile_s": result.compile_s,
        "capture_s": result.capture_s, "graph_mem_mib": result.graph_mem_mib,
        "runner": result.runner, "cudagraph_mode": result.resolved.get("cudagraph_mode"),
        "first_point": first, "jit_in_requests": jit_in_requests(log_text),
        "worker_wall_s": round(wall_s, 2),
    }


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def summarise(runs: list[dict[str, Any]], modes: list[Mode]) -> dict[str, Any]:
    """Per mode and cache state: start-up and first-point medians; each plugin mode's start-up
    against the reference stock modes, with the start-up targets."""
    per_mode: dict[str, dict[str, Any]] = {}
    for m in modes:
        entry: dict[str, Any] = {}
        for cache in ("cold", "warm"):
            ok = [r for r in runs if r["mode"] == m.name and r["cache"] == cache
                  and r["startup_s"] is not None]
            starts = [r["startup_s"] for r in ok]
            firsts = [r["first_point"]["wall_s"] for r in ok if r["first_point"]]
            entry[cache] = {"n": len(ok), "startup_s": _median(starts),
                            "startup_samples_s": [round(s, 3) for s in starts],
                            "first_point_s": _median(firsts),
                            "jit_in_requests": sorted({k for r in ok
                                                       for k in r["jit_in_requests"]}),
                            "ready_and_first_point_s": _median(
                                [r["startup_s"] + r["first_point"]["wall_s"]
                                 for r in ok if r["first_point"]])}
        per_mode[m.name] = entry
    verdicts = []
    for m in modes:
        if m.family is not Family.PLUGIN:
            continue
        for cache in ("cold", "warm"):
            mine = per_mode[m.name][cache]["startup_s"]
            refs = {r: per_mode.get(r, {}).get(cache, {}).get("startup_s") for r in
                    REFERENCE_MODES}
            nc, graphs = refs["stock_full_decode_nc"], refs["stock_graphs"]
            if mine is None or (nc is None and graphs is None):
                continue
            # NOTE: each target is judged against the reference that ran (a call's budget
            # often leaves stock_graphs out); a reference that did not run has no entry.
            verdict: dict[str, Any] = {"mode": m.name, "cache": cache, "startup_s": mine}
            if nc is not None:
                verdict.update(vs_stock_full_decode_nc=round(mine / nc, 3),
                               not_slower_than_nc=mine <= nc)
            if graphs is not None:
                verdict.update(vs_stock_graphs=round(mine / graphs, 3),
                               under_third_of_stock_graphs=mine < graphs / 3)
            verdicts.append(verdict)
    return {"modes": per_mode, "targets": verdicts}


def format_table(doc: dict[str, Any]) -> str:
    lines = ["", "start-up to ready (s), median [samples]; first point wall (s); both: ready + "
             "first point", f"{'mode':<24}{'cold':>10}{'warm':>10}  cold / warm samples"
             f"{'':<7}{'1st pt cold':>12}{'1st pt warm':>12}{'both warm':>11}"]

    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    for name, e in doc["summary"]["modes"].items():
        c, w = e["cold"], e["warm"]
        samples = " / ".join(", ".join(f"{s:.1f}" for s in e[k]["startup_samples_s"]) or "-"
                             for k in ("cold", "warm"))
        lines.append(f"{name:<24}{f(c['startup_s']):>10}{f(w['startup_s']):>10}  {samples:<26}"
                     f"{f(c['first_point_s']):>12}{f(w['first_point_s']):>12}"
                     f"{f(w['ready_and_first_point_s']):>11}")
    for name, e in doc["summary"]["modes"].items():
        jit = sorted(set(e["cold"]["jit_in_requests"]) | set(e["warm"]["jit_in_requests"]))
        if jit:
            lines.append(f"{name}: Triton compiles after ready (vLLM's JIT monitor): "
                         + ", ".join(jit))
    for v in doc["summary"]["targets"]:
        parts = []
        if "vs_stock_full_decode_nc" in v:
            parts.append(f"{v['vs_stock_full_decode_nc']:.2f}x stock_full_decode_nc ("
                         f"{'met' if v['not_slower_than_nc'] else 'NOT met'}: not slower)")
        if "vs_stock_graphs" in v:
            parts.append(f"{v['vs_stock_graphs']:.2f}x stock_graphs ("
                         f"{'met' if v['under_third_of_stock_graphs'] else 'NOT met'}: under "
                         "a third)")
        lines.append(f"{v['mode']} {v['cache']}: " + ", ".join(parts))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    t_start = time.time()
    modes = validate_args(args)
    if not args.allow_cpu:
        problem = machine.gpu_problem()
        if problem:
            print(f"error: this benchmark needs an NVIDIA GPU: {problem}", file=sys.stderr)
            return EXIT_NO_GPU
    work_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="startup-bench-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    t_end = None if args.time_budget_s is None else t_start + args.time_budget_s - sweep.RESERVE_S
    config_dir, layers = prepare_config_dir(args.model, args.num_layers, work_dir)
    cfg = read_config(config_dir)
    mml = sweep.max_model_len([args.context], [args.batch], args.decode_tokens,
                              args.warmup_steps)
    common = common_llm_kwargs(config_dir=str(config_dir), max_num_seqs=args.batch,
                               max_model_len=mml, seed=args.seed,
                               gpu_memory_utilization=args.gpu_memory_utilization)
    print(f"start-up benchmark: {args.model}, modes {', '.join(m.name for m in modes)}, "
          f"{args.cold_rounds} cold and {args.warm_rounds} warm round(s); logs and caches in "
          f"{work_dir}", flush=True)
    primed = prime(config_dir, work_dir, args.allow_cpu)
    print(f"[startup] prime: {primed}", flush=True)
    if "error" in primed:
        print(f"error: the prime process failed: {primed['error']}", file=sys.stderr)
        return EXIT_NO_ROWS
    extra_args = ("--allow-cpu",) if args.allow_cpu else ()
    runs: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    results: list[WorkerResult] = []
    estimates: dict[str, float] = {}  # the estimated wall of a mode's next start
    plan = schedule(modes, args.warm_rounds, args.cold_rounds)
    for order, (rnd, mode) in enumerate(plan):
        cold = rnd < args.cold_rounds
        now = time.time()
        est = estimates.get(mode.name, mode.startup_estimate_s + MEASURE_ESTIMATE_S)
        if t_end is not None and t_end - now < est:
            why = f"time budget: {t_end - now:.0f} s left < estimate {est:.0f} s"
            print(f"[startup] skip {mode.name} round {rnd}: {why}", flush=True)
            skipped.append({"mode": mode.name, "round": rnd, "reason": why})
            continue
        spec = WorkerSpec(
            model=args.model, config_dir=str(config_dir), mode=mode.name,
            llm_kwargs=mode.llm_kwargs(common),
            env={**mode.worker_env(),
                 **cache_env(cache_dir(work_dir, mode.name, rnd, args.cold_rounds))},
            batches=[args.batch], contexts=[args.context], repeats=1,
            decode_tokens=args.decode_tokens, warmup_steps=args.warmup_steps,
            vocab_size=int(cfg["vocab_size"]), seed=args.seed,
            result_path=str(work_dir / f"result-{mode.name}-r{rnd}.json"), round=rnd,
            hard_deadline=t_end)
        limit = args.mode_timeout_s if t_end is None else min(args.mode_timeout_s,
                                                              t_end - now + worker_process.KILL_GRACE_S)
        print(f"[startup] {order + 1}. {mode.name} {'cold' if cold else 'warm'} "
              f"(round {rnd})", flush=True)
        t0 = time.monotonic()
        result, error = worker_process.run_worker(spec, work_dir, limit, extra_args)
        wall = time.monotonic() - t0
        # The next start of this mode: after its last cold one (warm next), that wall minus the
        # cold start-up plus a guess of a warm start-up; otherwise the wall just measured.
        estimates[mode.name] = wall if rnd != args.cold_rounds - 1 else max(
            0.0, wall - (result.startup_s or 0.0)) + WARM_STARTUP_GUESS_S
        results.append(result)
        log = work_dir / f"log-{args.model}-{mode.name}{f'-r{rnd}' if rnd else ''}.txt"
        row = run_row(result, rnd, cold, order, wall, error,
                      log.read_text(errors="replace") if log.is_file() else "")
        runs.append(row)
        first = row["first_point"]
        print(f"[startup] {mode.name} round {rnd}: {result.status}, start-up "
              f"{_fmt(result.startup_s)} s, first point "
              f"{_fmt(first and first['wall_s'])} s, worker {wall:.1f} s"
              + (f", JIT in requests: {', '.join(row['jit_in_requests'])}"
                 if row["jit_in_requests"] else "")
              + (f", error: {error.splitlines()[0]}" if error else ""), flush=True)
    env = machine.environment(args, results, {args.model: layers}, [])
    doc = {"name": args.name, "kind": "startup", "env": env,
           "protocol": {"prime": primed, "cache_env": sorted(cache_env(Path("/x"))),
                        "cold_rounds": args.cold_rounds,
                        "schedule": [[r, m.name] for r, m in plan]},
           "runs": runs, "skipped": skipped, "summary": summarise(runs, modes)}
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / f"{args.name}.json"
    write_json_atomic(path, doc)
    print(f"wrote {path}", flush=True)
    print(format_table(doc), flush=True)
    return 0 if any(r["startup_s"] is not None for r in runs) else EXIT_NO_ROWS


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return run(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE

