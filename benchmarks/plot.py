"""PNG of a benchmark JSON: TPOT p50 vs batch, one panel per model, a line per mode and context.

matplotlib is imported here only, lazily; without it `render` returns None and says why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.modes import MODES

LINESTYLES = ("-", "--", ":", "-.")


def render(doc: dict[str, Any], path: Path) -> Path | None:
    """Write the plot to `path`; None (with a printed reason) when it cannot."""
    rows = doc.get("rows", [])
    if not rows:
        print("plot: no rows to plot", flush=True)
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(
            f"plot: matplotlib is not installed ({exc}); skipping {path.name}. "
            f"Install it (pip install matplotlib) or re-render later with "
            f"`python -m benchmarks.decode merge {path.with_suffix('.json')} --name NAME`.",
            flush=True,
        )
        return None

    models = sorted({r["model"] for r in rows})
    contexts = sorted({r["context"] for r in rows})
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    colors = {m: plt.get_cmap("tab10")(i) for i, m in enumerate(MODES)}
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        for mode in modes:
            for ci, context in enumerate(contexts):
                pts = sorted(
                    (r["batch"], r["tpot_ms_p50"], r["tpot_ms_p10"], r["tpot_ms_p90"])
                    for r in rows
                    if r["model"] == model and r["mode"] == mode and r["context"] == context
                )
                if not pts:
                    continue
                xs, p50, p10, p90 = zip(*pts)
                ax.errorbar(
                    xs,
                    p50,
                    yerr=[[a - b for a, b in zip(p50, p10)], [b - a for a, b in zip(p50, p90)]],
                    color=colors[mode],
                    linestyle=LINESTYLES[ci % len(LINESTYLES)],
                    marker="o",
                    markersize=3,
                    capsize=2,
                    label=f"{mode} c{context}",
                )
        for ci, context in enumerate(contexts):
            floor = sorted(
                {
                    (r["batch"], r["floor_ms"])
                    for r in rows
                    if r["model"] == model and r["context"] == context and r["floor_ms"]
                }
            )
            if floor:
                xs, ys = zip(*floor)
                ax.plot(
                    xs,
                    ys,
                    color="0.5",
                    linestyle=LINESTYLES[ci % len(LINESTYLES)],
                    linewidth=1,
                    label=f"HBM floor c{context}",
                )
        layers = sorted({r["num_layers"] for r in rows if r["model"] == model})
        ax.set_title(f"{model} ({'/'.join(map(str, layers))} layers)")
        ax.set_xscale("log", base=2)
        batches = sorted({r["batch"] for r in rows if r["model"] == model})
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel("TPOT p50 ms (bars p10-p90)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(f"decode TPOT: {doc.get('name', '')}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
