"""What `benchmarks.serving` makes of its rows: ratios between modes, the saturating rate, the
printed table, the result file's schema and the plot (matplotlib, imported lazily).

Ratio keys: `<metric>_<A>_over_<B>/<model>/<workload>/r<rate>`, time of A over time of B (> 1
means B is faster), for metric in RATIO_METRICS with B = plugin and A each stock mode; and
`otps_plugin_over_<A>/...`, output tokens/s of the plugin over A's (> 1 means the plugin serves
more). A merged file lists the ratios whose rows come from two runs (`ratios_across_runs`).
`sampling_costs`: `<metric>_<W>_over_<G>/<model>/<mode>/r<rate>`, a sampled workload W's time
over its greedy twin G's (`Workload.greedy_twin`) in the same mode and run, for the metrics in
SAMPLING_COST_METRICS (> 1: what sampling costs). `ratio_intervals` holds, under the same keys, each latency ratio's bootstrap interval from the
rows' per-request samples (paired within a run, apart across runs): how far the windows' own
sampling can move it.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness.plot import pyplot_or_none
from benchmarks.serving.load import WORKLOADS, Workload, rate_label

SCHEMA = "vllm_moe_graphs.serve_bench/1"
EXIT_NO_ROWS = 1
PLUGIN = "plugin"
RATIO_METRICS = {  # ratio metric -> (row field, statistic)
    "ttft_p50": ("ttft_ms", "p50"),
    "ttft_p99": ("ttft_ms", "p99"),
    "tpot_p50": ("tpot_ms", "p50"),
    "tpot_p99": ("tpot_ms", "p99"),
    "e2e_p50": ("e2e_ms", "p50"),
}
SAMPLING_COST_METRICS = ("ttft_p50", "tpot_p50", "tpot_p99")
# The saturating rate is the lowest measured rate whose TTFT p50 or TPOT p50 is past
# LATENCY_KNEE times the lowest rate's: the knee where queueing (TTFT) or batch growth (TPOT)
# takes over. Throughput alone cannot tell: with short windows the drain of the last requests
# weighs more than any backlog, and vLLM admits up to max_num_seqs requests before it queues.
LATENCY_KNEE = 4.0
# A latency ratio's interval (`ratio_intervals`): the bootstrap's central INTERVAL_LEVEL of
# RESAMPLES resamples of the requests both modes completed (rows of one run) or of each row's
# completed requests (rows of two runs), where at least MIN_PAIRED are there to resample.
INTERVAL_LEVEL = 0.95
RESAMPLES = 2000
MIN_PAIRED = 8
ROW_KEYS = ("model", "mode", "workload", "rate", "requests", "completed", "failed", "ttft_ms",
            "tpot_ms", "itl_ms", "e2e_ms", "send_lag_ms", "output_tokens_per_s",
            "requests_per_s", "steps")


def _stat(row: Mapping[str, Any], field: str, stat: str) -> float | None:
    value = (row.get(field) or {}).get(stat)
    return float(value) if value is not None else None


def _ratio_pairs(rows: Iterable[Mapping[str, Any]]
                 ) -> Iterable[tuple[str, str, float, Mapping[str, Any], Mapping[str, Any]]]:
    """(key, metric, value, the other mode's row, the plugin mode's row) of every ratio (see
    compute_ratios); metric is a RATIO_METRICS key or `otps`."""
    by_point: dict[tuple[str, str, float], dict[str, Mapping[str, Any]]] = {}
    for row in rows:
        if row.get("completed"):
            by_point.setdefault((row["model"], row["workload"], row["rate"]), {})[row["mode"]] = row
    for (model, workload, rate), modes in sorted(by_point.items()):
        where = f"{model}/{workload}/{rate_label(rate)}"
        for mine, plugin in sorted(modes.items()):
            if not mine.startswith(PLUGIN):
                continue
            for other, row in sorted(modes.items()):
                if other == mine or (other.startswith(PLUGIN) and other != PLUGIN):
                    continue
                for metric, (field, stat) in RATIO_METRICS.items():
                    a, b = _stat(row, field, stat), _stat(plugin, field, stat)
                    if a is not None and b:
                        key = f"{metric}_{other}_over_{mine}/{where}"
                        yield key, metric, round(a / b, 3), row, plugin
                a, b = plugin.get("output_tokens_per_s"), row.get("output_tokens_per_s")
                if a is not None and b:
                    yield f"otps_{mine}_over_{other}/{where}", "otps", round(a / b, 3), row, plugin


def compute_ratios(rows: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Every ratio between a plugin mode and each other mode at the same model, workload and
    rate: every stock mode over `plugin`, and over any other plugin mode (`plugin_decode_only`)
    the stock modes and `plugin`."""
    return {key: value for key, _, value, _, _ in _ratio_pairs(rows)}


