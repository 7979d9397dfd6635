"""Turn worker results into the benchmark JSON: rows, ratios, merge, and the printed table and
per-point summaries (the cost of sampling: `sampling_cost`).

The ratio set is `RATIO_RULES` below (also written into every JSON).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.decode.sampling_cost import sampling_cost
from benchmarks.harness.modes import EAGER_MODES, GRAPH_MODES, MODES, STOCK_GRAPH_MODES, Family
from benchmarks.harness.protocol import SCHEMA, WorkerResult, write_json_atomic
from benchmarks.harness.sampling import GREEDY, PRESETS, key_suffix
from benchmarks.harness.shapes import ModelShape, decode_step_bytes, floor_ms
from benchmarks.harness.stats import percentile

# rule 4: plugin graph modes other than plugin_graphs (options measured beside the defaults)
PLUGIN_GRAPH_VARIANTS = tuple(m for m in GRAPH_MODES
                              if MODES[m].family is Family.PLUGIN and m != "plugin_graphs")
NOISY_SPREAD = 0.2  # (p90 - p10) / p50 above this marks a row noisy
RATIO_RULES = """\
Ratio keys of rules 1-4 are exactly `tpot_<modeA>_over_<modeB>/<model>/b<batch>/c<context>`
(greedy requests; for another sampling preset P of --sampling the key ends in `/P`), value
tpot_p50(A) / tpot_p50(B), so a value above 1 means B is faster. At every (model, batch, context)
point and preset that has measurements, with "best stock graph mode" = the stock graph mode with
the lowest tpot_p50 there:
  1. every other stock mode over the best stock graph mode;
  2. every eager mode (stock_eager, plugin_eager) over every graph mode;
  3. every stock mode over plugin_graphs (and over plugin_graphs_experimental,
     plugin_graphs_cublas and plugin_graphs_fused_router), when measured;
  4. plugin_graphs over every other plugin graph mode (an option's gain, one ratio);
  5. the cost of sampling: every mode's tpot_p50 under each preset P other than greedy over its
     greedy one, `tpot_<P>_over_greedy/<mode>/<model>/b<batch>/c<context>`."""


@dataclasses.dataclass(slots=True)
class Row:
    model: str
    batch: int
    context: int
    mode: str
    sampling: str  # the requests' sampling preset (harness/sampling.py); older files: greedy
    tpot_ms_p50: float
    tpot_ms_p10: float
    tpot_ms_p90: float
    startup_s: float | None
    capture_s: float | None
    graph_mem_mib: float | None
    floor_ms: float | None
    pct_of_floor: float | None  # 100 * floor_ms / tpot_ms_p50: 100 = at the bandwidth limit
    floor_bytes: int
    num_layers: int
    steps: int  # decode steps behind the percentiles (all repeats)
    repeats: int
    repeat_p50_ms: list[float]
    noisy: bool
    compile_s: float | None = None
    runner: str | None = None
    cudagraph_mode: str | None = None
    compilation_mode: str | None = None
    attention_backend: str | None = None  # backends the runner built, e.g. "TRITON_ATTN"


def build_rows(result: WorkerResult, shape: ModelShape, bandwidth_gbps: float | None) -> list[Row]:
    rows = []
    for p in sorted(result.points, key=lambda p: (p.batch, p.context, _preset_order(p.sampling))):
        if not p.step_ms:
            continue
        p50, p10, p90 = (percentile(p.step_ms, q) for q in (50, 10, 90))
        nbytes = decode_step_bytes(shape, p.batch, p.context).total
        fl = floor_ms(nbytes, bandwidth_gbps)
        rows.append(
            Row(
                model=result.model,
                batch=p.batch,
                context=p.context,
                mode=result.mode,
                sampling=p.sampling,
                tpot_ms_p50=round(p50, 4),
                tpot_ms_p10=round(p10, 4),
                tpot_ms_p90=round(p90, 4),
                startup_s=_r(result.startup_s, 2),
                capture_s=_r(result.capture_s, 2),
                graph_mem_mib=_r(result.graph_mem_mib, 1),
                floor_ms=_r(fl, 4),
                pct_of_floor=None if fl is None else round(100 * fl / p50, 2),
                floor_bytes=nbytes,
                num_layers=shape.num_layers,
                steps=len(p.step_ms),
                repeats=p.repeats_done,
                repeat_p50_ms=list(p.repeat_p50_ms),
                noisy=(p90 - p10) / p50 > NOISY_SPREAD if p50 > 0 else True,
                compile_s=_r(result.compile_s, 2),
                runner=result.runner,
                cudagraph_mode=_str(result.resolved.get("cudagraph_mode")),
                compilation_mode=_str(result.resolved.get("compilation_mode")),
                attention_backend=",".join(result.resolved.get("attention_backends_used") or [])
                or _str(result.resolved.get("attention_backend")),
            )
        )
    return rows


def _r(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _str(value: Any) -> str | None:
    return None if value is None else str(value)


def ratio_key(mode_a: str, mode_b: str, model: str, batch: int, context: int,
              sampling: str = GREEDY) -> str:
    return f"tpot_{mode_a}_over_{mode_b}/{model}/b{batch}/c{context}{key_suffix(sampling)}"


def sampling_key(sampling: str, mode: str, model: str, batch: int, context: int) -> str:
    """Rule 5's key: `mode`'s TPOT under preset `sampling` over its greedy TPOT."""
    return f"tpot_{sampling}_over_{GREEDY}/{mode}/{model}/b{batch}/c{context}"


def sampling_of(row: dict[str, Any]) -> str:
    return row.get("sampling", GREEDY)  # files from before --sampling: greedy


def _points(rows: Iterable[dict[str, Any]], field: str = "tpot_ms_p50"
            ) -> dict[tuple[str, int, int, str], dict[str, Any]]:
    """(model, batch, context, sampling) -> {mode: row[field]}."""
    points: dict[tuple[str, int, int, str], dict[str, Any]] = {}
    for r in rows:
        at = (r["model"], r["batch"], r["context"], sampling_of(r))
        points.setdefault(at, {})[r["mode"]] = r[field]
    return points


def compute_ratios(rows: Iterable[dict[str, Any]]) -> dict[str, float]:
    """The ratio set of RATIO_RULES, from rows as dicts."""
    points = _points(rows)
    ratios: dict[str, float] = {}

    def put(a: str, b: str, at: tuple[str, int, int, str], tpot: dict[str, float]) -> None:
        if a != b and a in tpot and b in tpot and tpot[b] > 0:
            ratios[ratio_key(a, b, *at)] = round(tpot[a] / tpot[b], 4)

    stock = [m for m, mode in MODES.items() if mode.family is Family.STOCK]
    for at, tpot in sorted(points.items()):
        graphs = [m for m in STOCK_GRAPH_MODES if m in tpot]
        if graphs:
            best = min(graphs, key=lambda m: tpot[m])
            for mode in stock:
                put(mode, best, at, tpot)
        for eager in EAGER_MODES:
            for graph in GRAPH_MODES:
                put(eager, graph, at, tpot)
        for mode in stock:
            for plugin in ("plugin_graphs", "plugin_graphs_experimental", "plugin_graphs_cublas",
                           "plugin_graphs_fused_router"):
                put(mode, plugin, at, tpot)
        for variant in PLUGIN_GRAPH_VARIANTS:
            put("plugin_graphs", variant, at, tpot)
    for (model, batch, context, sampling), tpot in sorted(points.items()):
        greedy = points.get((model, batch, context, GREEDY), {})
        for mode in tpot if sampling != GREEDY else ():
            if greedy.get(mode):
                key = sampling_key(sampling, mode, model, batch, context)
                ratios[key] = round(tpot[mode] / greedy[mode], 4)
    return ratios


def assemble(
    name: str,
    env: dict[str, Any],
    rows: list[dict[str, Any]],
    absent: dict[str, str],
    failures: list[dict[str, Any]],
    skipped: list[dict[str, Any]],
) -> dict[str, Any]:
    rows = sorted(rows, key=lambda r: (r["model"], r["batch"], r["context"],
                                       _preset_order(sampling_of(r)), _mode_order(r["mode"])))
    measured = {r["mode"] for r in rows}
    presets = sorted({sampling_of(r) for r in rows}, key=_preset_order)
    return {
        "schema": SCHEMA,
        "name": name,
        "env": env,
        "rows": rows,
        "absent": {m: why for m, why in absent.items() if m not in measured},
        "ratios": compute_ratios(rows),
        "sampling_cost": sampling_cost(rows),  # rule 5's ratios with their ms, paired
        "failures": failures,
        "skipped": skipped,
        "modes": {m: mode.description for m, mode in MODES.items()},
        "sampling": {s: PRESETS[s].record() for s in presets if s in PRESETS},
        "ratio_rules": RATIO_RULES,
    }


def _mode_order(mode: str) -> int:
    names = list(MODES)
    return names.index(mode) if mode in names else len(names)


def _preset_order(sampling: str) -> int:
    names = list(PRESETS)
    return names.index(sampling) if sampling in names else len(names)


def load(path: str | Path) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {data.get('schema')!r}, expected {SCHEMA!r}")
    return data


def merge(docs: Sequence[tuple[str, dict[str, Any]]], name: str) -> dict[str, Any]:
    """Merge benchmark JSONs: rows by (model, batch, context, sampling, mode), a later file
    winning."""
    if not docs:
        raise ValueError("merge needs at least one input file")
    by_key: dict[tuple[Any, ...], dict[str, Any]] = {}
    absent: dict[str, str] = {}
    failures: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    layers: dict[str, int] = {}
    for source, doc in docs:
        for row in doc["rows"]:
            by_key[(row["model"], row["batch"], row["context"], sampling_of(row),
                    row["mode"])] = row
        absent.update(doc.get("absent", {}))
        failures += [{**f, "source": source} for f in doc.get("failures", [])]
        skipped += [{**s, "source": source} for s in doc.get("skipped", [])]
        layers.update(doc.get("env", {}).get("layers", {}))
    envs = [doc.get("env", {}) for _, doc in docs]
    shared = {k: v for k, v in envs[0].items() if all(e.get(k) == v for e in envs[1:])}
    env = {
        **shared,
        "layers": layers,
        "merged_from": [s for s, _ in docs],
        "sources": [{"file": s, "env": e} for (s, _), e in zip(docs, envs)],
    }
    return assemble(name, env, list(by_key.values()), absent, failures, skipped)


def write(doc: dict[str, Any], results_dir: Path) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{doc['name']}.json"
    write_json_atomic(path, doc)
    return path


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(doc: dict[str, Any]) -> str:
    """One line per row; a sampling column when a row's requests sampled other than greedily."""
    sampled = [len(sampling_of(r)) for r in doc["rows"] if sampling_of(r) != GREEDY]
    width = max(len("sampling"), *sampled) + 1 if sampled else 0
    head = (
        f"{'model':<14}{'b':>4}{'ctx':>6}  {'mode':<21}{'sampling' if width else '':<{width}}"
        f"{'p50 ms':>8} {'p10-p90 ms':>15} "
        f"{'floor':>7}{'%floor':>7}{'start s':>8}{'capt s':>7}{'graph MiB':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in doc["rows"]:
        spread = f"{r['tpot_ms_p10']:.2f}-{r['tpot_ms_p90']:.2f}" + ("*" if r.get("noisy") else " ")
        lines.append(
            f"{r['model']:<14}{r['batch']:>4}{r['context']:>6}  {r['mode']:<21}"
            f"{sampling_of(r) if width else '':<{width}}{r['tpot_ms_p50']:>8.3f} {spread:>15} "
            f"{_f(r['floor_ms'], '7.3f'):>7}"
            f"{_f(r['pct_of_floor'], '6.1f'):>7}{_f(r['startup_s'], '8.1f'):>8}"
            f"{_f(r['capture_s'], '7.1f'):>7}{_f(r['graph_mem_mib'], '10.0f'):>10}"
        )
    if not doc["rows"]:
        lines.append("(no rows measured)")
    lines.append(
        "* = noisy: (p90 - p10) / p50 > "
        f"{NOISY_SPREAD:g}; %floor = 100 * floor / p50 (100 = at the HBM limit)"
    )
    for mode, why in doc.get("absent", {}).items():
        lines.append(f"absent  {mode}: {why}")
    for f in doc.get("failures", []):
        first = (f.get("error") or "").splitlines()[0] if f.get("error") else ""
        where = f"{f['model']} {f['mode']}" + (
            f" b{f['batch']}/c{f['context']}{key_suffix(sampling_of(f))}" if "batch" in f else ""
        )
        lines.append(f"failed  {where}: {first[:160]}")
    if doc.get("skipped"):
        lines.append(
            f"skipped {len(doc['skipped'])} item(s) for lack of time (see 'skipped' in the JSON)"
        )
    return "\n".join(lines)


def format_ratio_summary(doc: dict[str, Any]) -> str:
    """Per point and sampling preset: the best stock graph mode, and every other mode's tpot_p50
    over it."""
    lines = []
    for (model, batch, context, sampling), tpot in sorted(_points(doc["rows"]).items()):
        graphs = [m for m in STOCK_GRAPH_MODES if m in tpot]
        if not graphs:
            continue
        best = min(graphs, key=lambda m: tpot[m])
        others = ", ".join(
            f"{m} x{tpot[m] / tpot[best]:.2f}" for m in sorted(tpot, key=_mode_order) if m != best
        )
        lines.append(
            f"{model} b{batch} c{context}{key_suffix(sampling)}: best stock graphs {best} "
            f"{tpot[best]:.3f} ms; {others or 'nothing else measured'}"
        )
    return "\n".join(lines)


def repeat_summary(doc: dict[str, Any], plugin: str = "plugin_graphs") -> list[dict[str, Any]]:
    """Per point and sampling preset with `plugin` and a stock graph mode measured over >= 2
    repeats each: every mode's median of its per-repeat p50s, the best stock graph mode by that
    median, and the paired ratio: for each repeat r, min over the stock graph modes of their r-th
    p50 over the plugin's r-th p50, median over r. With `--interleave` the modes of one repeat ran
    back to back, so a host that slows down for a while slows all of them alike and pairing
    cancels it (the per-repeat minimum over stock modes leans towards stock: a conservative
    ratio)."""
    points = _points([r for r in doc["rows"] if len(r.get("repeat_p50_ms") or []) >= 2],
                     "repeat_p50_ms")
    out = []
    for (model, batch, context, sampling), reps in sorted(points.items()):
        graphs = [m for m in STOCK_GRAPH_MODES if m in reps]
        if plugin not in reps or not graphs:
            continue
        medians = {m: statistics.median(v) for m, v in reps.items()}
        best = min(graphs, key=lambda m: medians[m])
        n = min(len(reps[m]) for m in (*graphs, plugin))
        paired = [min(reps[m][i] for m in graphs) / reps[plugin][i] for i in range(n)]
        out.append({"model": model, "batch": batch, "context": context, "sampling": sampling,
                    "repeats": n,
                    "median_ms": {m: round(v, 4) for m, v in medians.items()},
                    "best_stock": best,
                    "best_stock_over_plugin": round(medians[best] / medians[plugin], 4),
                    "paired_ratio_median": round(statistics.median(paired), 4),
                    "paired_ratio_min": round(min(paired), 4),
                    "paired_ratio_max": round(max(paired), 4)})
    return out


def format_repeat_summary(doc: dict[str, Any]) -> str:
    """`repeat_summary` as text: one line per point (empty when no point qualifies)."""
    lines = []
    for s in repeat_summary(doc):
        med = s["median_ms"]
        modes = ", ".join(f"{m} {med[m]:.3f}" for m in sorted(med, key=_mode_order))
        lines.append(
            f"{s['model']} b{s['batch']} c{s['context']}{key_suffix(s['sampling'])} "
            f"({s['repeats']} repeats), median of "
            f"per-repeat p50s: {modes}; best stock {s['best_stock']} / plugin_graphs "
            f"x{s['best_stock_over_plugin']:.2f}; paired per repeat x{s['paired_ratio_median']:.2f}"
            f" (min {s['paired_ratio_min']:.2f}, max {s['paired_ratio_max']:.2f})")
    return "\n".join(lines)
