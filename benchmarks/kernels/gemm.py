#!/usr/bin/env python
"""Decode linear-layer micro-benchmark: vllm_moe_graphs' small-M GEMM vs torch (cuBLAS).

For every (shape, M) both compute out[M, N] = x[M, K] @ weight[N, K]^T (+ bias) on the same
inputs: ours through `small_m_linear` (the config from `choose_small_m_config` unless the
tunables below override it), torch through `torch.nn.functional.linear`, which is what vLLM's
unquantized linear layers call. Shapes are the decode linears of Qwen3-0.6B, Qwen3-8B and the
attention of Qwen3-30B-A3B (gate_up/qkv are the merged projections).

Timing: each op is launched `--graph-launches` times inside one CUDA graph, the graph is replayed
and CUDA events give the time per launch. A weight that fits in L2 would stay there across
launches, so launches rotate over enough copies of the weight to stream >= max(3x L2,
`--min-stream-mib`) per replay (like successive layers of a model). x stays L2-resident, as a
decode activation does. The HBM floor is (weight + bias + x + out bytes) / bandwidth, bandwidth
measured in the same run by a large device-to-device copy.

Output: a table on stdout and a JSON file (`--out`) with `rows`, `ratios` keyed
`gemm_torch_over_plugin/<shape>/m<M>` (torch time / our time, > 1 means ours is faster) and
`pct_hbm` per row; with `--sweep`, every tried config per (shape, M), the best per (shape, M)
and the best per shape (least total time over `--sweep-ms`: the config must not depend on M, or
a row's bits would move with the batch size). Exit status 1 if any shape disagrees numerically,
2 without CUDA.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from dataclasses import asdict
from pathlib import Path

if not __package__:  # run as a script: this checkout's packages, not installed ones
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.cli import (  # noqa: E402
    add_replay_options, int_list, kernel_main, kernel_parser, options_record, split_list,
    write_result)
from benchmarks.kernels.timing import DEVICE, device_header, time_graph  # noqa: E402

# name -> (N, K): out_features x in_features
SHAPES: dict[str, tuple[int, int]] = {
    "qwen3-0.6b/qkv": (4096, 1024),
    "qwen3-0.6b/o_proj": (1024, 2048),
    "qwen3-0.6b/gate_up": (6144, 1024),
    "qwen3-0.6b/down": (1024, 3072),
    "qwen3-8b/qkv": (6144, 4096),
    "qwen3-8b/o_proj": (4096, 4096),
    "qwen3-8b/gate_up": (24576, 4096),
    "qwen3-8b/down": (4096, 12288),
    "qwen3-30b-a3b/qkv": (5120, 2048),
    "qwen3-30b-a3b/o_proj": (2048, 4096),
}
MAX_WEIGHT_COPIES = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = kernel_parser(__doc__)
    p.add_argument("--shapes", default=",".join(SHAPES),
                   help=f"comma list from {list(SHAPES)} (default: all)")
    p.add_argument("--ms", type=int_list, default=[1, 2, 4, 8, 16],
                   help="comma list of M (decode rows), each <= 16 (default: 1,2,4,8,16)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16",
                   help="x/weight dtype (default: bf16)")
    p.add_argument("--bias", action="store_true", help="add a bias (default: none, as Qwen3)")
    add_replay_options(p, 64, "launches captured in one CUDA graph; raised to the number of "
                       "weight copies when L2 rotation needs more (default: 64)", 20, 3)
    p.add_argument("--min-stream-mib", type=float, default=64.0,
                   help="stream at least this many MiB of weights per replay, and >= 3x L2 "
                        "(default: 64)")
    p.add_argument("--no-l2-rotate", action="store_true",
                   help="let every launch read the same weight copy even when it fits in L2")
    p.add_argument("--copy-gib", type=float, default=4.0,
                   help="size of the device-to-device copy that measures HBM bandwidth "
                        "(default: 4)")
    p.add_argument("--atol", type=float, default=2e-2,
                   help="agreement tolerance between ours and torch (default: 2e-2)")
    p.add_argument("--rtol", type=float, default=2e-2, help="relative tolerance (default: 2e-2)")
    p.add_argument("--seed", type=int, default=0, help="RNG seed (default: 0)")
    # our kernel's tunables (default: choose_small_m_config's pick per shape)
    p.add_argument("--block-n", type=int, default=None, help="our kernel: N per program")
    p.add_argument("--block-k", type=int, default=None, help="our kernel: K per loop step")
    p.add_argument("--num-splits", default="auto",
                   help="our kernel: split-K factor, 'auto' = choose_small_m_config "
                        "(default: auto)")
    p.add_argument("--num-warps", type=int, default=None, help="our kernel: warps per program")
    p.add_argument("--num-stages", type=int, default=None,
                   help="our kernel: software pipeline depth")
    p.add_argument("--swap-ab", type=int, choices=(0, 1), default=None,
                   help="our kernel: 1 = weight as the MMA's A operand (out^T = W x^T)")
    # sweep
    p.add_argument("--sweep", action="store_true",
                   help="also time our kernel over the product of the --sweep-* lists at each "
                        "M in --sweep-ms and report the best config per (shape, M) and per "
                        "shape (rows/ratios keep the default config); the default lists make "
                        "96 configs per (shape, M): narrow them for quick runs")
    p.add_argument("--sweep-ms", type=int_list, default=[1, 16],
                   help="sweep: the M values to sweep at (default: 1,16)")
    p.add_argument("--sweep-block-n", type=int_list, default=[32, 64, 128],
                   help="sweep: BLOCK_N values (default: 32,64,128)")
    p.add_argument("--sweep-block-k", type=int_list, default=[128, 256],
                   help="sweep: BLOCK_K values (default: 128,256)")
    p.add_argument("--sweep-splits", type=split_list, default=["auto", "1", "4", "8"],
                   help="sweep: split-K values, 'auto' (choose_small_m_config's, for this "
                        "BLOCK_N/BLOCK_K) or integers (default: auto,1,4,8)")
    p.add_argument("--sweep-num-warps", type=int_list, default=[4, 8],
                   help="sweep: num_warps values (default: 4,8)")
    p.add_argument("--sweep-num-stages", type=int_list, default=[3, 4],
                   help="sweep: num_stages values (default: 3,4)")
    p.add_argument("--sweep-swap-ab", type=int_list, default=[0, 1],
                   help="sweep: swap_ab values, 0/1 (default: 0,1)")
    args = p.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    unknown = sorted(set(args.shapes) - set(SHAPES))
    if unknown:
        p.error(f"unknown shape(s) {unknown}; choose from {list(SHAPES)}")
    bad_m = [m for m in args.ms + args.sweep_ms if not 1 <= m <= 16]
    if bad_m:
        p.error(f"M values must be in 1..16 (small_m_linear's MAX_M), got {bad_m}")
    if args.num_splits != "auto" and not args.num_splits.isdigit():
        p.error(f"--num-splits must be 'auto' or an integer, got {args.num_splits!r}")
    return args


# ----------------------------------------------------------------------------- helpers


def default_config(args: argparse.Namespace, n: int, k: int, num_sms: int):
    from vllm_moe_graphs.ops import SmallMGemmConfig, choose_small_m_config
    from vllm_moe_graphs.ops import small_m_plan as smg

    cfg = choose_small_m_config(1, n, k, num_sms)
    over = dict(block_n=args.block_n, block_k=args.block_k, num_warps=args.num_warps,
                num_stages=args.num_stages,
                swap_ab=None if args.swap_ab is None else bool(args.swap_ab))
    fields = {**asdict(cfg), **{f: v for f, v in over.items() if v is not None}}
    if args.num_splits != "auto":
        fields["num_splits"] = int(args.num_splits)
    elif args.block_n or args.block_k:
        fields["num_splits"] = smg.auto_num_splits(n, k, fields["block_n"], fields["block_k"],
                                                   num_sms)
    return SmallMGemmConfig(**fields)


class Case:
    """Weights (rotating copies), x, bias and outputs for one (shape, M)."""

    def __init__(self, torch, n: int, k: int, m: int, dtype, copies: int, bias: bool,
                 seed: int):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.n, self.k, self.m = n, k, m
        self.weights = [
            (torch.randn(n, k, generator=gen, device=DEVICE) / math.sqrt(k)).to(dtype)
            for _ in range(copies)
        ]
        self.x = torch.randn(m, k, generator=gen, device=DEVICE).to(dtype)
        self.bias = torch.randn(n, generator=gen, device=DEVICE).to(dtype) if bias else None
        self.out = torch.empty(m, n, device=DEVICE, dtype=dtype)
        self.elem = self.x.element_size()

    def io_bytes(self) -> int:
        bias = self.n if self.bias is not None else 0
        return (self.n * self.k + bias + self.m * self.k + self.m * self.n) * self.elem


# ----------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> int:
    import torch

    from vllm_moe_graphs.ops import SmallMGemmConfig, small_m_linear, small_m_workspace_numel
    from vllm_moe_graphs.ops import small_m_plan as smg

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    num_sms, l2_bytes, bandwidth = device_header(torch, args.copy_gib)
    stream_bytes = max(3 * l2_bytes, args.min_stream_mib * 2**20)
    rows, sweeps, shape_best, ratios, pct_hbm, failures = [], [], {}, {}, {}, []
    linear = torch.nn.functional.linear

    for name in args.shapes:
        n, k = SHAPES[name]
        cfg = default_config(args, n, k, num_sms)
        one_copy = n * k * dtype.itemsize
        copies = 1 if args.no_l2_rotate else max(1, min(MAX_WEIGHT_COPIES,
                                                        math.ceil(stream_bytes / one_copy)))
        timing = (max(args.graph_launches, copies), args.warmup_replays, args.replays)
        trial_cfgs = []
        if args.sweep:
            grid = itertools.product(args.sweep_block_n, args.sweep_block_k,
                                     args.sweep_num_warps, args.sweep_num_stages,
                                     args.sweep_swap_ab, args.sweep_splits)
            for bn, bk, warps, stages, swap, s in grid:
                splits = smg.auto_num_splits(n, k, bn, bk, num_sms) if s == "auto" else int(s)
                trial_cfgs.append(SmallMGemmConfig(bn, bk, splits, warps, stages, bool(swap)))
            trial_cfgs = list(dict.fromkeys(trial_cfgs))  # 'auto' may repeat an integer
        max_splits = max(c.num_splits for c in [cfg, *trial_cfgs])
        workspace = torch.empty(max(1, max_splits * 16 * n), device=DEVICE)
        assert workspace.numel() >= small_m_workspace_numel(16, n, cfg), "benchmark setup"
        per_shape: dict[SmallMGemmConfig, dict[int, float]] = {}

        for m in args.ms:
            key = f"{name}/m{m}"
            case = Case(torch, n, k, m, dtype, copies, args.bias, args.seed)

            def ours_fns(c, case=case):
                return [lambda w=w: small_m_linear(case.x, w, case.bias, out=case.out,
                                                   workspace=workspace, config=c)
                        for w in case.weights]

            torch_fns = [lambda w=w: linear(case.x, w, case.bias) for w in case.weights]
            ref = linear(case.x, case.weights[0], case.bias)
            ours = small_m_linear(case.x, case.weights[0], case.bias, workspace=workspace,
                                  config=cfg)
            torch.cuda.synchronize()
            diff = (ours.float() - ref.float()).abs().max().item()
            agree = bool(torch.isfinite(ours).all()) and torch.allclose(
                ours.float(), ref.float(), atol=args.atol, rtol=args.rtol)
            if not agree:
                failures.append(key)
                print(f"# MISMATCH {key}: max |ours - torch| = {diff:.3e}", flush=True)

            torch_us = time_graph(torch, torch_fns, *timing)
            ours_us = time_graph(torch, ours_fns(cfg), *timing)
            floor_us = case.io_bytes() / bandwidth * 1e6
            row = dict(shape=name, n=n, k=k, m=m, dtype=args.dtype, bias=args.bias,
                       **asdict(cfg), plugin_us=ours_us, torch_us=torch_us,
                       ratio=torch_us / ours_us, hbm_floor_us=floor_us,
                       pct_hbm=100 * floor_us / ours_us, torch_pct_hbm=100 * floor_us / torch_us,
                       weight_copies=copies, graph_launches=timing[0], max_abs_diff=diff,
                       agree=agree)
            rows.append(row)
            ratios[f"gemm_torch_over_plugin/{key}"] = row["ratio"]
            pct_hbm[key] = row["pct_hbm"]
            print(f"{name:>22} m{m:<3} bn {cfg.block_n:>3} bk {cfg.block_k:>3} "
                  f"splits {cfg.num_splits:>2}  ours {ours_us:8.2f} us  torch {torch_us:8.2f} us"
                  f"  ratio {row['ratio']:5.2f}  hbm {row['pct_hbm']:5.1f}% "
                  f"(torch {row['torch_pct_hbm']:5.1f}%)  diff {diff:.1e}"
                  f"{'' if agree else '  MISMATCH'}", flush=True)

            if args.sweep and m in args.sweep_ms:
                trials = []
                for c in trial_cfgs:
                    try:
                        us = time_graph(torch, ours_fns(c), *timing)
                    except Exception as exc:  # e.g. out of shared memory for a big config
                        trials.append(dict(**asdict(c), error=repr(exc)[:200]))
                        continue
                    per_shape.setdefault(c, {})[m] = us
                    trials.append(dict(**asdict(c), us=us, pct_hbm=100 * floor_us / us,
                                       ratio=torch_us / us))
                ok = [t for t in trials if "us" in t]
                best = min(ok, key=lambda t: t["us"]) if ok else None
                sweeps.append(dict(shape=name, m=m, torch_us=torch_us, default_us=ours_us,
                                   best=best, trials=trials))
                if best:
                    print(f"{'':>22} sweep best: bn {best['block_n']} bk {best['block_k']} "
                          f"splits {best['num_splits']} warps {best['num_warps']} stages "
                          f"{best['num_stages']} swap {int(best['swap_ab'])}: {best['us']:.2f} us,"
                          f" ratio {best['ratio']:.2f}, hbm {best['pct_hbm']:.1f}%", flush=True)
            del case
        swept = [m for m in args.ms if m in args.sweep_ms]
        full = {c: sum(t.values()) for c, t in per_shape.items() if len(t) == len(swept)}
        if full:
            best_cfg = min(full, key=full.get)
            shape_best[name] = dict(**asdict(best_cfg), total_us=full[best_cfg], ms=swept,
                                    per_m_us=per_shape[best_cfg])
            print(f"{'':>22} best for all M {swept}: {best_cfg}", flush=True)
        del workspace
        torch.cuda.empty_cache()

    result = dict(
        device=torch.cuda.get_device_name(0), num_sms=num_sms, hbm_bandwidth_bytes_per_s=bandwidth,
        args=options_record(args),
        rows=rows, ratios=ratios, pct_hbm=pct_hbm, mismatches=failures,
    )
    if args.sweep:
        result["sweep"] = sweeps
        result["sweep_best_per_shape"] = shape_best
    write_result(result, args.out)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    return kernel_main("benchmarks.kernels.gemm", argv, parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
