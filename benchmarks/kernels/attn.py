#!/usr/bin/env python
"""Decode attention micro-benchmark: vllm_moe_graphs' paged decode kernel vs vLLM 0.26's
TRITON_ATTN and FLASH_ATTN (FlashAttention 3, the H200's default backend).

All kernels read the same vLLM 0.26 KV cache (logical [NB, Hkv, BS, 2D], physically NHD, the
views both vLLM backends take with `kv_cache.transpose(1, 2).split(D, -1)`) through the same
block table, for every (model, batch, context): all sequences hold exactly `context` tokens in
randomly scattered pages. vLLM's `unified_attention` is called exactly as
`TritonAttentionImpl.forward` does for a decode batch (cu_seqlens_q = arange, max_seqlen_q 1,
unit k/v descales, the 3D softmax-segment buffers and the seq_threshold_3D that the metadata
builder derives with CUDA graphs on). FA3's `flash_attn_varlen_func` is called as
`FlashAttentionImpl.forward` does under full CUDA graphs: the ahead-of-time scheduler metadata
(`get_scheduler_metadata`, built outside the graph like the metadata builder does) and
`num_splits` = `flash_attn_max_num_splits_for_cuda_graph`. Where FA3 is not importable (no
vLLM FlashAttention build) its columns are left empty with the reason.

Timing: each kernel is launched `--graph-launches` times inside one CUDA graph, the graph is
replayed and CUDA events give the time per launch. Small caches would stay in L2 across
launches, so launches rotate over enough copies of the cache to stream >= 3x L2 per replay
(like successive layers of a model; more launches per graph if needed). The HBM floor is
(KV + q + out bytes) / bandwidth, bandwidth measured in the same run by a large
device-to-device copy.

Output: a table on stdout and a JSON file (`--out`) with `rows`, `ratios` keyed
`attn_vllm_triton_attn_over_plugin/<model>/b<batch>/c<context>` and
`attn_vllm_flash_attn_over_plugin/...` (vLLM time / our time, > 1 means ours is faster) and
`pct_hbm` per row; with `--sweep`, also every tried kernel config per shape
and the best one. Exit status 1 if any shape disagrees numerically, 2 without CUDA.
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

from benchmarks.kernels.attn_case import (  # noqa: E402
    MODELS, Case, Ours, VllmFlashAttn, VllmTritonAttn, flash_attn_problem, max_diff)
from benchmarks.kernels.cli import (  # noqa: E402
    add_replay_options, int_list, kernel_main, kernel_parser, options_record, split_list,
    write_result)
from benchmarks.kernels.timing import DEVICE, device_header, time_graph  # noqa: E402

MAX_CACHE_COPIES = 256


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = kernel_parser(__doc__)
    p.add_argument("--models", default=",".join(MODELS),
                   help=f"comma list from {sorted(MODELS)} (default: all)")
    p.add_argument("--batches", type=int_list, default=[1, 8, 32, 64, 128],
                   help="comma list of batch sizes (default: 1,8,32,64,128)")
    p.add_argument("--contexts", type=int_list, default=[512, 2048, 8192, 32768],
                   help="comma list of context lengths (default: 512,2048,8192,32768)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16",
                   help="query/KV dtype (default: bf16)")
    p.add_argument("--block-size", type=int, default=16, help="KV cache page size (default: 16)")
    add_replay_options(p, 20, "kernel launches captured in one CUDA graph; raised to the number "
                       "of cache copies when L2 rotation needs more (default: 20)", 10, 3)
    p.add_argument("--no-l2-rotate", action="store_true",
                   help="let every launch read the same cache copy even when it fits in L2 "
                        "(default: rotate over enough copies to stream >= 3x L2 per replay)")
    p.add_argument("--copy-gib", type=float, default=4.0,
                   help="size of the device-to-device copy that measures HBM bandwidth "
                        "(default: 4)")
    p.add_argument("--max-kv-gib", type=float, default=48.0,
                   help="skip shapes whose KV cache (all copies) exceeds this (default: 48)")
    p.add_argument("--atol", type=float, default=2e-2,
                   help="agreement tolerance between the two kernels (default: 2e-2)")
    p.add_argument("--rtol", type=float, default=2e-2, help="relative tolerance (default: 2e-2)")
    p.add_argument("--seed", type=int, default=0, help="RNG seed (default: 0)")
    # our kernel's tunables (defaults: the ones the plugin ships)
    p.add_argument("--block-n", type=int, default=None,
                   help="our kernel: tokens per loop step (default: decode_plan.DEFAULT_BLOCK_N)")
    p.add_argument("--num-warps", type=int, default=None,
                   help="our kernel: warps per program (default: decode_plan.DEFAULT_NUM_WARPS)")
    p.add_argument("--num-stages", type=int, default=None,
                   help="our kernel: software pipeline depth (default: "
                        "decode_plan.DEFAULT_NUM_STAGES)")
    p.add_argument("--num-splits", default="auto",
                   help="our kernel: split-K factor, 'auto' = choose_num_splits (default: auto)")
    # sweep
    p.add_argument("--sweep", action="store_true",
                   help="also time our kernel over the product of the --sweep-* lists per shape "
                        "and report the best config (rows/ratios keep the default config); the "
                        "default lists make 192 configs per shape: narrow them for quick runs")
    p.add_argument("--sweep-block-n", type=int_list, default=[32, 64, 128],
                   help="sweep: BLOCK_N values (default: 32,64,128)")
    p.add_argument("--sweep-num-warps", type=int_list, default=[4, 8],
                   help="sweep: num_warps values (default: 4,8)")
    p.add_argument("--sweep-num-stages", type=int_list, default=[1, 2, 3, 4],
                   help="sweep: num_stages values (default: 1,2,3,4)")
    p.add_argument("--sweep-splits", type=split_list, default=["auto", "1", "2", "4", "8", "16",
                                                            "32", "64"],
                   help="sweep: split-K values, 'auto' or integers (default: "
                        "auto,1,2,4,8,16,32,64)")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {sorted(MODELS)}")
    if args.num_splits != "auto" and not args.num_splits.isdigit():
        p.error(f"--num-splits must be 'auto' or an integer, got {args.num_splits!r}")
    return args


# ----------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> int:
    import torch

    from vllm_moe_graphs.ops import DecodeKernelConfig, choose_num_splits
    from vllm_moe_graphs.ops import decode_plan as pd

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    num_sms, l2_bytes, bandwidth = device_header(torch, args.copy_gib)
    default_cfg = DecodeKernelConfig(
        block_n=args.block_n or pd.DEFAULT_BLOCK_N,
        num_warps=args.num_warps or pd.DEFAULT_NUM_WARPS,
        num_stages=args.num_stages or pd.DEFAULT_NUM_STAGES,
    )
    rows, sweeps, ratios, pct_hbm, failures = [], [], {}, {}, []
    fa3_problem = flash_attn_problem()
    if fa3_problem:
        print(f"# FLASH_ATTN (FA3) not measured: {fa3_problem}", flush=True)

    for model, batch, context in itertools.product(args.models, args.batches, args.contexts):
        shape = MODELS[model]
        key = f"{model}/b{batch}/c{context}"
        one_copy = batch * context * shape.num_kv_heads * shape.head_size * 2 * dtype.itemsize
        # enough copies that one graph replay streams >= 3x L2 (capped), like a model's layers
        copies = 1 if args.no_l2_rotate else max(1, min(MAX_CACHE_COPIES,
                                                        math.ceil(3 * l2_bytes / one_copy)))
        timing = (max(args.graph_launches, copies), args.warmup_replays, args.replays)
        if copies * one_copy > args.max_kv_gib * 2**30:
            print(f"# skip {key}: {copies * one_copy / 2**30:.1f} GiB of KV > --max-kv-gib")
            continue
        case = Case(torch, shape, batch, context, args.block_size, dtype, copies, args.seed)
        auto_splits = choose_num_splits(batch, shape.num_kv_heads, context, num_sms)
        split_values = [auto_splits if args.num_splits == "auto" else int(args.num_splits)]
        if args.sweep:
            split_values += [auto_splits if s == "auto" else int(s) for s in args.sweep_splits]
        workspace = pd.allocate_decode_workspace(batch, shape.num_q_heads, shape.head_size,
                                                 max(split_values), DEVICE)
        vllm = VllmTritonAttn(torch, case)
        ours = Ours(torch, case, split_values[0], default_cfg, workspace)
        fa3 = None if fa3_problem else VllmFlashAttn(torch, case, args.block_size, dtype)

        # numerics first: every kernel on copy 0, compared with ours
        vllm(0, case.out_vllm)
        ours(0, case.out_ours)
        torch.cuda.synchronize()
        diff = max_diff(case.out_ours, case.out_vllm)
        agree = bool(torch.isfinite(case.out_ours).all()) and torch.allclose(
            case.out_ours.float(), case.out_vllm.float(), atol=args.atol, rtol=args.rtol)
        fa3_diff = None
        if fa3 is not None:
            out_fa3 = torch.empty_like(case.out_ours)
            fa3(0, out_fa3)
            torch.cuda.synchronize()
            fa3_diff = max_diff(case.out_ours, out_fa3)
            agree = agree and torch.allclose(case.out_ours.float(), out_fa3.float(),
                                             atol=args.atol, rtol=args.rtol)
        if not agree:
            failures.append(key)
            print(f"# MISMATCH {key}: max |ours - TRITON_ATTN| = {diff:.3e}, "
                  f"|ours - FA3| = {fa3_diff}", flush=True)

        def fns(kernel, out):
            return [lambda i=i: kernel(i, out) for i in range(copies)]

        vllm_us = time_graph(torch, fns(vllm, case.out_vllm), *timing)
        ours_us = time_graph(torch, fns(ours, case.out_ours), *timing)
        fa3_us = None if fa3 is None else time_graph(torch, fns(fa3, out_fa3), *timing)
        floor_us = case.io_bytes() / bandwidth * 1e6
        row = dict(model=model, batch=batch, context=context, dtype=args.dtype,
                   block_size=args.block_size, num_splits=split_values[0], **asdict(default_cfg),
                   plugin_us=ours_us, vllm_us=vllm_us, ratio=vllm_us / ours_us,
                   hbm_floor_us=floor_us, pct_hbm=100 * floor_us / ours_us,
                   vllm_pct_hbm=100 * floor_us / vllm_us, kv_bytes=case.kv_bytes(),
                   cache_copies=copies, graph_launches=timing[0], max_abs_diff=diff,
                   fa3_us=fa3_us, fa3_ratio=None if fa3_us is None else fa3_us / ours_us,
                   fa3_pct_hbm=None if fa3_us is None else 100 * floor_us / fa3_us,
                   fa3_max_abs_diff=fa3_diff, agree=agree)
        rows.append(row)
        ratios[f"attn_vllm_triton_attn_over_plugin/{key}"] = row["ratio"]
        if fa3_us is not None:
            ratios[f"attn_vllm_flash_attn_over_plugin/{key}"] = row["fa3_ratio"]
        pct_hbm[key] = row["pct_hbm"]
        fa3_text = "" if fa3_us is None else f"  fa3 {fa3_us:9.2f} us ({row['fa3_ratio']:5.2f})"
        print(f"{model:>14} b{batch:<4} c{context:<6} splits {split_values[0]:>2}  "
              f"ours {ours_us:9.2f} us  triton {vllm_us:9.2f} us ({row['ratio']:5.2f}){fa3_text}"
              f"  hbm {row['pct_hbm']:5.1f}% (triton {row['vllm_pct_hbm']:5.1f}%)  "
              f"diff {diff:.1e}{'' if agree else '  MISMATCH'}", flush=True)

        if args.sweep:
            trials = []
            grid = itertools.product(args.sweep_block_n, args.sweep_num_warps,
                                     args.sweep_num_stages, sorted(set(split_values[1:])))
            for block_n, warps, stages, splits in grid:
                cfg = DecodeKernelConfig(block_n=block_n, num_warps=warps, num_stages=stages)
                trial = Ours(torch, case, splits, cfg, workspace)
                try:
                    us = time_graph(torch, fns(trial, case.out_ours), *timing)
                except Exception as exc:  # e.g. out of shared memory for a big config
                    trials.append(dict(**asdict(cfg), num_splits=splits, error=repr(exc)[:200]))
                    continue
                trials.append(dict(**asdict(cfg), num_splits=splits, us=us,
                                   pct_hbm=100 * floor_us / us, ratio=vllm_us / us))
            ok = [t for t in trials if "us" in t]
            best = min(ok, key=lambda t: t["us"]) if ok else None
            sweeps.append(dict(model=model, batch=batch, context=context, vllm_us=vllm_us,
                               default_us=ours_us, best=best, trials=trials))
            if best:
                print(f"{'':>14} sweep best: block_n {best['block_n']} warps {best['num_warps']}"
                      f" stages {best['num_stages']} splits {best['num_splits']}: "
                      f"{best['us']:.2f} us, ratio {best['ratio']:.2f}, "
                      f"hbm {best['pct_hbm']:.1f}%", flush=True)
        del case, vllm, ours, fa3, workspace
        torch.cuda.empty_cache()

    result = dict(
        device=torch.cuda.get_device_name(0), num_sms=num_sms, hbm_bandwidth_bytes_per_s=bandwidth,
        args=options_record(args),
        default_config=asdict(default_cfg), rows=rows, ratios=ratios, pct_hbm=pct_hbm,
        mismatches=failures, flash_attn_problem=fa3_problem,
    )
    if args.sweep:
        result["sweep"] = sweeps
    write_result(result, args.out)
    if not args.sweep:
        from benchmarks.harness.plot import render_attn

        if (png := render_attn(result, args.out.with_suffix(".png"))) is not None:
            print(f"# wrote {png}")
    return 1 if failures else 0


def triton_attn_problem() -> str | None:
    """Why vLLM 0.26's TRITON_ATTN ops cannot be imported here (vLLM missing or built without
    CUDA), or None."""
    try:
        import vllm.v1.attention.ops.triton_unified_attention  # noqa: F401
    except Exception as exc:  # vLLM missing or built without CUDA
        return f"benchmarks.kernels.attn needs vLLM 0.26's TRITON_ATTN ops: {exc!r}"
    return None


def main(argv: list[str] | None = None) -> int:
    return kernel_main("benchmarks.kernels.attn", argv, parse_args, run, triton_attn_problem)


if __name__ == "__main__":
    sys.exit(main())
