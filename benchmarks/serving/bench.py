"""`python -m benchmarks.serving`: the run (every mode's servers started, settled, warmed up,
measured window by window and stopped; the result written after each mode) and the `merge`,
`targets` and `--plot` commands. What it measures and writes: `options.DESCRIPTION`, its --help.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.harness.machine import environment, gpu_problem
from benchmarks.serving import report, targets
from benchmarks.serving.load import Workload, plan_window, run_window, summarize
from benchmarks.serving.options import RESERVE_S, Plan, mode_cost_s, parser, plan_text, \
    warmup_rates, window_s
from benchmarks.serving.server import IDLE_CAPTURE_DONE, IDLE_CAPTURE_ON, Server, ServeMode, \
    log_facts, step_shares

EXIT_NO_ROWS, EXIT_USAGE, EXIT_NO_GPU = 1, 2, 3


def _say(t0: float, text: str) -> None:
    print(f"[serve +{time.monotonic() - t0:5.0f}s] {text}", flush=True)


def run_mode(plan: Plan, mode: ServeMode, args: argparse.Namespace, pool: ProcessPoolExecutor,
             t0: float, deadline: float | None) -> tuple[list[dict[str, Any]], dict[str, Any],
                                                          list[str]]:
    """Every server of one mode: start, warm up, measure each workload x rate, stop."""
    rows, facts, skipped = [], {}, []
    for server_kind in plan.servers():
        kind_workloads = [(w, rs) for w, rs in plan.workloads if w.server == server_kind]
        sargs = plan.server_args(mode, server_kind, args.server_arg, args.offload_gb)
        log = plan.work_dir / f"serve-{plan.model}-{mode.name}-{server_kind}.log"
        env = plan.server_env(mode)
        server = Server(plan.model_dir, sargs, env, log)
        _say(t0, f"{mode.name}/{server_kind}: starting vllm serve {' '.join(sargs)}")
        info: dict[str, Any] = {"args": sargs, "env": env, "log": log.name}
        facts[server_kind] = info
        try:
            limit = args.start_timeout_s if deadline is None else max(
                1.0, min(args.start_timeout_s, deadline - time.monotonic()))
            info["ready_s"] = round(server.start(limit), 1)
            info.update(log_facts(server.log_text()))
            _say(t0, f"{mode.name}/{server_kind}: ready in {info['ready_s']} s; attention "
                     f"{info['attention_backend']}, cudagraph {info['cudagraph_mode']}, "
                     f"compile {info['compilation_mode']}, plugin "
                     f"{'yes' if info['plugin'] else 'no'}, KV cache "
                     f"{info['kv_cache_tokens'] or '?'} tokens")
            if plan.settles(mode):
                _settle(server, args, info, lambda m: _say(t0, f"{mode.name}/{server_kind}: {m}"))
            info["warmup"] = {}
            for w, rs in kind_workloads:
                for i, rate in enumerate(warmup_rates(args, rs) if args.warmup_s > 0 else []):
                    reqs = plan_window(w, rate, args.warmup_s, args.clients,
                                       args.seed + 1000 + i, plan.vocab_size)
                    recs, wall = run_window(pool, args.clients, server.base_url, plan.model,
                                            reqs, args.drain_timeout_s)
                    s = summarize(recs, rate)
                    info["warmup"].setdefault(w.name, []).append(
                        {"rate": rate, "requests": s["requests"], "failed": s["failed"],
                         "wall_s": round(wall, 1)})
                    _say(t0, f"{mode.name}: warm-up {w.name} r{rate:g}: "
                             f"{s['completed']}/{s['requests']} in {wall:.1f} s")
                for rate in rs:
                    where = f"{mode.name}/{w.name}/r{rate:g}"
                    if deadline is not None and time.monotonic() + window_s(args, rate) \
                            > deadline:
                        skipped.append(f"{where}: time budget")
                        _say(t0, f"{where}: skipped (time budget)")
                        continue
                    if not server.alive():
                        skipped.append(f"{where}: server exited")
                        continue
                    try:
                        rows.append(_measure(plan, mode, w, rate, server, pool, args))
                    except Exception as exc:  # noqa: BLE001 - a broken window, not the run
                        skipped.append(f"{where}: {type(exc).__name__}: {exc}")
                        _say(t0, f"{where}: FAILED: {type(exc).__name__}: {exc}")
                        continue
                    _say(t0, _progress(rows[-1]))
        except Exception as exc:  # noqa: BLE001 - this server's failure, not the run's
            info["error"] = (str(exc).splitlines() or [type(exc).__name__])[0]
            skipped.append(f"{mode.name}/{server_kind}: {info['error']}")
            _say(t0, f"{mode.name}/{server_kind}: FAILED: {exc}")
        finally:
            server.stop()
            info.setdefault("attention_backend", log_facts(server.log_text())["attention_backend"])
    return rows, facts, skipped


def _settle(server: Server, args: argparse.Namespace, info: dict[str, Any],
            say: Callable[[str], None]) -> None:
    """Wait for the plugin's idle capture to finish (its IDLE_CAPTURE_DONE line): `settle_s`,
    the seconds from ready until then, or None when it did not finish within
    --settle-timeout-s or the server does not capture while idle (its start-up log says when
    graphs are captured: no graphs on this machine, or all of them at start-up with
    precapture)."""
    if IDLE_CAPTURE_ON not in server.log_text():
        info["settle_s"] = None
        say("nothing to settle: the server does not capture graphs while idle (its log)")
        return
    t0 = time.monotonic()
    settled = server.wait_for_log(IDLE_CAPTURE_DONE, args.settle_timeout_s,
                                  stall_s=args.settle_stall_s)
    info["settle_s"] = None if settled is None else round(settled, 1)
    if settled is not None:
        say(f"settled {info['settle_s']} s after ready ({IDLE_CAPTURE_DONE!r})")
        return
    waited = time.monotonic() - t0
    why = (f"within {args.settle_timeout_s:g} s" if waited > args.settle_timeout_s else
           f"after {waited:.0f} s: no capture in the last {args.settle_stall_s:g} s")
    say(f"not settled {why} ({IDLE_CAPTURE_DONE!r} not logged); measuring anyway")


def _measure(plan: Plan, mode: ServeMode, w: Workload, rate: float, server: Server,
             pool: ProcessPoolExecutor, args: argparse.Namespace) -> dict[str, Any]:
    reqs = plan_window(w, rate, args.duration_s, args.min_requests, args.seed, plan.vocab_size)
    before = server.scrape()
    recs, wall = run_window(pool, args.clients, server.base_url, plan.model, reqs,
                            args.drain_timeout_s)
    after = server.scrape()
    row = {"model": plan.model, "mode": mode.name, "workload": w.name, **summarize(recs, rate),
           "wall_s": round(wall, 1), "steps": step_shares(before, after)}
    return row


def _progress(r: dict[str, Any]) -> str:
    share = r["steps"].get("replayed_share")
    text = (f"{r['mode']}/{r['workload']}/r{r['rate']:g}: {r['completed']}/{r['requests']} ok, "
            f"ttft p50 {r['ttft_ms']['p50']} ms, tpot p50 {r['tpot_ms']['p50']} ms, "
            f"{r['output_tokens_per_s']} tok/s, lag p99 {r['send_lag_ms']['p99']} ms, "
            f"{r['steps']['engine_steps']} steps")
    if share is not None:
        text += f", replayed {share:.0%} eager {r['steps']['eager']}"
        if r["steps"].get("padding_share"):
            text += f", padding {r['steps']['padding_share']}"
        if r["steps"].get("captures"):
            text += (f", {r['steps']['captures']} captures "
                     f"({r['steps'].get('capture_s_by_kind', {})} s, "
                     f"{r['steps'].get('step_captures', '?')} inside steps)")
    if r["client_lagging"]:
        text += " -- CLIENT LAGGING: raise --clients"
    return text


def run(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    plan = Plan(args)
    if args.dry_run:
        print(plan_text(plan, args), flush=True)
        if args.log_dir is None:  # it held only the shape's config directory
            shutil.rmtree(plan.work_dir, ignore_errors=True)
        return 0
    if not args.allow_cpu and (problem := gpu_problem()):
        print(f"error: the serving benchmark needs an NVIDIA GPU: {problem}. Run it on a GPU "
              f"machine (docs/benchmarking.md), or pass --allow-cpu with vLLM's CPU build.",
              file=sys.stderr, flush=True)
        return EXIT_NO_GPU
    deadline = None if args.time_budget_s is None else t0 + args.time_budget_s - RESERVE_S
    _say(t0, f"{plan.model} ({plan.layers} layers), modes {[m.name for m in plan.modes]}, "
             f"workloads {[(w.name, rs) for w, rs in plan.workloads]}, logs in {plan.work_dir}")
    rows: list[dict[str, Any]] = []
    modes: dict[str, Any] = {}
    skipped: list[str] = []
    env = environment(args, [], {plan.model: plan.layers}, [])
    workloads = report.workloads_section(plan.workloads)
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=args.clients, mp_context=ctx) as pool:
        costs = [mode_cost_s(plan, m, args) for m in plan.modes]
        for i, mode in enumerate(plan.modes):
            share = None if deadline is None else time.monotonic() + (
                deadline - time.monotonic()) * costs[i] / sum(costs[i:])
            mode_rows, facts, mode_skipped = run_mode(plan, mode, args, pool, t0, share)
            rows += mode_rows
            skipped += mode_skipped
            modes[mode.name] = {"description": mode.description, "servers": facts}
            # after every mode: a run cut short keeps what it measured
            doc = report.assemble(plan.name, plan.model, env, workloads, modes, rows, skipped)
            report.write(doc, args.results_dir)
    doc = report.assemble(plan.name, plan.model, env, workloads, modes, rows, skipped)
    return report.finish(doc, args.results_dir, args.no_plot)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["merge"]:
            mp = argparse.ArgumentParser(prog="python -m benchmarks.serving merge")
            mp.add_argument("files", nargs="+")
            mp.add_argument("--name", required=True)
            mp.add_argument("--results-dir", type=Path, default=Path("benchmarks/results"))
            a = mp.parse_args(argv[1:])
            return report.merge(a.files, a.name, a.results_dir)
        if argv[:1] == ["targets"]:
            tp = argparse.ArgumentParser(
                prog="python -m benchmarks.serving targets",
                description="the README's headline rows and every serving target missed, "
                "from result files (benchmarks/serving/targets.py)")
            tp.add_argument("files", nargs="+")
            print(targets.report(tp.parse_args(argv[1:]).files), flush=True)
            return 0
        if argv[:1] == ["--plot"] and len(argv) == 2:
            doc = json.loads(Path(argv[1]).read_text())
            report.check_schema(doc)
            return 0 if report.render(doc, Path(argv[1]).with_suffix(".png")) else EXIT_NO_ROWS
        return run(parser().parse_args(argv))
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE

