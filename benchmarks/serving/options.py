"""The serving benchmark's command line and the plan it makes: the options (`parser`, with the
modes, workloads and default rates in its epilog), their check into a `Plan` (model directory,
workloads with their rates and lengths, modes, each server's `vllm serve` flags), and the rough
cost of each mode that shares out --time-budget-s and that --dry-run prints (`plan_text`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness.shapes import SHAPES, Shape, prepare_config_dir, read_config, shape
from benchmarks.serving.load import WORKLOADS, Workload, parse_workloads, window_requests
from benchmarks.serving.server import DEFAULT_MODES, IDLE_CAPTURE_ESTIMATE_S, \
    OFFLOAD_READY_EXTRA_S, SERVE_MODES, ServeMode, parse_modes, plugin_settings, settings_args
from vllm_moe_graphs.config import PluginConfig

DESCRIPTION = """\
Serving benchmark: TTFT / TPOT / ITL / throughput of a real `vllm serve` under Poisson traffic,
the plugin against stock vLLM, side by side in one run.

For each mode (plugin, stock = the H200 default FLASH_ATTN, stock_triton) it starts `vllm serve`
on a shipped Qwen3 shape with dummy weights and no tokenizer (prompts are token ids), waits for
/health, warms up (the same warm-up in every mode: each workload for --warmup-s at each of its
rates, or only its highest with --warmup-rates max), then offers each workload at each rate for
--duration-s (Poisson arrivals, seeded: every mode gets the same requests), reads the engine's
step counters from /metrics around each window, and stops the server. `moe_offload` runs on a
second server of the mode with `--cpu-offload-gb N --cpu-offload-params experts`.

Results: <results-dir>/<name>.json (env, per-mode server facts, rows, ratios, saturation) and
<name>.png; the table is printed last. See docs/benchmarking.md.
"""  # `python -m benchmarks.serving --help`
RESERVE_S = 20.0  # kept back from --time-budget-s for writing the results
DEFAULT_RATES: dict[str, dict[str, list[float]]] = {  # req/s, up to where each shape saturates
    model: {**rates, "chat_sampled": rates["chat"]}  # chat's arrivals, sampled
    for model, rates in {
        "qwen3-0.6b": {"chat": [4, 16, 32, 64, 96], "long": [2, 4, 8, 16]},
        "qwen3-8b": {"chat": [2, 4, 8, 16], "long": [0.5, 1, 2, 4]},
        "qwen3-30b-a3b": {"chat": [4, 8, 16, 32, 48], "long": [1, 2, 4, 6],
                          "moe_offload": [0.25, 0.5]},
    }.items()
}
# an FP8 variant (qwen3-30b-a3b-fp8, ...) offers its shipped shape's rates
DEFAULT_RATES.update({name: DEFAULT_RATES[shape(name).base] for name in SHAPES
                      if name not in DEFAULT_RATES})


def _rates(text: str) -> tuple[str, list[float]]:
    """`chat:4,16,32` -> ("chat", [4.0, 16.0, 32.0])."""
    name, _, values = text.partition(":")
    try:
        rates = sorted({float(v) for v in values.split(",") if v.strip()})
    except ValueError:
        rates = []
    if not name or not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(
            f"expected WORKLOAD:RATE[,RATE...] with positive rates, e.g. chat:4,16, got {text!r}")
    return name, rates


def _lengths(text: str) -> tuple[str, tuple[int, int], tuple[int, int]]:
    """`chat:16-64:4-8` -> ("chat", (16, 64), (4, 8))."""
    try:
        name, prompt, output = text.split(":")
        p = tuple(int(v) for v in prompt.split("-"))
        o = tuple(int(v) for v in output.split("-"))
        assert len(p) == len(o) == 2 and 1 <= p[0] <= p[1] and 1 <= o[0] <= o[1]
    except (ValueError, AssertionError):
        raise argparse.ArgumentTypeError(
            f"expected WORKLOAD:PMIN-PMAX:OMIN-OMAX, e.g. chat:128-1024:128-256, got {text!r}"
        ) from None
    return name, p, o  # type: ignore[return-value]


def _plugin_config(text: str) -> dict[str, Any]:
    """--plugin-config: a JSON object the plugin's own parser accepts."""
    try:
        settings = json.loads(text)
        PluginConfig.from_dict(settings)
    except ValueError as exc:  # json.JSONDecodeError is one
        raise argparse.ArgumentTypeError(
            f"expected a JSON object of moe_graphs settings, e.g. "
            f"'{{\"skip_moe_padding\": true}}', got {text!r}: {exc}") from None
    return settings


