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
import sys
from pathlib import Path

if not __package__:  # run as a script: this checkout's packages, not installed ones
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.cli import (  # noqa: E402
    add_replay_options, int_list, kernel_main, kernel_parser, options_record, write_result)
from benchmarks.kernels.timing import time_graph  # noqa: E402

EXPERTS, TOP_K = 128, 8  # Qwen3-30B-A3B


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = kernel_parser(__doc__)
    p.add_argument("--rows", type=int_list, default=[1, 8, 32, 64, 256, 1024, 2048, 8192],
                   help="comma list of a step's rows (tokens) (default: "
                        "1,8,32,64,256,1024,2048,8192)")
    add_replay_options(p, 48, "launches captured in one CUDA graph (default: 48, the MoE layers "
                       "of Qwen3-30B-A3B)", 50, 5)
    p.add_argument("--seed", type=int, default=0, help="RNG seed (default: 0)")
    args = p.parse_args(argv)
    if any(r < 1 for r in args.rows) or args.graph_launches < 1 or args.replays < 1:
        p.error(f"--rows {args.rows}, --graph-launches {args.graph_launches} and --replays "
                f"{args.replays} must be positive")
    return args


def run(args: argparse.Namespace) -> int:
    import torch
    from vllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk

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
            us = {name: time_graph(torch, [fn], *timing) for name, fn in ways.items()}
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
                  args=options_record(args),
                  rows=rows_out, ratios=ratios, mismatches=mismatches)
    write_result(result, args.out)
    return 1 if mismatches else 0


def main(argv: list[str] | None = None) -> int:
    return kernel_main("benchmarks.kernels.router", argv, parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
