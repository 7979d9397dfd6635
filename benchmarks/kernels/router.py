#!/usr/bin/env python
"""MoE routing micro-benchmark: the three ways a padded step's router output can reach the
fused experts of one MoE layer, on Qwen3-30B-A3B's router (128 experts, top-8, renormalized):

- `vllm`: vLLM's `fused_topk` (its CUDA `topk_softmax`), as stock vLLM routes, padding rows
  routed like real ones;
- `vllm_mask`: the same, then the plugin's mask fill of the padding rows' ids
  (`skip_moe_padding`, the default: one `masked_fill_` per layer);
- `plugin`: the plugin's top-k softmax writing the padding rows' ids in the same launch
  (`fuse_moe_padding_mask`, `ops/moe_router.py`).

Each is launched `--graph-launches` times inside one CUDA graph (as the 48 layers of a step
replay) with half the rows padding; CUDA events give the time per launch. The agreement check
compares the experts each picks by their float64 probabilities (a tie may go either way).

Output: a table on stdout and a JSON file (`--out`) with `rows` and `ratios` keyed
`router_<vllm|vllm_mask>_over_plugin/t<rows>` (> 1: the plugin's launch is faster). Exit status
1 if the picks disagree, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EXPERTS, TOP_K = 128, 8  # Qwen3-30B-A3B


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from benchmarks.kernels.attn import _ints

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="JSON file to write the results to")
    p.add_argument("--rows", type=_ints, default=[1, 8, 32, 64, 256, 1024, 2048, 8192],
                   help="comma list of a step's rows (tokens) (default: "
                        "1,8,32,64,256,1024,2048,8192)")
    p.add_argument("--graph-launches", type=int, default=48,
                   help="launches captured in one CUDA graph (default: 48, the MoE layers of "
                        "Qwen3-30B-A3B)")
    p.add_argument("--replays", type=int, default=50,
                   help="timed graph replays per measurement (default: 50)")
    p.add_argument("--warmup-replays", type=int, default=5,
                   help="untimed graph replays before timing (default: 5)")
    p.add_argument("--seed", type=int, default=0, help="RNG seed (default: 0)")
    args = p.parse_args(argv)
    if any(r < 1 for r in args.rows) or args.graph_launches < 1 or args.replays < 1:
        p.error(f"--rows {args.rows}, --graph-launches {args.graph_launches} and --replays "
                f"{args.replays} must be positive")
    return args


def run(args: argparse.Namespace) -> int:
    import torch
    from vllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk

    from benchmarks.kernels.attn import _time_graph
    from vllm_moe_graphs.integration.model.moe_padding import MoePadding, sentinel

    rows_out, ratios, mismatches = [], {}, []
    print(f"# {torch.cuda.get_device_name(0)}: routing of {EXPERTS} experts, top-{TOP_K}, "
          f"{args.graph_launches} launches per graph, half the rows padding", flush=True)
    for t in args.rows:
        gen = torch.Generator(device="cuda").manual_seed(args.seed + t)
        logits = torch.randn(t, EXPERTS, generator=gen, device="cuda").to(torch.bfloat16)
        hidden = torch.empty(t, 8, device="cuda", dtype=torch.bfloat16)
        padding = MoePadding(t, "cuda")
        mask, route = padding.rewrite(TOP_K, EXPERTS), padding.route(TOP_K, EXPERTS, True)

        def vllm():
            return fused_topk(hidden, logits, TOP_K, True)[:2]

        def vllm_mask():
            weights, ids = vllm()
            mask(ids)
            return weights, ids

        def plugin():
            return route(logits, None)

        ways = {"vllm": vllm, "vllm_mask": vllm_mask, "plugin": plugin}
        real = max(1, t // 2)
        with padding.padded(real):
            padding.begin(t)
            picks = {name: fn()[1].long() for name, fn in ways.items()}
            probs = torch.softmax(logits.double(), -1)[:real]
            agree = torch.allclose(probs.gather(1, picks["plugin"][:real]),
                                   probs.gather(1, picks["vllm"][:real]), atol=1e-6, rtol=0)
            agree &= bool((picks["plugin"][real:] == sentinel(t, TOP_K, EXPERTS)).all())
            agree &= torch.equal(picks["plugin"][real:], picks["vllm_mask"][real:])
            timing = (args.graph_launches, args.warmup_replays, args.replays)
            us = {name: _time_graph(torch, [fn], *timing) for name, fn in ways.items()}
        if not agree:
            mismatches.append(t)
        row = dict(rows=t, real_rows=real, **{f"{k}_us": v for k, v in us.items()}, agree=agree)
        rows_out.append(row)
        for base in ("vllm", "vllm_mask"):
            ratios[f"router_{base}_over_plugin/t{t}"] = us[base] / us["plugin"]
        print(f"rows {t:>5}  vllm {us['vllm']:6.2f} us  vllm+mask {us['vllm_mask']:6.2f} us  "
              f"plugin {us['plugin']:6.2f} us  (vllm+mask / plugin "
              f"{us['vllm_mask'] / us['plugin']:4.2f}x){'' if agree else '  MISMATCH'}",
              flush=True)
    result = dict(device=torch.cuda.get_device_name(0),
                  args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                  rows=rows_out, ratios=ratios, mismatches=mismatches)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"# wrote {args.out}")
    return 1 if mismatches else 0


def main(argv: list[str] | None = None) -> int:
    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:  # run as a script: this checkout's packages, not installed ones
        sys.path.insert(0, root)
    args = parse_args(argv)
    from benchmarks.harness.sweep import torch_cuda_problem

    if (problem := torch_cuda_problem("benchmarks.kernels.router")) is not None:
        print(problem, file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
