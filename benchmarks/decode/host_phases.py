"""The host side of a decode step, phase by phase, on any vLLM build (the CPU build included).

    PYTHONPATH=.cpu-vllm VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 \\
        python -m benchmarks.decode.host_phases [--model DIR] [--batches 1,8,64] [--steps 40]

Starts one in-process engine (`enforce_eager`; a tiny random Qwen3 checkpoint built on the spot
unless --model names one), keeps `batch` greedy requests decoding and prints, per batch, the
inclusive wall time per step of the engine's and runner's phase methods
(`profile_steps.PHASES`). On a machine without a GPU the model's forward is CPU work, but the
phases around it (scheduler, input preparation, sampling, bookkeeping, output processing) run
the same Python as on the GPU: this is where vLLM's V1 runner spends its host time per step.
The GPU version of this table is part of `BENCH_PROFILE=1` runs (`profile_steps.py`).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from typing import Any

from benchmarks.harness import profile_steps
from benchmarks.harness.mode_worker import request_params


def measure(llm: Any, batch: int, context: int, steps: int, vocab: int) -> list[str]:
    """Phase table for one batch (lines of text)."""
    from vllm.inputs import TokensPrompt

    def make_params(n: int, sampling: str, index: int) -> Any:
        return request_params(n, sampling, 0, index)

    d = profile_steps._Decoding(llm, batch, context, 2 * steps + 32, vocab, make_params,
                                lambda ids: TokensPrompt(prompt_token_ids=ids), f"hp{batch}")
    try:
        d.until_decoding()
        profile_steps._timed(d, 8)
        base = profile_steps._timed(d, steps)
        with profile_steps._PhaseTimers(llm) as timers:
            timed = profile_steps._timed(d, steps)
    finally:
        d.close()
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    return [f"## batch {batch} context {context}: {steps} steps; step p50 "
            f"{statistics.median(base):.3f} ms (with timers {statistics.median(timed):.3f})",
            *timers.report(steps)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.decode.host_phases",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint dir (default: a tiny random Qwen3, built now)")
    ap.add_argument("--batches", default="1,8,64", help="comma-separated (default: 1,8,64)")
    ap.add_argument("--context", type=int, default=32, help="prompt tokens (default: 32)")
    ap.add_argument("--steps", type=int, default=40, help="steps per phase (default: 40)")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if min(batches) < 1 or args.steps < 1 or args.context < 1:
        ap.error(f"batches, --steps and --context must be >= 1, got {args.batches!r}, "
                 f"{args.steps}, {args.context}")
    model = args.model
    if model is None:
        from tests.tiny_models import build_checkpoint

        model = build_checkpoint(tempfile.mkdtemp(prefix="host-phases-"))
    from vllm import LLM

    llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              seed=0, max_num_seqs=max(batches), max_model_len=args.context + 2 * args.steps + 96,
              enforce_eager=True, enable_prefix_caching=False)
    vocab = min(llm.llm_engine.model_config.get_vocab_size(), 1000)
    for batch in batches:
        print("\n".join(measure(llm, batch, args.context, args.steps, vocab)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