def ratio_intervals(rows: Iterable[Mapping[str, Any]], resamples: int = RESAMPLES
                    ) -> dict[str, list[float]]:
    """The INTERVAL_LEVEL bootstrap interval [low, high] of every latency ratio whose two rows
    keep per-request `samples`. Two rows of one run were offered the same requests (request i is
    the same prompt in both), so the requests both completed are resampled in pairs. Rows of two
    runs (`run`, set by `merge`) or of request lists of unequal length are resampled apart, each
    over its own completed requests: pairing them by index would pair different prompts, and
    truncating the longer one would move its statistic away from the row's. Each resample's
    ratio of percentiles is taken. The resamples are seeded by the key, so an interval is the
    same in every file that holds its rows. Rows without samples, or with fewer than MIN_PAIRED
    requests to resample (paired, or in either row), get none."""
    import numpy as np

    out = {}
    tail = (1 - INTERVAL_LEVEL) / 2 * 100
    for key, metric, _, row, plugin in _ratio_pairs(rows):
        if metric not in RATIO_METRICS:
            continue
        field, stat = RATIO_METRICS[metric]
        q = float(stat[1:])
        a, b = ((r.get("samples") or {}).get(field) or [] for r in (row, plugin))
        rng = np.random.default_rng(zlib.crc32(key.encode()))
        if row.get("run") == plugin.get("run") and len(a) == len(b):
            paired = np.array([(x, y) for x, y in zip(a, b) if x is not None and y])
            if len(paired) < MIN_PAIRED:
                continue
            picks = paired[rng.integers(0, len(paired), size=(resamples, len(paired)))]
            tops, bottoms = picks[:, :, 0], picks[:, :, 1]
        else:
            own = [np.array([v for v in s if v is not None], dtype=float) for s in (a, b)]
            if min(len(v) for v in own) < MIN_PAIRED:
                continue
            tops, bottoms = (v[rng.integers(0, len(v), size=(resamples, len(v)))] for v in own)
        ratios = np.percentile(tops, q, axis=1) / np.percentile(bottoms, q, axis=1)
        out[key] = [round(float(v), 3) for v in np.percentile(ratios, [tail, 100 - tail])]
    return out


