"""Where a prefill step's time goes: with `BENCH_PROFILE_PREFILL=T1,T2,...` (query tokens;
`benchmarks/gpu/run.sh` passes it on) the mode worker also profiles prefill steps
(`profile_prefill_run`): for each T, rounds of T // context prompts of `context` random tokens
each, one output token, so each round is one engine step that prefills T tokens when the step
budget (`max_num_batched_tokens`) holds them; a few untimed rounds first (lazy warm-up and
capture), then timed rounds and profiled rounds: wall time per round and GPU kernel time per
round with the top kernels, in `<dir>/profile-prefill-<model>-<mode>.txt`. Side by side across
modes it says where a GPU-bound prefill step's time goes (the plugin's one graph against
stock's compiled pieces). The decode profile: `profile_steps`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks.harness.profile_steps import kernel_lines


def _prefill_round(llm: Any, n: int, length: int, vocab: int, seed: int,
                   make_params: Callable[[int], Any],
                   make_prompt: Callable[[list[int]], Any]) -> tuple[float, int]:
    """`n` prompts of `length` random tokens, one output token each, stepped to completion:
    (wall ms, engine steps)."""
    import random

    rng = random.Random(seed)
    engine = llm.llm_engine
    prompts = [make_prompt([rng.randrange(vocab) for _ in range(length)]) for _ in range(n)]
    params = make_params(1)
    t0 = time.perf_counter()
    for i, engine_input in enumerate(llm._preprocess_cmpl(prompts)):
        engine.add_request(f"prefill-{seed}-{i}", engine_input, params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return (time.perf_counter() - t0) * 1e3, steps


def profile_prefill(llm: Any, tokens: int, context: int, vocab: int,
                    make_params: Callable[[int], Any], make_prompt: Callable[[list[int]], Any],
                    label: str, rounds: int = 6, warmup_rounds: int = 4) -> str:
    """The report for prefill steps of `tokens` query tokens (text)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    n = max(1, tokens // context)
    lines = [f"## {label} prefill {n * context} tokens ({n} prompts x {context}): "
             f"{rounds} rounds per phase after {warmup_rounds} untimed"]
    seed = 1000 * tokens
    for _ in range(warmup_rounds):
        _prefill_round(llm, n, context, vocab, seed, make_params, make_prompt)
        seed += 1
    torch.cuda.synchronize()
    base = []
    for _ in range(rounds):
        base.append(_prefill_round(llm, n, context, vocab, seed, make_params, make_prompt))
        seed += 1
    walls = [w for w, _ in base]
    lines.append(f"baseline round ms: p50 {statistics.median(walls):.2f}  min {min(walls):.2f}  "
                 f"engine steps per round {statistics.median([s for _, s in base]):.0f}")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(rounds):
            _prefill_round(llm, n, context, vocab, seed, make_params, make_prompt)
            seed += 1
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    lines += kernel_lines(prof.key_averages(), wall, rounds, "round")
    return "\n".join(lines) + "\n"


def profile_prefill_run(llm: Any, spec: Any, tokens: list[int],
                        make_params: Callable[[int], Any],
                        make_prompt: Callable[[list[int]], Any], out_dir: str) -> str:
    """Profile prefill steps of each token count at the spec's first context; the report's
    path."""
    import os

    path = os.path.join(out_dir, f"profile-prefill-{spec.model}-{spec.mode}.txt")
    with open(path, "w") as f:
        for count in tokens:
            try:
                text = profile_prefill(llm, count, spec.contexts[0], spec.vocab_size,
                                       make_params, make_prompt, f"{spec.model} {spec.mode}")
            except Exception as exc:  # noqa: BLE001 - a report line, the run goes on
                text = f"## prefill {count}: profiling failed: {type(exc).__name__}: {exc}\n"
            f.write(text)
            f.flush()
            print(f"[bench] prefill profile {spec.model} {spec.mode} {count} tokens: written",
                  flush=True)
    return path


def prefill_token_counts(raw: str, context: int | None = None,
                         max_num_seqs: int | None = None) -> list[int]:
    """`BENCH_PROFILE_PREFILL`'s value: comma-separated positive token counts. With the run's
    first context and max_num_seqs (its largest batch), each count's T // context prompts must
    fit one step: with fewer sequences allowed the engine prefills them one by one, and the
    report would be of steps of `context` tokens."""
    try:
        counts = [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) <= 0:
        raise ValueError(f"BENCH_PROFILE_PREFILL={raw!r}: expected positive token counts "
                         "separated by commas, e.g. BENCH_PROFILE_PREFILL=2048,8192")
    if context and max_num_seqs:
        need = max(max(1, t // context) for t in counts)
        if need > max_num_seqs:
            raise ValueError(
                f"BENCH_PROFILE_PREFILL={raw!r} at context {context} prefills {need} prompts in "
                f"one step, but the largest --batches value caps max_num_seqs at {max_num_seqs}: "
                f"the engine would prefill them one at a time. Add a batch of at least {need} "
                f"(e.g. --batches 1,{need}) or raise --contexts")
    return counts
