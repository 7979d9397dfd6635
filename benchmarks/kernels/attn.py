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
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class AttnShape:
    num_q_heads: int
    num_kv_heads: int
    head_size: int


MODELS: dict[str, AttnShape] = {
    "qwen3-0.6b": AttnShape(16, 8, 128),
    "qwen3-30b-a3b": AttnShape(32, 4, 128),
}
# vLLM's default CUDA graph capture sizes (config/vllm.py); TRITON_ATTN snaps its 3D threshold
# to the closest one.
VLLM_CAPTURE_SIZES = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))
MAX_CACHE_COPIES = 256
DEVICE = "cuda"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _splits(text: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    for x in items:
        if x != "auto" and not x.isdigit():
            raise argparse.ArgumentTypeError(f"split values are 'auto' or integers, got {x!r}")
    return items


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, required=True, help="JSON file to write the results to")
    p.add_argument("--models", default=",".join(MODELS),
                   help=f"comma list from {sorted(MODELS)} (default: all)")
    p.add_argument("--batches", type=_ints, default=[1, 8, 32, 64, 128],
                   help="comma list of batch sizes (default: 1,8,32,64,128)")
    p.add_argument("--contexts", type=_ints, default=[512, 2048, 8192, 32768],
                   help="comma list of context lengths (default: 512,2048,8192,32768)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16",
                   help="query/KV dtype (default: bf16)")
    p.add_argument("--block-size", type=int, default=16, help="KV cache page size (default: 16)")
    p.add_argument("--graph-launches", type=int, default=20,
                   help="kernel launches captured in one CUDA graph; raised to the number of "
                        "cache copies when L2 rotation needs more (default: 20)")
    p.add_argument("--replays", type=int, default=10,
                   help="timed graph replays per measurement (default: 10)")
    p.add_argument("--warmup-replays", type=int, default=3,
                   help="untimed graph replays before timing (default: 3)")
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
    p.add_argument("--sweep-block-n", type=_ints, default=[32, 64, 128],
                   help="sweep: BLOCK_N values (default: 32,64,128)")
    p.add_argument("--sweep-num-warps", type=_ints, default=[4, 8],
                   help="sweep: num_warps values (default: 4,8)")
    p.add_argument("--sweep-num-stages", type=_ints, default=[1, 2, 3, 4],
                   help="sweep: num_stages values (default: 1,2,3,4)")
    p.add_argument("--sweep-splits", type=_splits, default=["auto", "1", "2", "4", "8", "16",
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


# ----------------------------------------------------------------------------- GPU helpers


def _time_graph(torch, fns, graph_launches: int, warmup: int, replays: int) -> float:
    """Microseconds per launch: capture fns[i % len(fns)] for i < graph_launches, replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(graph_launches):
            fns[i % len(fns)]()
    for _ in range(warmup):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    us = start.elapsed_time(end) * 1e3 / (replays * graph_launches)
    del graph
    return us


def device_header(torch, copy_gib: float) -> tuple[int, int, float]:
    """(SMs, L2 bytes, copy bandwidth in bytes/s) of GPU 0, printed as the output's first line."""
    props = torch.cuda.get_device_properties(0)
    num_sms, l2_bytes = props.multi_processor_count, getattr(props, "L2_cache_size", 50 << 20)
    bandwidth = measure_hbm_bandwidth(torch, copy_gib)
    print(f"# {props.name}: {num_sms} SMs, L2 {l2_bytes >> 20} MiB, "
          f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    return num_sms, l2_bytes, bandwidth


def measure_hbm_bandwidth(torch, gib: float) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    reps = 10
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * reps / seconds


class Case:
    """Caches, block table and buffers for one (model, batch, context)."""

    def __init__(self, torch, shape: AttnShape, batch: int, context: int, block_size: int,
                 dtype, copies: int, seed: int):
        from vllm_moe_graphs.ops import split_kv_cache

        self.shape, self.batch, self.context = shape, batch, context
        pages_per_seq = math.ceil(context / block_size)
        num_blocks = batch * pages_per_seq + 1
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.kv_caches = []
        self.views = []
        for _ in range(copies):
            raw = torch.randn(num_blocks, block_size, shape.num_kv_heads, 2 * shape.head_size,
                              generator=gen, device=DEVICE, dtype=dtype)
            kv_cache = raw.permute(0, 2, 1, 3)  # logical [NB, Hkv, BS, 2D], physically NHD
            self.kv_caches.append(kv_cache)
            self.views.append(split_kv_cache(kv_cache, shape.head_size))
            del raw
        perm = torch.randperm(num_blocks - 1, generator=gen, device=DEVICE) + 1
        self.block_table = perm[: batch * pages_per_seq].view(batch, pages_per_seq).int()
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
        self.query = torch.randn(batch, shape.num_q_heads, shape.head_size, generator=gen,
                                 device=DEVICE).to(dtype)
        self.out_ours = torch.empty_like(self.query)
        self.out_vllm = torch.empty_like(self.query)
        self.scale = 1.0 / math.sqrt(shape.head_size)
        self.cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
        self.elem = self.query.element_size()

    def kv_bytes(self) -> int:
        s = self.shape
        return self.batch * self.context * s.num_kv_heads * s.head_size * 2 * self.elem

    def io_bytes(self) -> int:
        return self.kv_bytes() + 2 * self.query.numel() * self.elem


class VllmTritonAttn:
    """vLLM 0.26 `unified_attention` called the way TritonAttentionImpl.forward calls it."""

    def __init__(self, torch, case: Case):
        from vllm.v1.attention.backends import triton_attn
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention
        from vllm.v1.kv_cache_interface import KVQuantMode

        self.fn = unified_attention
        self.kv_quant_mode = KVQuantMode.NONE
        shape = case.shape
        threshold = triton_attn.MIN_LAUNCH_GRID_SIZE_2D // shape.num_kv_heads
        self.seq_threshold_3D = min(VLLM_CAPTURE_SIZES, key=lambda x: abs(x - threshold))
        self.segments = triton_attn.NUM_PAR_SOFTMAX_SEGMENTS
        pad = 1 << (shape.head_size - 1).bit_length()
        f32 = dict(dtype=torch.float32, device=DEVICE)
        self.segm_output = torch.empty(
            (self.seq_threshold_3D, shape.num_q_heads, self.segments, pad), **f32)
        self.segm_max = torch.empty((self.seq_threshold_3D, shape.num_q_heads, self.segments),
                                    **f32)
        self.segm_expsum = torch.empty_like(self.segm_max)
        unit = torch.tensor(1.0, **f32)  # layer._k_scale / layer._v_scale
        self.k_descale = unit.expand((case.batch, shape.num_kv_heads))
        self.v_descale = unit.expand((case.batch, shape.num_kv_heads))
        self.case = case

    def __call__(self, copy: int, out) -> None:
        c = self.case
        key_cache, value_cache = c.views[copy]
        self.fn(
            q=c.query, k=key_cache, v=value_cache, out=out,
            cu_seqlens_q=c.cu_seqlens_q, max_seqlen_q=1, seqused_k=c.seq_lens,
            max_seqlen_k=c.context, softmax_scale=c.scale, causal=True, window_size=(-1, -1),
            block_table=c.block_table, softcap=0, q_descale=None, k_descale=self.k_descale,
            v_descale=self.v_descale, seq_threshold_3D=self.seq_threshold_3D,
            num_par_softmax_segments=self.segments, softmax_segm_output=self.segm_output,
            softmax_segm_max=self.segm_max, softmax_segm_expsum=self.segm_expsum,
            alibi_slopes=None, sinks=None, output_scale=None, mm_prefix_range=None,
            rswa_prefix_lens=None, rswa_window=None, kv_quant_mode=self.kv_quant_mode,
            k_scale_cache=None, v_scale_cache=None, chunk_lookback=-1, use_td=False,
            mm_prefix_clamp_sliding_window=False,
        )


class VllmFlashAttn:
    """vLLM 0.26 FA3 `flash_attn_varlen_func` called the way FlashAttentionImpl.forward calls it
    for a decode batch under full CUDA graphs."""

    def __init__(self, torch, case: Case, block_size: int, dtype):
        from vllm.config.attention import AttentionConfig
        from vllm.v1.attention.backends.fa_utils import (
            flash_attn_varlen_func,
            get_scheduler_metadata,
        )

        shape = case.shape
        self.fn, self.case = flash_attn_varlen_func, case
        self.num_splits = AttentionConfig().flash_attn_max_num_splits_for_cuda_graph
        self.scheduler_metadata = get_scheduler_metadata(
            batch_size=case.batch, max_seqlen_q=1, max_seqlen_k=case.context,
            num_heads_q=shape.num_q_heads, num_heads_kv=shape.num_kv_heads,
            headdim=shape.head_size, cache_seqlens=case.seq_lens, qkv_dtype=dtype,
            cu_seqlens_q=case.cu_seqlens_q, page_size=block_size, causal=True,
            window_size=(-1, -1), num_splits=self.num_splits)
        unit = torch.tensor(1.0, dtype=torch.float32, device=DEVICE)  # layer._k_scale
        self.k_descale = unit.expand((case.batch, shape.num_kv_heads))
        self.v_descale = unit.expand((case.batch, shape.num_kv_heads))

    def __call__(self, copy: int, out) -> None:
        c = self.case
        key_cache, value_cache = c.views[copy]
        self.fn(
            q=c.query, k=key_cache, v=value_cache, out=out, cu_seqlens_q=c.cu_seqlens_q,
            max_seqlen_q=1, seqused_k=c.seq_lens, max_seqlen_k=c.context, softmax_scale=c.scale,
            causal=True, alibi_slopes=None, window_size=[-1, -1], block_table=c.block_table,
            softcap=0, scheduler_metadata=self.scheduler_metadata, fa_version=3,
            q_descale=None, k_descale=self.k_descale, v_descale=self.v_descale,
            num_splits=self.num_splits,
        )


def flash_attn_problem() -> str | None:
    """Why vLLM's FA3 cannot be benchmarked here, or None (the plugin's own check)."""
    from vllm_moe_graphs.integration.attention.flash_attn import flash_attn_problem as problem

    return problem()


class Ours:
    def __init__(self, torch, case: Case, num_splits: int, config, workspace):
        from vllm_moe_graphs.ops import paged_decode_attention

        self.fn, self.case = paged_decode_attention, case
        self.num_splits, self.config, self.workspace = num_splits, config, workspace

    def __call__(self, copy: int, out) -> None:
        c = self.case
        key_cache, value_cache = c.views[copy]
        self.fn(out, c.query, key_cache, value_cache, c.block_table, c.seq_lens, c.scale,
                num_splits=self.num_splits, workspace=self.workspace, config=self.config)


def _max_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


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
        diff = _max_diff(case.out_ours, case.out_vllm)
        agree = bool(torch.isfinite(case.out_ours).all()) and torch.allclose(
            case.out_ours.float(), case.out_vllm.float(), atol=args.atol, rtol=args.rtol)
        fa3_diff = None
        if fa3 is not None:
            out_fa3 = torch.empty_like(case.out_ours)
            fa3(0, out_fa3)
            torch.cuda.synchronize()
            fa3_diff = _max_diff(case.out_ours, out_fa3)
            agree = agree and torch.allclose(case.out_ours.float(), out_fa3.float(),
                                             atol=args.atol, rtol=args.rtol)
        if not agree:
            failures.append(key)
            print(f"# MISMATCH {key}: max |ours - TRITON_ATTN| = {diff:.3e}, "
                  f"|ours - FA3| = {fa3_diff}", flush=True)

        def fns(kernel, out):
            return [lambda i=i: kernel(i, out) for i in range(copies)]

        vllm_us = _time_graph(torch, fns(vllm, case.out_vllm), *timing)
        ours_us = _time_graph(torch, fns(ours, case.out_ours), *timing)
        fa3_us = None if fa3 is None else _time_graph(torch, fns(fa3, out_fa3), *timing)
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
                    us = _time_graph(torch, fns(trial, case.out_ours), *timing)
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
        args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        default_config=asdict(default_cfg), rows=rows, ratios=ratios, pct_hbm=pct_hbm,
        mismatches=failures, flash_attn_problem=fa3_problem,
    )
    if args.sweep:
        result["sweep"] = sweeps
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"# wrote {args.out}")
    if not args.sweep:
        from benchmarks.harness.plot import render_attn

        if (png := render_attn(result, args.out.with_suffix(".png"))) is not None:
            print(f"# wrote {png}")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:  # run as a script: this checkout's packages, not installed ones
        sys.path.insert(0, root)
    args = parse_args(argv)
    from benchmarks.harness.sweep import torch_cuda_problem

    if (problem := torch_cuda_problem("benchmarks.kernels.attn")) is not None:
        print(problem, file=sys.stderr)
        return 2
    try:
        import vllm.v1.attention.ops.triton_unified_attention  # noqa: F401
    except Exception as exc:  # vLLM missing or built without CUDA
        print(f"benchmarks.kernels.attn needs vLLM 0.26's TRITON_ATTN ops: {exc!r}",
              file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
