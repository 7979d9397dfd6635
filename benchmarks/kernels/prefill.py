#!/usr/bin/env python
"""Attention of steps with prefill tokens: vllm_moe_graphs' varlen paged kernel vs vLLM 0.26's
FLASH_ATTN (FlashAttention 3), on the step shapes `mixed_graphs` replays.

A case is one engine step's attention: its requests' query lengths and context lengths over one
paged KV cache (vLLM 0.26's TRITON_ATTN layout, the plugin's; every request's pages scattered at
random). Case specs (`--cases`, comma-separated):

  prefill:L        one prompt of L tokens, nothing cached
  chunk:L@P        one chunk of L tokens after P cached tokens (chunked prefill, prefix hit)
  mixed:D@C+L      D decode rows of context C next to one prompt of L tokens

Kernels, each launched inside one CUDA graph (`timing.time_graph`):
- `plugin`: `paged_prefill_attention` planned as an eager step plans it (tile from the step's
  longest query);
- `plugin_graph`: the same launch planned as a graph key plans it (tile from the token bucket:
  the next power of two of the step's tokens);
- `fa3` (where vLLM's FlashAttention 3 is importable): `flash_attn_varlen_func` as
  `FlashAttentionImpl.forward` calls it under full CUDA graphs, with ahead-of-time scheduler
  metadata built outside the graph, `max_seqlen_q` the token bucket and `max_seqlen_k` the
  longest context.

Output: a table, and a JSON file (`--out`) with `rows` (microseconds and TFLOP/s per kernel,
max |difference| to FA3) and `ratios` keyed `attn_prefill_flash_attn_over_plugin/<model>/<case>`
and `attn_prefill_flash_attn_over_plugin_graph/...` (FA3 time / ours: > 1 means ours is
faster). Exit status 1 if the kernels disagree, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import sys
from pathlib import Path

if not __package__:  # run as a script: this checkout's packages, not installed ones
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.attn_case import MODELS, flash_attn_problem  # noqa: E402
from benchmarks.kernels.cli import (  # noqa: E402
    add_replay_options, kernel_main, kernel_parser, options_record, write_result)
from benchmarks.kernels.timing import DEVICE, device_header, time_graph  # noqa: E402

DEFAULT_CASES = ("prefill:512,prefill:2048,prefill:8192,chunk:2048@4096,chunk:512@16384,"
                 "mixed:64@1024+512,mixed:32@2048+2048,mixed:128@1024+128")


@dataclasses.dataclass(frozen=True, slots=True)
class StepCase:
    """One step's attention: per request (query tokens, cached tokens before them)."""

    name: str
    requests: tuple[tuple[int, int], ...]

    @property
    def tokens(self) -> int:
        return sum(q for q, _ in self.requests)

    @property
    def max_query_len(self) -> int:
        return max(q for q, _ in self.requests)

    @property
    def max_seq_len(self) -> int:
        return max(q + c for q, c in self.requests)

    def flops(self, num_q_heads: int, head_size: int) -> float:
        """Causal attention FLOPs (QK^T and PV, 2 per multiply-add) over the visible keys."""
        visible = sum(q * c + q * (q + 1) / 2 for q, c in self.requests)
        return 4.0 * visible * num_q_heads * head_size


