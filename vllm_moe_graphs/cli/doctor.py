"""`moe-graphs doctor MODEL_OR_CONFIG_DIR [vLLM engine args]`: the capability report.

Runs on any machine (on one without CUDA it reports `no_cuda` plus any other reason). It does
not build a vLLM engine: it reads the model's config.json and the engine flags that decide
eligibility.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from vllm_moe_graphs import __version__
from vllm_moe_graphs.capability import (
    DecodeGraphCapability,
    Reason,
    config_capability,
    unproven_taken_over,
)
from vllm_moe_graphs.config import PluginConfig

EXIT_ELIGIBLE, EXIT_NOT_ELIGIBLE, EXIT_BAD_INPUT = 0, 1, 2


def _json(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {text!r} ({exc})") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The engine flags that decide eligibility, spelled as `vllm serve` spells them.

    vLLM's own full parser cannot be built on a machine without a GPU platform, so doctor reads
    these flags itself and lists any other flag as not affecting eligibility."""
    p = argparse.ArgumentParser(
        prog="moe-graphs doctor",
        description="Print the vllm_moe_graphs decode-graph capability report for a model and the "
        "vLLM engine arguments you would pass to `vllm serve`. Exit 0 when eligible, 1 when "
        "not, 2 on bad input.")
    p.add_argument("model_or_config_dir", metavar="MODEL_OR_CONFIG_DIR",
                   help="a local checkpoint/config directory or a shipped shape "
                   "(qwen3-0.6b, qwen3-8b, qwen3-30b-a3b)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--speculative-config", "-sc", type=_json, default=None)
    p.add_argument("--cpu-offload-gb", type=float, default=0.0)
    p.add_argument("--cpu-offload-params", nargs="*", default=None)
    p.add_argument("--offload-group-size", type=int, default=0)
    p.add_argument("--offload-num-in-group", type=int, default=None)
    p.add_argument("--offload-prefetch-step", type=int, default=None)
    p.add_argument("--offload-backend", default="auto", choices=["auto", "uva", "prefetch"])
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--calculate-kv-scales", action="store_true")
    p.add_argument("--quantization", "-q", default=None)
    p.add_argument("--quantization-config", type=_json, default=None,
                   help="an online method's specs (with --quantization online / fp8_per_*)")
    p.add_argument("--moe-backend", default="auto",
                   type=lambda s: s.lower().replace("-", "_"))  # as vLLM normalises it
    p.add_argument("--disable-sliding-window", action="store_true")
    p.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling", "draft"])
    p.add_argument("--convert", default="auto")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    p.add_argument("--optimization-level", type=int, default=2, choices=[0, 1, 2, 3],
                   help="also -O<n>")
    p.add_argument("--compilation-config", "-cc", type=_json, default=None,
                   help="also -cc.<key>=<value>")
    p.add_argument("--additional-config", type=_json, default=None)
    # which contexts decode graphs cover (context_lines), not eligibility
    p.add_argument("--max-model-len", default=None)
    # where the graph pool's memory comes from (memory_lines), not eligibility
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-memory-bytes", default=None)
    return p


MEMORY_FLAGS = ("gpu_memory_utilization", "kv_cache_memory_bytes")
_DOTTED_CC = re.compile(r"^(?:-cc|--compilation-config)\.([\w.]+)(?:=(.*))?$")


def normalise_flags(argv: list[str]) -> list[str]:
    """`vllm serve`'s flag spellings that plain argparse does not read, as vLLM's
    `FlexibleArgumentParser` reads them: `--max_model_len` for `--max-model-len`, `-O3` / `-O 3`
    / `-O=3` for `--optimization-level 3`, `-cc.<key>=<value>` (or `-cc.<key> <value>`, dotted
    keys nest) merged into one `--compilation-config` JSON that replaces an earlier one."""
    out: list[str] = []
    dotted: dict = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if (m := _DOTTED_CC.match(arg)):
            value = m.group(2)
            if value is None and i + 1 < len(argv):
                i, value = i + 1, argv[i + 1]
            try:
                value = json.loads(value)
            except (TypeError, json.JSONDecodeError):
                pass
            *parents, leaf = m.group(1).split(".")
            node = dotted
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = value
        elif arg.startswith("-O") and arg != "-O" and not arg.startswith("-O."):
            out += ["--optimization-level", arg[3:] if arg[2] == "=" else arg[2:]]
        elif arg == "-O":
            out.append("--optimization-level")
        elif arg.startswith("--"):
            key, eq, value = arg.partition("=")
            out.append(key.replace("_", "-") + eq + value)
        else:
            out.append(arg)
        i += 1
    if dotted:
        out += ["--compilation-config", json.dumps(dotted)]
    return out