def _csv(text: str) -> list[str]:
    return [v for v in text.replace(" ", "").split(",") if v]


def _row(name: str, text: str, width: int = 20) -> str:
    """One epilog row: `name` in a column of `width`, or on a line of its own when longer."""
    if len(name) < width:
        return f"  {name:<{width}}{text}"
    return f"  {name}\n  {'':<{width}}{text}"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.serving", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join([
            "modes:", *(_row(m.name, m.description) for m in SERVE_MODES.values()), "",
            "workloads:", *(_row(w.name, w.description) for w in WORKLOADS.values()), "",
            "default rates (req/s):",
            *(_row(m, "; ".join(f"{w} {','.join(f'{r:g}' for r in rs)}" for w, rs in d.items()))
              for m, d in DEFAULT_RATES.items()),
            "", "merge: python -m benchmarks.serving merge A.json B.json ... --name NAME "
            "[--results-dir DIR]: rows of later files win on the same mode/workload/rate.",
            "plot:  python -m benchmarks.serving --plot RESULT.json: redraw the PNG.",
            "targets: python -m benchmarks.serving targets RESULT.json ...: the README's headline "
            "rows, every serving target a file misses and the coverage it lacks (no GPU "
            "needed).",
            "exit codes: 0 rows measured, 1 none, 2 usage, 3 no GPU (see --allow-cpu)."]))
    ap.add_argument("--model", default="qwen3-0.6b",
                    help=f"shape ({', '.join(SHAPES)}: a shipped config, or its FP8 variant "
                    "with block FP8 weights, -kv8 with an FP8 KV cache too, every mode on the "
                    "same flags) or a model directory with a config.json (default: qwen3-0.6b)")
    ap.add_argument("--num-layers", type=int, default=None,
                    help="cut a shipped shape to this many layers (default: all)")
    ap.add_argument("--modes", type=_csv, default=list(DEFAULT_MODES),
                    help=f"comma-separated (default: {','.join(DEFAULT_MODES)})")
    ap.add_argument("--workloads", type=_csv, default=None,
                    help="comma-separated (default: chat,long, plus moe_offload for a MoE shape)")
    ap.add_argument("--rates", type=_rates, action="append", default=[],
                    help="WORKLOAD:R1,R2,... requests/s; repeat per workload (default: the "
                    "shape's, below)")
    ap.add_argument("--lengths", type=_lengths, action="append", default=[],
                    help="WORKLOAD:PMIN-PMAX:OMIN-OMAX overrides a workload's prompt and output "
                    "lengths (tokens)")
    ap.add_argument("--duration-s", type=float, default=10.0,
                    help="arrival window per rate, seconds (default: 10)")
    ap.add_argument("--min-requests", type=int, default=24,
                    help="requests per window at least, whatever the rate (default: 24)")
    ap.add_argument("--warmup-s", type=float, default=4.0,
                    help="warm-up per workload and warm-up rate, seconds (default: 4)")
    ap.add_argument("--warmup-rates", choices=("all", "max"), default="all",
                    help="warm each workload up at every rate it is measured at (all: the "
                    "plugin's lazily captured graphs of each rate's step sizes are in place "
                    "before anything is timed) or only at its highest (max) (default: all)")
    ap.add_argument("--drain-timeout-s", type=float, default=90.0,
                    help="after a window's last arrival, wait this long for its requests; "
                    "unfinished ones count as failed (default: 90)")
    ap.add_argument("--clients", type=int, default=4,
                    help="client processes sending the load (default: 4)")
    ap.add_argument("--seed", type=int, default=0, help="request seed (default: 0)")
    ap.add_argument("--offload-gb", type=float, default=29.0,
                    help="--cpu-offload-gb of the moe_offload server (default: 29, half of "
                    "Qwen3-30B-A3B's experts)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra `vllm serve` flag for every mode, repeatable (e.g. "
                    "--server-arg=--max-num-seqs=256)")
    ap.add_argument("--start-timeout-s", type=float, default=600.0,
                    help="longest wait for a server's /health (default: 600)")
    ap.add_argument("--plugin-config", type=_plugin_config, default={},
                    help="JSON object of moe_graphs settings for every plugin mode, under each "
                    "mode's own (e.g. '{\"warmup_steps\": 0}' to measure another "
                    "configuration as `plugin`); recorded with each server's flags (default: "
                    "none)")
    ap.add_argument("--settle-timeout-s", type=float, default=300.0,
                    help="longest wait after /health for a mode's after-ready work, e.g. "
                    "the plugin's idle capture (default: 300)")
    ap.add_argument("--settle-stall-s", type=float, default=30.0,
                    help="stop that wait early once the plugin's capture count on /metrics "
                    "has not changed for this many seconds (default: 30; one capture takes "
                    "well under a second on the H200)")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="stop starting windows that would not end within this many seconds "
                    "(default: no limit); shared by the modes left, weighted by their expected "
                    "cost (start-up estimate, warm-ups, windows)")
    ap.add_argument("--name", default=None, help="result name (default: serve-<model>)")
    ap.add_argument("--results-dir", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--log-dir", type=Path, default=None,
                    help="server logs (default: a temporary directory)")
    ap.add_argument("--allow-cpu", action="store_true",
                    help="run without an NVIDIA GPU (vLLM's CPU build; plumbing tests only)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the plan (servers, warm-ups, windows and their requests, the "
                    "rough wall time of each mode and whether it fits --time-budget-s) and "
                    "exit; needs no GPU")
    return ap


