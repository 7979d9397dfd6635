"""The serving benchmark's results against the plugin's serving targets, and the README's
headline rows, read from result files (`python -m benchmarks.serving targets FILE...`).

Targets (plugin against `stock`, vLLM's H200 default, at each measured rate):
- below saturation (a rate lower than the lowest rate that saturated either mode): every TTFT
  and TPOT ratio (p50 and p99, stock time over plugin time) at least TARGET_RATIO of the
  workload: 1.2 on `chat`; 1.0 on `long`, whose 4k-8k-token prefills are GPU-bound;
- at saturation (every rate from there on): output tokens/s at least stock's;
- on `chat` at REPLAY_RATES: at least REPLAYED_SHARE of the engine steps replayed.
A point that misses is listed with its value and the floor, its bootstrap interval where the
rows kept per-request samples (an interval that reaches the floor says the window's own sampling
can account for the miss; the miss still counts), and the graph captures the plugin's window held
(a lazy capture pauses every request in flight); so is a target that the file has no point for
(no saturated rate, no row at a replay rate).

Coverage (what one shape's result file must hold, `coverage`): the modes COVERAGE_MODES on
`chat` and `long` at MIN_RATES or more rates each, up to a rate that saturated one of them;
for the MoE shape, `moe_offload` for `plugin` and `stock` at MIN_OFFLOAD_RATES rates; no failed
request; client send lag p99 under MAX_SEND_LAG_MS at every rate below saturation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.serving.load import rate_label
from benchmarks.serving.report import INTERVAL_LEVEL, PLUGIN, check_schema

AGAINST = "stock"
TARGET_RATIO = {"chat": 1.2, "long": 1.0}
LATENCY_RATIOS = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")
REPLAY_RATES = (4.0, 16.0)
REPLAYED_SHARE = 0.95
COVERAGE_MODES = (PLUGIN, AGAINST, "stock_triton")
MIN_RATES = 4
MIN_OFFLOAD_RATES = 2
MAX_SEND_LAG_MS = 10.0
MOE_MODELS = ("qwen3-30b-a3b",)
SHAPES = {"qwen3-0.6b": "Qwen3-0.6B", "qwen3-8b": "Qwen3-8B",
          "qwen3-30b-a3b": "Qwen3-30B-A3B (48 layers)"}


def _saturated_at(doc: Mapping[str, Any], mode: str, workload: str) -> float | None:
    return (doc["saturation"].get(f"{mode}/{workload}") or {}).get("saturated_at")


def _rows(doc: Mapping[str, Any], mode: str, workload: str) -> dict[float, Mapping[str, Any]]:
    return {r["rate"]: r for r in doc["rows"]
            if r["mode"] == mode and r["workload"] == workload and r.get("completed")}


def points(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One entry per workload x rate where both the plugin and `stock` have a row: its ratios
    (`ratios` keyed by metric, `otps`), the plugin's replayed share, which modes were saturated
    there and whether a ratio pairs rows of two runs (`merge`)."""
    model, across = doc["model"], set(doc.get("ratios_across_runs", ()))
    intervals = doc.get("ratio_intervals", {})
    out = []
    workloads = dict.fromkeys(r["workload"] for r in doc["rows"])
    for workload in sorted(workloads, key=lambda w: (w not in TARGET_RATIO,
                                                     list(TARGET_RATIO).index(w)
                                                     if w in TARGET_RATIO else 0)):
        plugin, stock = _rows(doc, PLUGIN, workload), _rows(doc, AGAINST, workload)
        for rate in sorted(set(plugin) & set(stock)):
            where = f"{model}/{workload}/{rate_label(rate)}"
            keys = {m: f"{m}_{AGAINST}_over_{PLUGIN}/{where}" for m in LATENCY_RATIOS}
            keys["otps"] = f"otps_{PLUGIN}_over_{AGAINST}/{where}"
            saturated = [m for m in (PLUGIN, AGAINST)
                         if (s := _saturated_at(doc, m, workload)) is not None and rate >= s]
            out.append({"workload": workload, "rate": rate, "saturated": saturated,
                        "ratios": {m: doc["ratios"].get(k) for m, k in keys.items()},
                        "intervals": {m: intervals.get(k) for m, k in keys.items()},
                        "replayed": (plugin[rate].get("steps") or {}).get("replayed_share"),
                        "captures": _captures(plugin[rate].get("steps") or {}),
                        "across_runs": any(k in across for k in keys.values())})
    return out


def _captures(steps: Mapping[str, Any]) -> str:
    """What the plugin's window captured, for a miss' line: '' when nothing."""
    n = steps.get("captures") or 0
    if not n:
        return ""
    inside = steps.get("step_captures")
    seconds = sum((steps.get("capture_s_by_kind") or {}).values())
    return (f"; the plugin's window held {n} capture{'s' if n != 1 else ''}"
            + ("" if inside is None else f", {inside} inside steps") + f" ({seconds:.2f} s)")


def _interval(interval: Sequence[float] | None) -> str:
    """A miss' bootstrap interval, for its line: '' when the rows kept no samples."""
    return "" if not interval else (f" ({INTERVAL_LEVEL:.0%} interval {interval[0]:.2f}-"
                                    f"{interval[1]:.2f}x)")