def prefill_steps_lines(cfg: PluginConfig, fa3_problem: str | None) -> list[str]:
    """How steps that carry prefill tokens will run under plugin config `cfg`: graphed or eager,
    and which attention kernel they take (`fa3_problem`: why vLLM's FlashAttention 3 cannot run
    on this machine, None when it can)."""
    buckets = cfg.token_buckets
    if cfg.mixed_graphs:
        how = (f"graphed, one graph per query-token bucket ({len(buckets)} buckets, "
               f"{buckets[0]}..{buckets[-1]} tokens, fitted to --max-num-batched-tokens at "
               "start-up; larger steps eager)")
    else:
        how = ("eager (mixed_graphs is off; only pure-decode steps are graphed; remove "
               "\"mixed_graphs\": false from --additional-config to graph them)")
    choice = cfg.prefill_attention
    if choice == "triton":
        kernel = "the plugin's Triton kernel (prefill_attention triton)"
    elif fa3_problem is None:
        kernel = f"FlashAttention 3 (prefill_attention {choice})"
    else:
        kernel = (f"the plugin's Triton kernel (prefill_attention {choice}: FlashAttention 3 "
                  f"is not available on this machine: {fa3_problem})")
    return [f"steps with prefill tokens: {how}", f"  their attention: {kernel}"]


def capture_lines(cfg: PluginConfig) -> list[str]:
    """When graphs will be captured under plugin config `cfg`."""
    if cfg.precapture:
        when = "all at start-up (precapture)"
    elif cfg.idle_capture:
        when = (f"while the engine waits for requests (idle_capture), or lazily on a key's "
                f"first use after {cfg.warmup_steps} eager warm-up step(s), whichever comes "
                "first")
    else:
        when = (f"lazily, on a key's first use after {cfg.warmup_steps} eager warm-up step(s) "
                "(idle_capture is off; \"idle_capture\": true captures them while the engine "
                "waits for requests, \"precapture\": true at start-up)")
    return [f"graphs are captured: {when}"]


def sampling_lines(cfg: PluginConfig) -> list[str]:
    """Who samples a step's tokens under plugin config `cfg`."""
    if not cfg.sample_in_graph:
        return ["sampling: vLLM's sampler after each step, every parameter as in stock vLLM "
                "(\"sample_in_graph\": true samples batches of up to 64 requests from CUDA "
                "graphs; off until measured on a GPU)"]
    return ["sampling: batches of up to 64 requests whose random rows use top-k 1..64 "
            "(temperature, top-p, min-p, min-tokens, allowed / bad words, structured output "
            "beside it) from CUDA graphs (sample_in_graph); seeds, logprobs, penalties, logit "
            "bias and larger batches by vLLM's sampler (moe_graphs_sampler_fallbacks_total "
            "says why)"]


def moe_padding_lines(cfg: PluginConfig, num_experts: int | None) -> list[str]:
    """Whether the padding rows of padded steps will skip the MoE experts under plugin config
    `cfg` (none for a dense model, `num_experts` None)."""
    if not num_experts:
        return []
    if not cfg.skip_moe_padding:
        how = ("routed through the experts like real tokens (skip_moe_padding is off; "
               "\"skip_moe_padding\": true, the default, lets them skip the experts)")
    elif num_experts <= 64:
        how = (f"routed through the experts like real tokens: {num_experts} experts (skipping "
               "them needs more than 64)")
    else:
        how = ("skip the experts wherever vLLM runs its Triton experts (the engine log says in "
               "how many MoE layers), their expert ids written by " + (
                   "the plugin's routing kernel (fuse_moe_padding_mask)"
                   if cfg.fuse_moe_padding_mask else "one mask launch per MoE layer after "
                   "vLLM's routing (\"fuse_moe_padding_mask\": true folds it into the routing)"))
    return [f"padding rows of padded steps: {how}"]


def memory_lines(cfg: PluginConfig, gpu_memory_utilization: float,
                 kv_cache_memory_bytes: str | None, estimate_graphs: bool) -> list[str]:
    """Where the graph pool's memory comes from (integration/worker.py's accounting):
    `estimate_graphs` is vLLM's VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS."""
    budget = cfg.graph_memory_budget_mib
    if not budget:
        return ["graph memory: none (graph_memory_budget_mib 0: every capture is denied, steps "
                "run eager with memory_budget)"]
    from vllm_moe_graphs.integration.config_facts import (
        POOL_BESIDE_FIXED_KV,
        POOL_IN_KV_CACHE,
        graph_pool_source,
    )

    source = graph_pool_source(estimate_graphs, bool(kv_cache_memory_bytes))
    if source == POOL_BESIDE_FIXED_KV:
        where = (f"not taken out of the KV cache (--kv-cache-memory-bytes "
                 f"{kv_cache_memory_bytes} sizes it): keep that much GPU memory free beyond it")
    elif source == POOL_IN_KV_CACHE:
        where = (f"taken out of the KV cache memory within --gpu-memory-utilization "
                 f"{gpu_memory_utilization:g}, as vLLM does for its own graphs")
    else:
        where = ("not taken out of the KV cache (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0): "
                 "keep that much GPU memory free beyond --gpu-memory-utilization "
                 f"{gpu_memory_utilization:g}")
    return [f"graph memory: a pool of up to {budget} MiB (graph_memory_budget_mib), {where}"]