def sampling_costs(rows: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """What sampling costs each mode: a sampled workload's time over its greedy twin's at the
    same model, mode and rate, both rows measured in the same run (see the module docstring)."""
    by_point = {(r["model"], r["mode"], r["workload"], r["rate"], r.get("run")): r
                for r in rows if r.get("completed")}
    out = {}
    for (model, mode, workload, rate, run), row in sorted(by_point.items(),
                                                         key=lambda kv: str(kv[0])):
        twin = getattr(WORKLOADS.get(workload), "greedy_twin", None)
        if (greedy := by_point.get((model, mode, twin, rate, run))) is None:
            continue
        for metric in SAMPLING_COST_METRICS:
            a, b = (_stat(r, *RATIO_METRICS[metric]) for r in (row, greedy))
            if a is not None and b:
                key = f"{metric}_{workload}_over_{twin}/{model}/{mode}/{rate_label(rate)}"
                out[key] = round(a / b, 3)
    return out


def ratios_across_runs(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """The ratio keys whose two rows come from different runs (`run`, set by `merge`): not
    measured side by side, so machine-to-machine noise is in them."""
    return [key for key, _, _, a, b in _ratio_pairs(rows) if a.get("run") != b.get("run")]


def saturation(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per `<mode>/<workload>`: the lowest rate that saturates the server (None if none of the
    measured rates did, see LATENCY_KNEE), the highest output tokens/s seen and at which rate."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        if row.get("completed"):
            groups.setdefault(f"{row['mode']}/{row['workload']}", []).append(row)
    out = {}
    for key, group in sorted(groups.items()):
        group = sorted(group, key=lambda r: r["rate"])
        base = {f: _stat(group[0], f, "p50") for f in ("ttft_ms", "tpot_ms")}
        saturated_at = next(
            (r["rate"] for r in group[1:]
             if any(base[f] and (v := _stat(r, f, "p50")) is not None
                    and v > LATENCY_KNEE * base[f] for f in base)), None)
        best = max(group, key=lambda r: r["output_tokens_per_s"] or 0)
        out[key] = {"saturated_at": saturated_at, "rates": [r["rate"] for r in group],
                    "max_output_tokens_per_s": best["output_tokens_per_s"],
                    "at_rate": best["rate"]}
    return out


def check_schema(doc: Mapping[str, Any]) -> None:
    """Raise ValueError naming what a result document lacks."""
    missing = [k for k in ("schema", "name", "env", "model", "modes", "workloads", "rows",
                           "ratios", "saturation") if k not in doc]
    if missing:
        raise ValueError(f"serving result lacks {', '.join(missing)}")
    if doc["schema"] != SCHEMA:
        raise ValueError(f"schema {doc['schema']!r}, expected {SCHEMA!r}")
    for i, row in enumerate(doc["rows"]):
        lacking = [k for k in ROW_KEYS if k not in row]
        if lacking:
            raise ValueError(f"row {i} lacks {', '.join(lacking)}")


def _f(value: Any, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def _steps_text(steps: Mapping[str, Any] | None) -> str:
    if not steps or steps.get("replayed_share") is None:
        return "-"
    eager = " ".join(f"{k} {v:.0%}" for k, v in steps.get("eager_share", {}).items())
    return f"{steps['replayed_share']:.0%}" + (f" ({eager})" if eager else "")


def format_table(doc: Mapping[str, Any]) -> str:
    """One line per workload x rate x mode, then the plugin's ratios to each stock mode."""
    head = (f"{'workload':<12}{'rate':>6} {'mode':<13}{'ttft p50':>9}{'p99':>8}{'tpot p50':>9}"
            f"{'p99':>7}{'e2e p50':>9}{'tok/s':>8}{'fail':>5}{'lag p99':>8}  replayed")
    lines = [head, "-" * len(head)]
    rows = sorted(doc["rows"], key=lambda r: (r["workload"], r["rate"], r["mode"] != PLUGIN,
                                              r["mode"]))
    for r in rows:
        lines.append(
            f"{r['workload']:<12}{r['rate']:>6g} {r['mode']:<13}"
            f"{_f(_stat(r, 'ttft_ms', 'p50')):>9}{_f(_stat(r, 'ttft_ms', 'p99')):>8}"
            f"{_f(_stat(r, 'tpot_ms', 'p50'), '.2f'):>9}{_f(_stat(r, 'tpot_ms', 'p99'), '.2f'):>7}"
            f"{_f(_stat(r, 'e2e_ms', 'p50'), '.0f'):>9}{_f(r['output_tokens_per_s'], '.0f'):>8}"
            f"{r['failed']:>5}{_f(_stat(r, 'send_lag_ms', 'p99'), '.1f'):>8}  "
            f"{_steps_text(r.get('steps'))}")
    lines.append("")
    intervals = doc.get("ratio_intervals", {})
    lines.append("ratios (stock time / plugin time; otps plugin / stock): > 1 = plugin better"
                 + (f"; [{INTERVAL_LEVEL:.0%} interval]" if intervals else "")
                 + ("; * = rows of two runs" if doc.get("ratios_across_runs") else ""))
    across = set(doc.get("ratios_across_runs", ()))
    for key, value in doc["ratios"].items():
        iv = intervals.get(key)
        lines.append(f"  {key:<58} {value:6.3f}" + (f" [{iv[0]:.2f}, {iv[1]:.2f}]" if iv else "")
                     + (" *" if key in across else ""))
    if costs := doc.get("sampling_costs"):
        lines += ["", "sampling costs (sampled time / greedy time, same mode): > 1 = slower "
                  "sampled"] + [f"  {key:<58} {value:6.3f}" for key, value in costs.items()]
    lines.append("")
    for key, sat in doc["saturation"].items():
        at = f"saturates at {sat['saturated_at']:g} req/s" if sat["saturated_at"] is not None \
            else f"not saturated up to {max(sat['rates']):g} req/s"
        lines.append(f"  {key:<26} {at}; best {_f(sat['max_output_tokens_per_s'], '.0f')} "
                     f"output tok/s at {sat['at_rate']:g} req/s")
    return "\n".join(lines)


def render(doc: Mapping[str, Any], path: Path) -> Path | None:
    """TTFT p50 (top) and TPOT p50 (bottom) against rate, one column per workload, one line per
    mode. None (with the reason printed) without matplotlib or rows."""
    rows = doc.get("rows", [])
    plt = pyplot_or_none(rows, path, "python -m benchmarks.serving --plot")
    if plt is None:
        return None
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(2, len(workloads), figsize=(4.6 * len(workloads), 7), squeeze=False)
    for col, workload in enumerate(workloads):
        for row_i, (field, label) in enumerate((("ttft_ms", "TTFT p50 (ms)"),
                                                ("tpot_ms", "TPOT p50 (ms)"))):
            ax = axes[row_i][col]
            for color, mode in enumerate(dict.fromkeys(r["mode"] for r in rows)):
                pts = sorted((r["rate"], _stat(r, field, "p50")) for r in rows
                             if r["mode"] == mode and r["workload"] == workload
                             and _stat(r, field, "p50") is not None)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode,
                            color=f"C{color}")
            ax.set_yscale("log")  # a saturated mode's latency is 10-100x the others'
            ax.set_xlabel("offered rate (req/s)")
            ax.set_ylabel(label)
            ax.set_title(f"{doc['model']} / {workload}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"vllm serve, {doc['env'].get('gpu_name', '?')}: {doc['name']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def workloads_section(plan_workloads: Iterable[tuple[Workload, list[float]]]) -> dict:
    return {w.name: {"prompt_len": list(w.prompt_len), "output_len": list(w.output_len),
                     "description": w.description, "rates": rates,
                     **({"sampling": dict(w.sampling)} if w.sampling else {})}
            for w, rates in plan_workloads}


def assemble(name: str, model: str, env: dict[str, Any], workloads: dict[str, Any],
             modes: dict[str, Any], rows: list[dict[str, Any]], skipped: list[str]) -> dict:
    """The result document; ratios and saturation are computed from the rows."""
    doc = {"schema": SCHEMA, "name": name, "env": env, "model": model, "modes": modes,
           "workloads": workloads, "rows": rows, "ratios": compute_ratios(rows),
           "saturation": saturation(rows), "skipped": skipped}
    if intervals := ratio_intervals(rows):
        doc["ratio_intervals"] = intervals
    if costs := sampling_costs(rows):
        doc["sampling_costs"] = costs
    if across := ratios_across_runs(rows):
        doc["ratios_across_runs"] = across
    check_schema(doc)
    return doc


def write(doc: dict[str, Any], results_dir: Path) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{doc['name']}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    return path


def finish(doc: dict[str, Any], results_dir: Path, no_plot: bool) -> int:
    path = write(doc, results_dir)
    print(f"wrote {path}", flush=True)
    if not no_plot and (png := render(doc, path.with_suffix(".png"))):
        print(f"wrote {png}", flush=True)
    print(format_table(doc), flush=True)
    return 0 if doc["rows"] else EXIT_NO_ROWS


def merge(paths: list[str], name: str, results_dir: Path) -> int:
    """Rows of later files win on the same mode/workload/rate; ratios etc. are recomputed. Each
    row keeps the name of the file it was measured in (`run`), and the ratios between rows of
    two runs are listed under `ratios_across_runs`. `env.merged_from` lists the input files
    with each run's date, commit and options, or for an input that was merged itself the runs
    it lists."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    for p, d in zip(paths, docs):
        check_schema(d)
        if d["model"] != docs[0]["model"]:
            raise ValueError(f"{p} is for {d['model']}, {paths[0]} for {docs[0]['model']}")
    rows: dict[tuple[str, str, float], dict[str, Any]] = {}
    modes, workloads, skipped = {}, {}, []
    for p, d in zip(paths, docs):
        # a row keeps the run it was measured in: its first result file's name
        rows.update({(r["mode"], r["workload"], r["rate"]): {"run": Path(p).name, **r}
                     for r in d["rows"]})
        modes.update(d["modes"])
        workloads.update(d["workloads"])
        skipped += [s for s in d.get("skipped", []) if s not in skipped]
    # a merged input brings the runs it was merged from, so merging again loses none of them
    sources = [src for p, d in zip(paths, docs)
               for src in d["env"].get("merged_from") or [
                   {"file": Path(p).name, "date": d["env"].get("date"),
                    "git_commit": d["env"].get("git_commit"),
                    "options": d["env"].get("options")}]]
    env = {**docs[-1]["env"],
           "merged_from": [src for i, src in enumerate(sources) if src not in sources[:i]]}
    # a point skipped in one run and measured in another is no longer skipped
    measured = {f"{m}/{w}/{rate_label(r)}" for m, w, r in rows}
    skipped = [s for s in skipped if s.split(": ", 1)[0] not in measured]
    doc = assemble(name, docs[0]["model"], env, workloads, modes, list(rows.values()), skipped)
    return finish(doc, results_dir, False)
