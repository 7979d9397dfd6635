"""PNG of a benchmark JSON: TPOT p50 vs batch, one panel per model, a line per mode, context and
sampling preset (greedy: circles, others: paler triangles, named in the label).

matplotlib is imported here only, lazily; without it `render` returns None and says why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.harness.modes import MODES
from benchmarks.harness.sampling import GREEDY

LINESTYLES = ("-", "--", ":", "-.")


def pyplot_or_none(rows: list[Any], path: Path, redraw: str) -> Any:
    """matplotlib.pyplot (Agg), or None with the reason printed: no rows, or no matplotlib."""
    if not rows:
        print("plot: no rows to plot", flush=True)
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(f"plot: matplotlib is not installed ({exc}); skipping {path.name}. Install it "
              f"(pip install matplotlib) and redraw with `{redraw} "
              f"{path.with_suffix('.json')}`.", flush=True)
        return None
    return plt


def _save(plt: Any, fig: Any, title: str, path: Path) -> Path:
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render(doc: dict[str, Any], path: Path) -> Path | None:
    """Write the plot to `path`; None (with a printed reason) when it cannot."""
    rows = doc.get("rows", [])
    plt = pyplot_or_none(rows, path, "python -m benchmarks.harness.plot decode")
    if plt is None:
        return None

    models = sorted({r["model"] for r in rows})
    contexts = sorted({r["context"] for r in rows})
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    presets = list(dict.fromkeys(r.get("sampling", GREEDY) for r in rows))
    colors = {m: plt.get_cmap("tab10")(i) for i, m in enumerate(MODES)}
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        lines = [(m, ci, c, s) for m in modes for ci, c in enumerate(contexts) for s in presets]
        for mode, ci, context, sampling in lines:
            pts = sorted(
                (r["batch"], r["tpot_ms_p50"], r["tpot_ms_p10"], r["tpot_ms_p90"])
                for r in rows
                if r["model"] == model and r["mode"] == mode and r["context"] == context
                and r.get("sampling", GREEDY) == sampling
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
                marker="o" if sampling == GREEDY else "^",
                alpha=1.0 if sampling == GREEDY else 0.6,
                markersize=3,
                capsize=2,
                label=f"{mode} c{context}" + ("" if sampling == GREEDY else f" {sampling}"),
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
    return _save(plt, fig, f"decode TPOT: {doc.get('name', '')}", path)


def render_attn(doc: dict[str, Any], path: Path) -> Path | None:
    """PNG of a `benchmarks.kernels.attn` JSON: per model, TRITON_ATTN time / ours and FA3 time /
    ours (dashed) vs context (a line per batch; above 1 = ours faster) and ours as % of the HBM
    floor (the copy bandwidth)."""
    rows = doc.get("rows", [])
    plt = pyplot_or_none(rows, path, "python -m benchmarks.harness.plot attn")
    if plt is None:
        return None
    models = sorted({r["model"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    colors = {b: plt.get_cmap("viridis")(i / max(1, len(batches) - 1))
              for i, b in enumerate(batches)}
    fig, axes = plt.subplots(2, len(models), figsize=(5.5 * len(models), 8), squeeze=False)
    for col, model in enumerate(models):
        for batch in batches:
            pts = sorted((r["context"], r["ratio"], r["pct_hbm"], r["vllm_pct_hbm"])
                         for r in rows if r["model"] == model and r["batch"] == batch)
            if not pts:
                continue
            ctx, ratio, ours, theirs = zip(*pts)
            axes[0][col].plot(ctx, ratio, marker="o", color=colors[batch], label=f"b{batch}")
            fa3 = sorted((r["context"], r["fa3_ratio"]) for r in rows if r["model"] == model
                         and r["batch"] == batch and r.get("fa3_ratio") is not None)
            if fa3:
                axes[0][col].plot(*zip(*fa3), marker="s", linestyle="--", color=colors[batch],
                                  label=f"FA3 b{batch}")
            axes[1][col].plot(ctx, ours, marker="o", color=colors[batch], label=f"ours b{batch}")
            axes[1][col].plot(ctx, theirs, marker="x", linestyle=":", color=colors[batch],
                              label=f"TRITON_ATTN b{batch}")
        axes[0][col].axhline(1.0, color="0.3", linewidth=1)
        axes[0][col].axhline(1.25, color="0.6", linewidth=1, linestyle="--")
        axes[0][col].set_ylabel("vLLM us / ours us (TRITON_ATTN solid, FA3 dashed)")
        axes[1][col].axhline(70, color="0.6", linewidth=1, linestyle="--")
        axes[1][col].set_ylabel("% of HBM floor (copy bandwidth)")
        for row in (0, 1):
            ax = axes[row][col]
            ax.set_title(f"{model}: decode attention")
            ax.set_xscale("log", base=2)
            contexts = sorted({r["context"] for r in rows if r["model"] == model})
            ax.set_xticks(contexts, [str(c) for c in contexts])
            ax.minorticks_off()
            ax.set_xlabel("context")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=6)
    return _save(plt, fig, f"decode attention vs vLLM: {doc.get('device', '')}", path)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m benchmarks.harness.plot",
                                description="Re-render the PNG of a saved benchmark JSON.")
    p.add_argument("kind", choices=("decode", "attn"),
                   help="decode: benchmarks.decode JSON; attn: benchmarks.kernels.attn JSON")
    p.add_argument("json", type=Path)
    p.add_argument("--out", type=Path, help="PNG path (default: the JSON's, with .png)")
    args = p.parse_args(argv)
    try:
        doc = json.loads(args.json.read_text())
    except (OSError, ValueError) as exc:
        p.error(f"cannot read {args.json}: {exc}")
    out = args.out or args.json.with_suffix(".png")
    written = (render_attn if args.kind == "attn" else render)(doc, out)
    if written is not None:
        print(f"wrote {written}")
    return 0 if written is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