def parse_case(spec: str) -> StepCase:
    """`prefill:L`, `chunk:L@P` or `mixed:D@C+L` (see the module docstring)."""
    kind, _, body = spec.partition(":")
    try:
        if kind == "prefill":
            requests = ((int(body), 0),)
        elif kind == "chunk":
            q, p = body.split("@")
            requests = ((int(q), int(p)),)
        elif kind == "mixed":
            decode, prompt = body.split("+")
            d, c = decode.split("@")
            requests = ((1, int(c) - 1),) * int(d) + ((int(prompt), 0),)
        else:
            raise ValueError(f"unknown kind {kind!r}")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"bad case {spec!r} ({exc}): use prefill:L, chunk:L@P or mixed:D@C+L, e.g. "
            "mixed:64@1024+512") from None
    if any(q < 1 or c < 0 for q, c in requests):
        raise argparse.ArgumentTypeError(
            f"bad case {spec!r}: query lengths must be >= 1 and contexts >= 0 (use prefill:L, "
            "chunk:L@P or mixed:D@C+L)")
    return StepCase(spec, requests)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = kernel_parser(__doc__)
    p.add_argument("--models", default=",".join(MODELS),
                   help=f"comma list from {sorted(MODELS)} (default: all)")
    p.add_argument("--cases", default=DEFAULT_CASES,
                   help=f"comma list of case specs (default: {DEFAULT_CASES})")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16",
                   help="query/KV dtype (default: bf16)")
    p.add_argument("--block-size", type=int, default=16, help="KV cache page size (default: 16)")
    add_replay_options(p, 10, "kernel launches captured in one CUDA graph (default: 10)", 10, 3)
    p.add_argument("--atol", type=float, default=2e-2, help="agreement tolerance (default: 2e-2)")
    p.add_argument("--rtol", type=float, default=2e-2, help="relative tolerance (default: 2e-2)")
    p.add_argument("--seed", type=int, default=0, help="RNG seed (default: 0)")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {sorted(MODELS)}")
    try:
        args.cases = [parse_case(s.strip()) for s in args.cases.split(",") if s.strip()]
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    return args


def token_bucket(tokens: int) -> int:
    """The graph key's token bucket of a step under the default ladder (past its last
    bucket, the step's own tokens)."""
    from vllm_moe_graphs.config import TOKEN_BUCKETS
    from vllm_moe_graphs.graphs.buckets import pick_bucket

    return pick_bucket(tokens, TOKEN_BUCKETS) or tokens


class Step:
    """KV cache, block table, query and metadata of one case (on the GPU)."""

    def __init__(self, torch, case: StepCase, model: str, block_size: int, dtype, seed: int):
        from vllm_moe_graphs.ops import split_kv_cache

        shape = MODELS[model]
        self.case, self.shape = case, shape
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        pages = [math.ceil((q + c) / block_size) for q, c in case.requests]
        width, num_blocks = max(pages), sum(pages) + 1
        raw = torch.randn(num_blocks, block_size, shape.num_kv_heads, 2 * shape.head_size,
                          generator=gen, device=DEVICE, dtype=dtype)
        self.kv_cache = raw.permute(0, 2, 1, 3)  # logical [NB, Hkv, BS, 2D], physically NHD
        self.key_cache, self.value_cache = split_kv_cache(self.kv_cache, shape.head_size)
        perm = (torch.randperm(num_blocks - 1, generator=gen, device=DEVICE) + 1).int()
        table = torch.zeros(len(pages), width, dtype=torch.int32, device=DEVICE)
        start = 0
        for i, n in enumerate(pages):
            table[i, :n] = perm[start:start + n]
            start += n
        self.block_table = table
        q_lens = [q for q, _ in case.requests]
        self.query_start_loc = torch.tensor([0, *itertools.accumulate(q_lens)],
                                            dtype=torch.int32, device=DEVICE)
        self.seq_lens = torch.tensor([q + c for q, c in case.requests], dtype=torch.int32,
                                     device=DEVICE)
        self.query = torch.randn(case.tokens, shape.num_q_heads, shape.head_size, generator=gen,
                                 device=DEVICE).to(dtype)
        self.scale = 1.0 / math.sqrt(shape.head_size)

    def plugin(self, max_query_len: int):
        from vllm_moe_graphs.ops import paged_prefill_attention

        def run(out) -> None:
            paged_prefill_attention(out, self.query, self.key_cache, self.value_cache,
                                    self.block_table, self.query_start_loc, self.seq_lens,
                                    self.scale, max_query_len=max_query_len)
        return run

    def fa3(self, torch, block_size: int, dtype):
        from vllm.config.attention import AttentionConfig
        from vllm.v1.attention.backends.fa_utils import (flash_attn_varlen_func,
                                                         get_scheduler_metadata)

        shape, case = self.shape, self.case
        num_splits = AttentionConfig().flash_attn_max_num_splits_for_cuda_graph
        max_q = token_bucket(case.tokens)  # a graph's launch: the bucket bounds every query
        metadata = get_scheduler_metadata(
            batch_size=len(case.requests), max_seqlen_q=max_q, max_seqlen_k=case.max_seq_len,
            num_heads_q=shape.num_q_heads, num_heads_kv=shape.num_kv_heads,
            headdim=shape.head_size, cache_seqlens=self.seq_lens, qkv_dtype=dtype,
            cu_seqlens_q=self.query_start_loc, page_size=block_size, causal=True,
            window_size=(-1, -1), num_splits=num_splits)
        unit = torch.tensor(1.0, dtype=torch.float32, device=DEVICE)  # layer._k_scale
        descale = unit.expand((len(case.requests), shape.num_kv_heads))

        def run(out) -> None:
            flash_attn_varlen_func(
                q=self.query, k=self.key_cache, v=self.value_cache, out=out,
                cu_seqlens_q=self.query_start_loc, max_seqlen_q=max_q, seqused_k=self.seq_lens,
                max_seqlen_k=case.max_seq_len, softmax_scale=self.scale, causal=True,
                alibi_slopes=None, window_size=[-1, -1], block_table=self.block_table,
                softcap=0, scheduler_metadata=metadata, fa_version=3, q_descale=None,
                k_descale=descale, v_descale=descale, num_splits=num_splits)
        return run