def context_lines(cfg: PluginConfig, max_model_len: int) -> list[str]:
    """Which decode contexts the graphs cover under plugin config `cfg`."""
    from vllm_moe_graphs.graphs.buckets import context_coverage

    uncovered = context_coverage(cfg.context_buckets, max_model_len)
    if uncovered is not None:
        return [uncovered]
    return [f"decode graphs cover every context up to max_model_len {max_model_len}"]


def _max_model_len(given: str | None, hf: dict, sliding_window_off: bool) -> int:
    """--max-model-len as vLLM reads it, else the checkpoint's (max_position_embeddings; the
    window when --disable-sliding-window caps it)."""
    if given not in (None, "auto", "-1"):
        from vllm_moe_graphs.integration.config_facts import parse_max_model_len

        return parse_max_model_len(given)
    derived = int(hf.get("max_position_embeddings") or 0)
    # transformers keeps a Qwen3 config's window only with use_sliding_window
    window = int(hf.get("sliding_window") or 0) if hf.get("use_sliding_window") else 0
    if sliding_window_off and 0 < window < derived:
        return window
    return derived


def report_for(argv: list[str]) -> tuple[str, DecodeGraphCapability, list[str], list[str]]:
    """Parse `MODEL [engine args]`; return (model, report, the lines on how steps run (prefill
    tokens, decode contexts, MoE padding rows, graph memory), flags doctor did not read). The
    arguments are parsed before vLLM is imported, so `--help` and usage errors answer at
    once."""
    args, unread = build_parser().parse_known_args(normalise_flags(argv))

    from vllm import EngineArgs

    from vllm_moe_graphs.integration.attention.flash_attn import flash_attn_problem
    from vllm_moe_graphs.integration.config_facts import (
        facts_from_engine_args,
        vllm_sets_aside_graph_memory,
    )
    from vllm_moe_graphs.model_configs import read_hf_config, resolve_model

    cfg = PluginConfig.from_additional_config(args.additional_config)
    prefill = prefill_steps_lines(cfg, flash_attn_problem())

    model = resolve_model(args.model_or_config_dir)
    hf = read_hf_config(model)
    kwargs = {k: v for k, v in vars(args).items()
              if k not in ("model_or_config_dir", "max_model_len", *MEMORY_FLAGS)
              and v is not None}
    if "cpu_offload_params" in kwargs:
        kwargs["cpu_offload_params"] = set(kwargs["cpu_offload_params"])
    engine_args = EngineArgs(model=model, **kwargs)
    max_model_len = _max_model_len(args.max_model_len, hf, args.disable_sliding_window)
    steps = (prefill + context_lines(cfg, max_model_len) + capture_lines(cfg)
             + moe_padding_lines(cfg, hf.get("num_experts")) + sampling_lines(cfg)
             + memory_lines(cfg, args.gpu_memory_utilization, args.kv_cache_memory_bytes,
                            vllm_sets_aside_graph_memory()))
    facts = facts_from_engine_args(engine_args, hf)
    report = config_capability(facts)
    # said only where the plugin would take it over (on a GPU host: no_cuda aside)
    if set(report.reasons) <= {Reason.ELIGIBLE, Reason.NO_CUDA}:
        steps += [f"MOE_GRAPHS_UNPROVEN: {x} taken over, not yet proven against stock vLLM on a "
                  "GPU: for parity runs, not for serving" for x in unproven_taken_over(facts)]
    return model, report, steps, unread


def main(argv: list[str]) -> int:
    try:
        model, report, steps, unread = report_for(argv)
    except ValueError as exc:
        print(f"moe-graphs doctor: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    from vllm_moe_graphs.integration.signatures import vllm_version

    print(f"moe-graphs doctor (vllm_moe_graphs {__version__}, vLLM {vllm_version()})")
    print(f"model: {model}")
    if unread:
        print(f"not read (do not affect eligibility): {' '.join(unread)}")
    print(report.render())
    if report.eligible:
        print("runtime proofs (KV storage bound, one owner, same device, per-layer KV write) are "
              "checked when the engine starts; see moe_graphs_capability on /metrics")
    for line in steps:
        print(line)
    return EXIT_ELIGIBLE if report.eligible else EXIT_NOT_ELIGIBLE
