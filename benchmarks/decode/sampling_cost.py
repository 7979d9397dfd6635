"""The cost of sampling in a decode benchmark result (`--sampling greedy,P`): per model, mode,
batch and context, the TPOT under preset P against greedy, measured side by side in one run.

RATIO_RULES' rule 5 keeps the ratio of p50s among the ratios; `sampling_cost` adds the
milliseconds and, over >= 2 repeats, the paired ratio (per repeat, P's p50 over greedy's; the
median over repeats), which cancels a host that slows down for a while.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.harness.modes import MODES
from benchmarks.harness.sampling import GREEDY


def _sampling(row: dict[str, Any]) -> str:
    return row.get("sampling", GREEDY)  # files from before --sampling: greedy


def _mode_order(mode: str) -> int:
    names = list(MODES)
    return names.index(mode) if mode in names else len(names)


def sampling_cost(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per row sampled under a preset other than greedy whose greedy row (same model,
    mode, batch, context) exists: both p50s, the added ms per token, the ratio, the paired
    ratio (None under 2 repeats each)."""
    greedy = {(r["model"], r["mode"], r["batch"], r["context"]): r
              for r in rows if _sampling(r) == GREEDY}
    out = []
    for r in rows:
        base = greedy.get((r["model"], r["mode"], r["batch"], r["context"]))
        if _sampling(r) == GREEDY or base is None or base["tpot_ms_p50"] <= 0:
            continue
        reps = list(zip(r.get("repeat_p50_ms") or [], base.get("repeat_p50_ms") or []))
        paired = [a / b for a, b in reps if b > 0]
        out.append({"model": r["model"], "mode": r["mode"], "batch": r["batch"],
                    "context": r["context"], "sampling": _sampling(r),
                    "greedy_ms": base["tpot_ms_p50"], "sampled_ms": r["tpot_ms_p50"],
                    "added_ms": round(r["tpot_ms_p50"] - base["tpot_ms_p50"], 4),
                    "ratio": round(r["tpot_ms_p50"] / base["tpot_ms_p50"], 4),
                    "paired_ratio_median": round(statistics.median(paired), 4)
                    if len(paired) >= 2 else None})
    return sorted(out, key=lambda e: (e["model"], e["sampling"], e["context"],
                                      _mode_order(e["mode"]), e["batch"]))


def format_sampling_cost(doc: dict[str, Any]) -> str:
    """`sampling_cost` as text: one line per model, preset, context and mode, batch by batch
    (empty when nothing was sampled beside greedy)."""
    lines: dict[tuple[str, str, int, str], list[str]] = {}
    for e in sampling_cost(doc["rows"]):
        paired = e["paired_ratio_median"]
        lines.setdefault((e["model"], e["sampling"], e["context"], e["mode"]), []).append(
            f"b{e['batch']} {e['sampled_ms']:.3f} - {e['greedy_ms']:.3f} = "
            f"{e['added_ms']:+.3f} ms (x{e['ratio']:.2f}"
            + ("" if paired is None else f", paired x{paired:.2f}") + ")")
    return "\n".join(f"sampling {s} over {GREEDY}, {model} c{context} {mode}: " + "; ".join(parts)
                     for (model, s, context, mode), parts in lines.items())