class Plan:
    """The checked options: model directory, workloads with their rates, modes."""

    def __init__(self, args: argparse.Namespace) -> None:
        if args.clients < 1 or args.min_requests < 1:
            raise ValueError(f"--clients and --min-requests must be >= 1, got {args.clients} "
                             f"and {args.min_requests}")
        if args.duration_s <= 0 or args.warmup_s < 0 or args.drain_timeout_s <= 0:
            raise ValueError("--duration-s and --drain-timeout-s must be > 0 and --warmup-s "
                             f">= 0, got {args.duration_s}, {args.drain_timeout_s}, "
                             f"{args.warmup_s}")
        if args.settle_timeout_s < 0:
            raise ValueError(f"--settle-timeout-s must be >= 0, got {args.settle_timeout_s}")
        if args.settle_stall_s <= 0:
            raise ValueError(f"--settle-stall-s must be > 0, got {args.settle_stall_s}")
        self.modes: list[ServeMode] = parse_modes(args.modes)
        self.work_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="serve-bench-"))
        self.shape: Shape | None = None
        if args.model in SHAPES:
            self.model, self.shape = args.model, shape(args.model)
            self.model_dir, self.layers = prepare_config_dir(args.model, args.num_layers,
                                                             self.work_dir)
        elif (Path(args.model) / "config.json").is_file():
            if args.num_layers is not None:
                raise ValueError("--num-layers applies to shipped shapes only")
            self.model, self.model_dir = Path(args.model).name, Path(args.model)
            self.layers = int(read_config(self.model_dir)["num_hidden_layers"])
        else:
            raise ValueError(f"--model {args.model!r} is neither a shape "
                             f"({', '.join(SHAPES)}) nor a directory with a config.json")
        cfg = read_config(self.model_dir)
        self.vocab_size = int(cfg["vocab_size"])
        moe = bool(cfg.get("num_experts"))
        names = args.workloads or (["chat", "long"] + (["moe_offload"] if moe else []))
        workloads = parse_workloads(names)
        if not moe and any(w.server == "moe_offload" for w in workloads):
            raise ValueError(f"workload moe_offload needs a MoE model; {self.model} has no experts")
        lengths = {name: (p, o) for name, p, o in args.lengths}
        rates = {**DEFAULT_RATES.get(self.model, {}), **dict(args.rates)}
        for name in list(lengths) + list(dict(args.rates)):
            if name not in names:
                raise ValueError(f"--lengths/--rates name workload {name!r}, which is not run "
                                 f"(--workloads {','.join(names)})")
        self.workloads: list[tuple[Workload, list[float]]] = []
        for w in workloads:
            if w.name not in rates:
                raise ValueError(f"no rates for workload {w.name!r} of {self.model}: pass "
                                 f"--rates {w.name}:R1,R2,...")
            if w.name in lengths:
                w = dataclasses.replace(w, prompt_len=lengths[w.name][0],
                                        output_len=lengths[w.name][1])
            self.workloads.append((w, rates[w.name]))
        self.name = args.name or f"serve-{self.model}"
        self.plugin_config: dict[str, Any] = args.plugin_config

    def settles(self, mode: ServeMode) -> bool:
        """Whether the mode's servers capture while idle after ready (`bench._settle` waits)."""
        settings = plugin_settings(mode, self.plugin_config)
        return settings is not None and PluginConfig.from_dict(settings).idle_capture

    def servers(self) -> list[str]:
        return list(dict.fromkeys(w.server for w, _ in self.workloads))

    def server_args(self, mode: ServeMode, server: str, extra: list[str],
                    offload_gb: float) -> list[str]:
        args = ["--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "bfloat16",
                "--served-model-name", self.model, *mode.args,
                *(self.shape.engine_args if self.shape else ()),
                *settings_args(plugin_settings(mode, self.plugin_config))]
        if server == "moe_offload":
            args += ["--cpu-offload-gb", f"{offload_gb:g}", "--cpu-offload-params", "experts"]
        return args + extra

    def server_env(self, mode: ServeMode) -> dict[str, str]:
        """A mode's server environment, with what its shape adds (`Shape.plugin_env`)."""
        return {**mode.env, **(self.shape.plugin_env(mode.plugin) if self.shape else {})}