def misses(doc: Mapping[str, Any]) -> list[str]:
    """Every target the file's points miss or cannot show, one line each (module doc)."""
    out, model = [], doc["model"]
    by_workload: dict[str, list[dict[str, Any]]] = {}
    for p in points(doc):
        by_workload.setdefault(p["workload"], []).append(p)
    for workload, floor in TARGET_RATIO.items():
        pts = by_workload.get(workload, [])
        if not pts:
            out.append(f"{model} {workload}: no point with both {PLUGIN} and {AGAINST}")
            continue
        for p in pts:
            where = f"{model} {workload} r{p['rate']:g}"
            if not p["saturated"]:
                out += [(f"{where}: {m} {v:.2f}x < {floor}x" + _interval(p["intervals"][m])
                         if v is not None else f"{where}: {m} not measured") + p["captures"]
                        for m in LATENCY_RATIOS
                        if (v := p["ratios"][m]) is None or v < floor]
            elif (v := p["ratios"]["otps"]) is None or v < 1.0:
                out.append(f"{where} (saturated): output tok/s {_x(v)} of {AGAINST}'s < 1.0x"
                           + p["captures"])
        if not any(p["saturated"] for p in pts):
            out.append(f"{model} {workload}: no saturated point up to "
                       f"{max(p['rate'] for p in pts):g} req/s (output tok/s at saturation "
                       "not shown)")
        if workload == "chat":
            for rate in REPLAY_RATES:
                p = next((p for p in pts if p["rate"] == rate), None)
                if p is None or p["replayed"] is None:
                    out.append(f"{model} chat r{rate:g}: no replayed share measured")
                elif p["replayed"] < REPLAYED_SHARE:
                    out.append(f"{model} chat r{rate:g}: {p['replayed']:.1%} of steps replayed "
                               f"< {REPLAYED_SHARE:.0%}")
    return out


def coverage(doc: Mapping[str, Any]) -> list[str]:
    """What the file lacks of the serving benchmark's coverage (module doc), one line each."""
    out, model = [], doc["model"]
    needs = [(w, COVERAGE_MODES, MIN_RATES) for w in ("chat", "long")]
    if model in MOE_MODELS or any(model.startswith(f"{m}-fp8") for m in MOE_MODELS):
        needs.append(("moe_offload", (PLUGIN, AGAINST), MIN_OFFLOAD_RATES))
    for workload, modes, min_rates in needs:
        for mode in modes:
            rates = sorted(_rows(doc, mode, workload))
            if len(rates) < min_rates:
                out.append(f"{model} {workload} {mode}: {len(rates)} rates "
                           f"({', '.join(f'{r:g}' for r in rates) or 'none'}), needs "
                           f"{min_rates}")
        if workload != "moe_offload" and not any(
                _saturated_at(doc, m, workload) is not None for m in modes):
            out.append(f"{model} {workload}: no measured rate saturated any mode")
    for row in doc["rows"]:
        where = f"{model} {row['workload']} r{row['rate']:g} {row['mode']}"
        if row.get("failed"):
            out.append(f"{where}: {row['failed']} failed requests")
        sat = _saturated_at(doc, row["mode"], row["workload"])
        lag = (row.get("send_lag_ms") or {}).get("p99")
        if (sat is None or row["rate"] < sat) and lag is not None and lag >= MAX_SEND_LAG_MS:
            out.append(f"{where}: client send lag p99 {lag:.1f} ms >= {MAX_SEND_LAG_MS:g} ms")
    return out


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def headline_rows(doc: Mapping[str, Any]) -> list[str]:
    """The README's serving table rows for one result file: shape, workload, rate (with the
    saturated modes), TTFT and TPOT p50 / p99 ratios, output tok/s ratio, steps replayed;
    `*` marks a point whose rows come from two runs."""
    shape = SHAPES.get(doc["model"], doc["model"])
    lines = []
    for p in points(doc):
        sat = p["saturated"]
        rate = f"{p['rate']:g}" + ("" if not sat else " (saturated)" if len(sat) == 2
                                   else f" ({sat[0]} saturated)") + (" *" if p["across_runs"]
                                                                     else "")
        r = p["ratios"]
        replayed = "-" if p["replayed"] is None else f"{p['replayed']:.0%}"
        lines.append(f"| {shape} | {p['workload']} | {rate} | {_x(r['ttft_p50'])} / "
                     f"{_x(r['ttft_p99'])} | {_x(r['tpot_p50'])} / {_x(r['tpot_p99'])} | "
                     f"{_x(r['otps'])} | {replayed} |")
    return lines


HEADER = ("| shape | workload | rate (req/s) | TTFT p50 / p99 | TPOT p50 / p99 | output tok/s "
          "| steps replayed |\n|---|---|---|---|---|---|---|")


def report(paths: Sequence[str]) -> str:
    """The headline table of every file, then each file's misses (or that it meets them)."""
    docs = []
    for path in paths:
        doc = json.loads(Path(path).read_text())
        check_schema(doc)
        docs.append((path, doc))
    lines = [HEADER] + [row for _, doc in docs for row in headline_rows(doc)]
    lines.append("")
    lines.append(f"targets against {AGAINST} (module doc of benchmarks/serving/targets.py):")
    for path, doc in docs:
        missed = misses(doc)
        lines.append(f"  {Path(path).name}: " + ("every target met" if not missed
                                                 else f"{len(missed)} missed"))
        lines += [f"    {m}" for m in missed]
    lines.append("benchmark coverage (module doc of benchmarks/serving/targets.py):")
    for path, doc in docs:
        lacking = coverage(doc)
        lines.append(f"  {Path(path).name}: " + ("complete" if not lacking
                                                 else f"{len(lacking)} lacking"))
        lines += [f"    {m}" for m in lacking]
    return "\n".join(lines)
