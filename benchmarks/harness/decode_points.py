"""How a mode worker measures its points: one repeat of one (batch, context) point under one
sampling preset through the engine (`run_point`: TPOT samples are the gaps between decode-only
steps), every point and preset within its deadlines one mode at a time (`measure_points`), or
point by point as the parent sends them (`serve_commands`, `--interleave`). The engine and the
request builders come in a `Bench`.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from benchmarks.harness.protocol import DONE, READY, SLACK_STEPS, WorkerResult, WorkerSpec
from benchmarks.harness.sampling import GREEDY, PRESETS

MAX_CONSECUTIVE_FAILURES = 2


def say(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


def format_error(exc: BaseException, limit: int = 2500) -> str:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    head = f"{type(exc).__name__}: {exc}"
    tail = tb[-limit:]
    return head if head in tail else f"{head}\n...{tail}"


def decode_intervals(chains: list[list[float]]) -> list[float]:
    """Gaps (ms) between consecutive decode-only step returns, chain by chain."""
    out: list[float] = []
    for chain in chains:
        out += [(b - a) * 1e3 for a, b in zip(chain, chain[1:])]
    return out


def run_point(
    llm: Any,
    spec: WorkerSpec,
    batch: int,
    context: int,
    tag: str,
    rng: random.Random,
    resolved: dict[str, Any],
    make_params: Callable[[int, str, int], Any],
    make_prompt: Callable[[list[int]], Any],
    sampling: str = GREEDY,
) -> tuple[list[float], float]:
    """One repeat of one (batch, context) point, its requests sampling under preset `sampling`
    (`make_params(max_tokens, sampling, request index)`): returns (decode step ms, prefill
    seconds)."""
    engine = llm.llm_engine
    mbt = int(resolved.get("max_num_batched_tokens") or 8192)
    prefill_steps = math.ceil(batch * context / max(1, mbt - batch)) + 1
    wanted = spec.warmup_steps + spec.decode_tokens
    room = int(resolved.get("max_model_len") or 0) - context
    max_tokens = min(wanted + prefill_steps + SLACK_STEPS, room)
    if max_tokens < wanted + 2:
        raise ValueError(
            f"max_model_len leaves {room} new tokens at context {context}; need {wanted + 2}"
        )
    blocks, block = resolved.get("num_gpu_blocks"), resolved.get("block_size")
    if blocks and block:
        need = batch * math.ceil((context + max_tokens) / block) * block
        if need > blocks * block:
            raise RuntimeError(
                f"KV cache holds {blocks * block} tokens, batch {batch} x "
                f"{context + max_tokens} needs {need}: the batch would not run concurrently "
                f"(raise --gpu-memory-utilization or lower --num-layers)"
            )
    params = [make_params(max_tokens, sampling, i) for i in range(batch)]
    prompts = [
        make_prompt([rng.randrange(spec.vocab_size) for _ in range(context)]) for _ in range(batch)
    ]
    engine_inputs = llm._preprocess_cmpl(prompts)  # what LLM.generate does with token prompts
    ids = [f"{tag}-{i}" for i in range(batch)]
    counts = dict.fromkeys(ids, 0)
    chains: list[list[float]] = [[]]
    t_start, t_ready = time.perf_counter(), None
    try:
        for rid, engine_input, p in zip(ids, engine_inputs, params):
            engine.add_request(rid, engine_input, p)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            if not outputs:
                continue
            was_ready = t_ready is not None
            new: dict[str, int] = {}
            finished = False
            for out in outputs:
                n = sum(len(c.token_ids) for c in out.outputs)
                new[out.request_id] = new.get(out.request_id, 0) + n
                finished = finished or out.finished
            for rid, n in new.items():
                counts[rid] = counts.get(rid, 0) + n
            decode_only = (
                was_ready
                and not finished
                and len(new) == batch
                and all(n == 1 for n in new.values())
            )
            if decode_only:
                chains[-1].append(now)
            elif chains[-1]:
                chains.append([])
            if t_ready is None and all(c >= 1 for c in counts.values()):
                t_ready = now
    finally:
        if engine.has_unfinished_requests():
            engine.abort_request(ids)
    steps = decode_intervals(chains)[spec.warmup_steps :][: spec.decode_tokens]
    if len(steps) < max(1, spec.decode_tokens // 2):
        raise RuntimeError(
            f"only {len(steps)} decode-only steps at batch {batch} context {context} sampling "
            f"{sampling} (wanted {spec.decode_tokens}); tokens per request: "
            f"{sorted(set(counts.values()))}"
        )
    prefill_s = (t_ready or time.perf_counter()) - t_start
    return steps, prefill_s


@dataclasses.dataclass(slots=True)
class Bench:
    """What measuring needs: the engine, the spec, the result it fills and how to save it, and
    the vLLM request builders (`make_params(max_tokens, sampling preset, request index)`)."""

    llm: Any
    spec: WorkerSpec
    result: WorkerResult
    save: Callable[[], None]
    make_params: Callable[[int, str, int], Any]
    make_prompt: Callable[[list[int]], Any]


def measure_points(bench: Bench) -> None:
    spec, result = bench.spec, bench.result
    rng = random.Random(spec.seed)
    durations: dict[tuple[int, int, str], float] = {}
    skipped: dict[tuple[int, int, str], int] = {}
    failures_in_row = 0
    for rep in range(spec.repeats):
        for batch, context, sampling in spec.runs():
            key = (batch, context, sampling)
            point = result.point(*key)
            if point.error is not None:
                continue
            # A started engine measures at least one point if the run's end allows: its start-up
            # time is already spent. Then repeat 1 keeps to its deadline, repeats 2.. to theirs.
            deadline = (
                spec.hard_deadline
                if not durations
                else spec.first_pass_deadline
                if rep == 0
                else spec.soft_deadline
            )
            est = durations.get(key) or max([5.0, *(2 * d for d in durations.values())])
            if deadline is not None and time.time() + est > deadline:
                skipped[key] = skipped.get(key, 0) + 1
                continue
            t0 = time.perf_counter()
            ok = measure_one(bench, rng, batch, context, rep, f"r{rep}b{batch}c{context}",
                             sampling=sampling)
            if not ok:
                failures_in_row += 1
                if failures_in_row >= MAX_CONSECUTIVE_FAILURES:
                    raise RuntimeError(
                        f"{failures_in_row} points failed in a row; giving up on mode {spec.mode}"
                    )
                continue
            failures_in_row = 0
            durations[key] = time.perf_counter() - t0
    result.skipped = [
        {"batch": b, "context": c, "sampling": s, "repeats_skipped": n, "reason": "time budget"}
        for (b, c, s), n in sorted(skipped.items())
    ]


def measure_one(
    bench: Bench,
    rng: random.Random,
    batch: int,
    context: int,
    rep: int,
    tag: str,
    record: bool = True,
    sampling: str = GREEDY,
) -> bool:
    """One repeat of one point under preset `sampling`: recorded in `result` (unless `record` is
    False: a warm-up) and saved. False when it failed (the error is recorded on the point)."""
    spec, result, save = bench.spec, bench.result, bench.save
    point = result.point(batch, context, sampling)
    where = f"b={batch} c={context}" + ("" if sampling == GREEDY else f" {sampling}")
    tag += "" if sampling == GREEDY else f"-{sampling}"
    t0 = time.perf_counter()
    try:
        steps, prefill_s = run_point(bench.llm, spec, batch, context, tag, rng, result.resolved,
                                     bench.make_params, bench.make_prompt, sampling=sampling)
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        point.error = format_error(exc)
        say(f"{spec.model} {spec.mode} {where}: FAILED {type(exc).__name__}: {exc}")
        save()
        return False
    p50 = statistics.median(steps)
    if record:
        point.step_ms += [round(s, 4) for s in steps]
        point.repeat_p50_ms.append(round(p50, 4))
        point.prefill_s.append(round(prefill_s, 3))
        point.point_s.append(round(time.perf_counter() - t0, 3))
        point.repeats_done += 1
        save()
    what = f"rep {rep + 1}/{spec.repeats}" if record else "warm-up"
    say(
        f"{spec.model} {spec.mode} {what} {where}: p50 {p50:.3f} ms over "
        f"{len(steps)} steps, prefill {prefill_s:.2f} s, point {time.perf_counter() - t0:.1f} s"
    )
    return True


def serve_commands(bench: Bench, commands: Any = None) -> None:
    """Interleaved runs (`benchmarks.decode --interleave`): the parent keeps every mode's engine
    up and sends one line per repeat of a point, mode after mode, so that every mode samples the
    host at the same moments. Commands: `point BATCH CONTEXT REP [SAMPLING]` (REP -1: a
    warm-up, not recorded; SAMPLING a preset, default greedy) and `quit`; each gets a DONE line
    back. Ends at `quit` or end of input."""
    commands = sys.stdin if commands is None else commands
    rng = random.Random(bench.spec.seed)
    print(READY, flush=True)
    for line in commands:
        words = line.split()
        if not words:
            continue
        if words == ["quit"]:
            break
        try:
            if words[0] != "point" or len(words) not in (4, 5):
                raise ValueError(f"unknown command {line.strip()!r}")
            batch, context, rep = (int(w) for w in words[1:4])
            sampling = words[4] if len(words) == 5 else GREEDY
            if sampling not in PRESETS:
                raise ValueError(f"unknown sampling preset {sampling!r}")
        except ValueError as exc:
            print(f"{DONE} error {exc}", flush=True)
            continue
        ok = measure_one(bench, rng, batch, context, max(rep, 0), f"i{rep}b{batch}c{context}",
                         record=rep >= 0, sampling=sampling)
        print(f"{DONE} {'ok' if ok else 'error'}", flush=True)
