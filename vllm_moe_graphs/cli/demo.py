"""`moe-graphs demo`: a first look with no model at hand.

Runs a Qwen3 model shape shipped with the package (config only, vLLM's dummy weights, token-id
prompts) through real vLLM with the plugin loaded, and prints what happened: the capability
report, graph replays and eager fallbacks from the plugin's metrics, and decode tokens/s.
Without a CUDA GPU it says so and prints the doctor report instead.
"""

from __future__ import annotations

import argparse
import re
import sys
import time

from vllm_moe_graphs.model_configs import SHAPES, shape_dir

EXIT_OK, EXIT_NO_GPU = 0, 3  # 2 is argparse's bad input


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-graphs demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-0.6b", choices=SHAPES, help="shipped model shape")
    p.add_argument("--batch", type=int, default=8, help="concurrent requests (default 8)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request")
    p.add_argument("--num-layers", type=int, default=None,
                   help="override the layer count (smaller = faster start; default: the shape's)")
    p.add_argument("--attention-backend", default=None,
                   help="vLLM attention backend (default: the plugin's, CUSTOM, on an eligible "
                        "setup; any other backend keeps stock vLLM)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                   help="share of the GPU's memory vLLM may take (default 0.5)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="a fixed KV cache size in bytes, as vLLM's flag of that name (default: "
                        "what --gpu-memory-utilization leaves after profiling)")
    return p


def _positive(parser: argparse.ArgumentParser, name: str, value: int | None) -> None:
    if value is not None and value <= 0:
        parser.error(f"--{name.replace('_', '-')}={value} must be a positive integer")


def _series(text: str, name: str, label: str = "reason") -> list[tuple[str, float]]:
    """(value of `label`, sample value) of every sample of `name` in Prometheus text."""
    out = []
    for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE):
        found = re.search(rf'{label}="([^"]*)"', m.group(1) or "")
        out.append((found.group(1) if found else "", float(m.group(2))))
    return out


def _model_dir(model: str, num_layers: int | None) -> str:
    src = shape_dir(model)
    if num_layers is None:
        return src
    import json
    import os
    import tempfile

    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = num_layers
    dst = tempfile.mkdtemp(prefix=f"moe_graphs_demo_{model}_")
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("batch", "prompt_len", "max_tokens", "num_layers", "kv_cache_memory_bytes"):
        _positive(parser, name, getattr(args, name))

    import torch

    if not torch.cuda.is_available():
        print("moe-graphs demo: no CUDA GPU on this machine. The demo runs real vLLM decode on an "
              "NVIDIA GPU; here is what the plugin decides for this model instead:\n")
        from vllm_moe_graphs.cli.doctor import main as doctor_main

        doctor_main([args.model])
        return EXIT_NO_GPU

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_moe_graphs.metrics_transport import collect_text

    model_dir = _model_dir(args.model, args.num_layers)
    print(f"[demo] starting vLLM with {args.model} (dummy weights) ...", flush=True)
    t0 = time.perf_counter()
    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True,
              max_model_len=args.prompt_len + args.max_tokens + 16,
              max_num_seqs=max(args.batch, 1), gpu_memory_utilization=args.gpu_memory_utilization,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes,
              attention_backend=args.attention_backend, seed=0)
    startup = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=[(7 * i + j) % 1000 + 10
                                              for j in range(args.prompt_len)])
               for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    t1 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t1
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)

    text = collect_text()
    reasons = [lbl for lbl, v in _series(text, "moe_graphs_capability") if v == 1]
    replays = sum(v for _, v in _series(text, "moe_graphs_replays_total"))
    fallbacks = [(lbl, v) for lbl, v in _series(text, "moe_graphs_eager_fallbacks_total") if v]
    print(f"[demo] start-up {startup:.1f} s; generated {generated} tokens for {args.batch} "
          f"requests in {wall:.2f} s: {generated / wall:.0f} tokens/s")
    print(f"[demo] capability: {', '.join(reasons) or 'not recorded'}")
    print(f"[demo] graph replays: {replays:.0f}; eager fallbacks: "
          f"{', '.join(f'{lbl} {v:.0f}' for lbl, v in fallbacks) or 'none'}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