def window_s(args: argparse.Namespace, rate: float) -> float:
    """Rough wall time of one window (arrivals, then a few seconds of drain)."""
    return max(args.duration_s, args.min_requests / rate) + 8.0


def warmup_rates(args: argparse.Namespace, rates: Sequence[float]) -> list[float]:
    """The rates a workload is warmed up at, lowest first."""
    return sorted(set(rates)) if args.warmup_rates == "all" else [max(rates)]


def ready_s(mode: ServeMode, server: str) -> float:
    """Rough seconds from start to /health of one of the mode's servers."""
    return mode.ready_estimate_s + (OFFLOAD_READY_EXTRA_S if server == "moe_offload" else 0.0)


def mode_cost_s(plan: Plan, mode: ServeMode, args: argparse.Namespace) -> float:
    """Rough wall time of one mode: each server's start-up, warm-ups and windows. Shares of
    --time-budget-s are weighted by it."""
    cost = 0.0
    for server in plan.servers():
        cost += ready_s(mode, server)
        cost += IDLE_CAPTURE_ESTIMATE_S if plan.settles(mode) else 0.0
        for w, rates in plan.workloads:
            if w.server == server:
                warmups = len(warmup_rates(args, rates)) if args.warmup_s > 0 else 0
                cost += warmups * (args.warmup_s + 8.0) + sum(window_s(args, r) for r in rates)
    return cost


def plan_text(plan: Plan, args: argparse.Namespace) -> str:
    """The run `args` would make, mode by mode, with the rough wall time the time budget is
    shared by (`mode_cost_s`: start-up estimates, not measurements)."""
    logs = plan.work_dir if args.log_dir else "a new temporary folder"
    lines = [f"{plan.model} ({plan.layers} layers), logs in {logs}"]
    total = 0.0
    for mode in plan.modes:
        cost = mode_cost_s(plan, mode, args)
        total += cost
        lines.append(f"{mode.name}: ~{cost:.0f} s")
        for server in plan.servers():
            settle = (f", then up to {args.settle_timeout_s:g} s settling its idle capture "
                      f"(~{IDLE_CAPTURE_ESTIMATE_S:.0f} s planned)" if plan.settles(mode) else "")
            sargs = " ".join(plan.server_args(mode, server, args.server_arg, args.offload_gb))
            env = "".join(f"{k}={v} " for k, v in plan.server_env(mode).items())
            lines.append(f"  server {server}: ready in ~{ready_s(mode, server):.0f} s"
                         f"{settle}: {env}vllm serve {sargs}")
            for w, rates in plan.workloads:
                if w.server != server:
                    continue
                warm = warmup_rates(args, rates) if args.warmup_s > 0 else []
                windows = ", ".join(
                    f"r{r:g} {window_requests(r, args.duration_s, args.min_requests)} requests"
                    for r in rates)
                lines.append(f"    {w.name}: warm-up {args.warmup_s:g} s at "
                             f"{','.join(f'{r:g}' for r in warm) or 'no rate'} req/s; "
                             f"windows {windows}")
    budget = args.time_budget_s
    fits = "" if budget is None else (
        f"; --time-budget-s {budget:g} ({budget - RESERVE_S:g} s for windows): "
        + ("fits" if total <= budget - RESERVE_S else
           "does NOT fit: the windows that would end past it are skipped"))
    lines.append(f"total ~{total:.0f} s{fits}")
    return "\n".join(lines)