def run(args: argparse.Namespace) -> int:
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    device_header(torch, 1.0)
    fa3_problem = flash_attn_problem()
    if fa3_problem:
        print(f"# FLASH_ATTN (FA3) not measured: {fa3_problem}", flush=True)
    timing = (args.graph_launches, args.warmup_replays, args.replays)
    rows, ratios, mismatches = [], {}, []
    for model in args.models:
        for case in args.cases:
            step = Step(torch, case, model, args.block_size, dtype, args.seed)
            kernels = {"plugin": step.plugin(case.max_query_len),
                       "plugin_graph": step.plugin(token_bucket(case.tokens))}
            if not fa3_problem:
                kernels["fa3"] = step.fa3(torch, args.block_size, dtype)
            outs = {name: torch.empty_like(step.query) for name in kernels}
            for name, fn in kernels.items():
                fn(outs[name])
            torch.cuda.synchronize()
            ref = outs.get("fa3", outs["plugin"])
            diff = max((outs[n].float() - ref.float()).abs().max().item() for n in outs)
            agree = all(torch.allclose(outs[n].float(), ref.float(), atol=args.atol,
                                       rtol=args.rtol) for n in outs)
            key = f"{model}/{case.name}"
            if not agree:
                mismatches.append(key)
            flops = case.flops(step.shape.num_q_heads, step.shape.head_size)
            row = {"model": model, "case": case.name, "tokens": case.tokens,
                   "requests": len(case.requests), "token_bucket": token_bucket(case.tokens),
                   "max_abs_diff": diff, "agree": agree, "gflop": flops / 1e9}
            for name, fn in kernels.items():
                us = time_graph(torch, [lambda fn=fn, o=outs[name]: fn(o)], *timing)
                row[f"{name}_us"] = us
                row[f"{name}_tflops"] = flops / us / 1e6
            if "fa3_us" in row:
                for name in ("plugin", "plugin_graph"):
                    ratios[f"attn_prefill_flash_attn_over_{name}/{key}"] = (
                        row["fa3_us"] / row[f"{name}_us"])
            rows.append(row)
            fa3_text = (f"  fa3 {row['fa3_us']:9.1f} us ({row['fa3_tflops']:5.0f} TF/s)"
                        if "fa3_us" in row else "")
            print(f"{model:>14} {case.name:<20} plugin {row['plugin_us']:9.1f} us "
                  f"({row['plugin_tflops']:5.0f} TF/s)  graph-planned "
                  f"{row['plugin_graph_us']:9.1f} us{fa3_text}  diff {diff:.1e}"
                  f"{'' if agree else '  MISMATCH'}", flush=True)
            del step, kernels, outs
            torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(0), "flash_attn_problem": fa3_problem,
              "args": options_record(args, drop=("cases",)),
              "cases": [c.name for c in args.cases], "rows": rows, "ratios": ratios,
              "mismatches": mismatches}
    write_result(result, args.out)
    return 1 if mismatches else 0


def main(argv: list[str] | None = None) -> int:
    return kernel_main("benchmarks.kernels.prefill", argv, parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
